"""Temperature scaling, ``softmax(logits / T)`` with ``T > 0`` (Guo et al. 2017)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from torchcal._fast_exp import scaled_exp
from torchcal.calibrators.base import Calibrator, sample_weights
from torchcal.distributed import ProcessGroup, all_reduce_
from torchcal.fit import ConvergenceWarning, FitRecord

__all__ = ["TemperatureScaling", "fit_inverse_temperature", "inverse_temperature_start"]

# Past this many nats between a row's two largest logits the softmax is one-hot in float64: larger
# inverse temperatures cannot change the loss, so the search stops there (perfectly separable data).
_MAX_SCALED_MARGIN = 1e4
# Elements per chunk of rows. On the CPU a chunk (about 128k elements) stays in cache while the
# exponentials and the three row sums are formed from it; on a GPU every chunk costs a dozen kernel
# launches, so chunks are as large as the temporaries allow (64 MiB in float32).
_CHUNK_ELEMENTS = 1 << 17
_DEVICE_CHUNK_ELEMENTS = 1 << 24
# Newton converges quadratically, so most of its passes only get near the optimum. From four times
# this many logits (over all processes), that part runs on an evenly spaced subsample of about this
# many, and the full passes only polish: three instead of about seven.
_SUBSAMPLE_ELEMENTS = 1 << 20


class TemperatureScaling(Calibrator):
    """Divide the logits by one temperature ``T > 0``; keeps the argmax (and accuracy).

    ``T`` is stored as ``log_temperature``, so it can never become negative. The log-loss fit uses
    a dedicated solver, :func:`fit_inverse_temperature` (safeguarded Newton on ``1/T``, in which the
    loss is convex), in the precision of the logits with float64 sums; other losses use the
    generic L-BFGS driver.

    Example:
        >>> import torch
        >>> from torchcal import TemperatureScaling
        >>> logits = 4 * torch.randn(1000, 10)
        >>> labels = torch.distributions.Categorical(logits=logits / 4).sample()
        >>> ts = TemperatureScaling().fit(logits, labels)
        >>> 3.0 < ts.temperature < 5.5
        True
    """

    _fit_in_float64 = False
    log_temperature: Tensor

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"log_temperature": torch.zeros((), dtype=torch.float64)}

    @property
    def temperature(self) -> float:
        """The fitted temperature ``T`` (``inf`` when the scores carry no usable information)."""
        return math.exp(self.log_temperature.item())

    def _scores(self, features: Tensor) -> Tensor:
        return features * torch.exp(-self.log_temperature.to(features.dtype))

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        if loss != "log":
            return super()._fit(features.double(), labels, weights, loss, max_iter, process_group)
        beta, record = fit_inverse_temperature(features, labels, weights, max_iter=max_iter, process_group=process_group)
        with torch.no_grad():
            self.log_temperature.fill_(-math.log(beta) if beta > 0 else math.inf)
        return record


def fit_inverse_temperature(
    logits: Tensor,
    labels: Tensor,
    weights: Tensor | None = None,
    *,
    max_iter: int = 100,
    rtol: float | None = None,
    process_group: ProcessGroup | None = None,
) -> tuple[float, FitRecord]:
    """Minimise the (weighted) mean log-loss of ``softmax(beta * logits)`` over ``beta >= 0``.

    The loss is convex in ``beta`` with derivative ``mean(E_q[z] - z_y)`` and second derivative
    ``mean(Var_q[z])``. Newton steps are taken on ``log(beta)`` (better scaled far from the
    optimum) inside a bracket on the sign of the derivative, with bisection when a step would
    leave it, so it converges quadratically in about five passes from ``beta = 1``; on large data
    it starts from the fit on a subsample, and three passes polish that. Each pass
    reads the logits once, chunk by chunk: one exponential per entry, and the three row sums the
    loss and both derivatives need, accumulated in float64 (one host sync per iteration).

    Args:
        logits: (N, K) scores, float32 or float64; the passes run in that precision.
        labels: (N,) class indices. weights: optional (K,) per-class weights.
        rtol: stop when a step changes ``beta`` by less than this, relatively; the default is
            ``1e-9`` in float64 and ``100 * eps`` (about ``1e-5``) in float32, after which the
            quadratic convergence leaves ``beta`` far more accurate than the step.
        process_group: data-parallel fit over a ``torch.distributed`` group.

    Returns:
        ``(beta, record)``. ``beta == 0`` (``T = inf``) when the scores are not positively
        related to the labels; ``beta`` at its upper limit (1e4 nats between a median row's two
        largest scores) when the loss keeps falling up to it, i.e. the data are (all but) perfectly
        separable, every true-class logit the strict row maximum. Both cases warn.
    """
    n, k = logits.shape
    if rtol is None:
        rtol = max(1e-9, 100 * torch.finfo(logits.dtype).eps)
    sample_w = sample_weights(labels, weights, process_group)
    z_min, z_max = torch.aminmax(logits, dim=1)
    z_true = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    z_true_centred = z_true - z_max
    rows = max(1, (_CHUNK_ELEMENTS if logits.device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS) // k)

    # Two chunk-sized work buffers for every pass: fresh chunk-sized temporaries, freed between
    # small long-lived allocations, fragment the CPU heap until it holds about the data's size.
    buffers = logits.new_empty(2, min(rows, n), k)

    def moments(beta: float) -> tuple[float, float, float]:
        """Loss, first and second derivative at ``beta``: one pass over the logits."""
        totals = torch.zeros(3, dtype=torch.float64, device=logits.device)
        for start in range(0, n, rows):
            c = slice(start, start + rows)
            centred, e = buffers[:, : min(rows, n - start)]
            torch.sub(logits[c], z_max[c].unsqueeze(1), out=centred)  # <= 0: exp cannot overflow
            scaled_exp(centred, beta, out=e)
            s0 = e.sum(1)
            s1 = e.mul_(centred).sum(1)
            s2 = e.mul_(centred).sum(1)
            mean = s1 / s0
            per_row = torch.stack([s0.log() - beta * z_true_centred[c], mean - z_true_centred[c], s2 / s0 - mean.square()])
            totals += per_row.to(torch.float64) @ sample_w[c]
        loss, grad, hess = all_reduce_(totals, process_group).tolist()
        return loss, grad, hess

    # At beta = 0 the posteriors are uniform: the derivative needs no exponentials. It is taken in
    # float64 so that a constant classifier gives exactly 0 rather than float32 round-off.
    # (chunk by chunk: mean(dtype=float64) would make a float64 copy of all the logits)
    wide = buffers.new_empty(buffers.shape[1:], dtype=torch.float64)
    row_means = torch.cat([
        wide[: min(rows, n - start)].copy_(logits[start : start + rows]).mean(1) for start in range(0, n, rows)
    ])
    at_zero = torch.stack([
        sample_w.sum() * math.log(k),
        sample_w @ (row_means - z_true.to(torch.float64)),
        (sample_w * (z_max - z_min).to(torch.float64)).sum(),
    ])
    loss, grad, total_spread = all_reduce_(at_zero, process_group).tolist()
    evaluations = 1
    if grad >= 0 or total_spread == 0:
        warnings.warn(
            "the scores are not positively related to the labels, so the best temperature is "
            "infinite (uniform posteriors); check that logits and labels belong together.",
            ConvergenceWarning,
            stacklevel=4,
        )
        return 0.0, FitRecord(0, evaluations, loss, abs(grad), True, "optimum at T = inf (beta = 0)")
    # The cap scales with a typical row's margin between its two largest logits (from evenly spaced
    # rows, about _SUBSAMPLE_ELEMENTS logits): not the largest margin, as one saturated row must not
    # stop the search short of an optimum that the other rows place at a low temperature, nor the
    # row's whole range, which a class masked by a logit of -1e4 sets to 1e4 (T was capped at 1).
    top_two = logits[:: max(1, n * k // _SUBSAMPLE_ELEMENTS)].topk(2, dim=1).values.to(torch.float64)
    margins = top_two[:, 0] - top_two[:, 1]
    margins = margins[margins > 0]
    typical_margin = margins.median() if margins.numel() else margins.new_zeros(())
    beta_max = _MAX_SCALED_MARGIN / max(float(all_reduce_(typical_margin, process_group, op="max")), 1e-300)

    start = 1.0
    stride = int(all_reduce_(logits.new_tensor(float(n * k), dtype=torch.float64), process_group)) // _SUBSAMPLE_ELEMENTS
    if stride >= 4:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            sub_beta, sub_record = fit_inverse_temperature(
                logits[::stride], labels[::stride], weights, max_iter=max_iter, rtol=1e-3, process_group=process_group
            )
        if sub_record.converged and sub_beta > 0:
            start = sub_beta

    lo, hi, beta = 0.0, math.inf, min(start, beta_max)
    tiny = torch.finfo(logits.dtype).tiny
    for iteration in range(1, max_iter + 1):
        loss, grad, hess = moments(beta)
        evaluations += 1
        # A derivative and a curvature that underflow (to 0, or to subnormals in float64) mean every
        # row's softmax is one-hot on its label in this precision: the loss is still falling
        # towards 0 (separable data), not at an optimum.
        flat = hess < tiny and abs(grad) < tiny
        if grad < 0 or flat:
            lo = beta
            if beta >= beta_max:
                warnings.warn(
                    "the calibration data are perfectly separable by the scores: the log-loss keeps "
                    f"falling as T -> 0; stopped at T = {1 / beta_max:.3g}.",
                    ConvergenceWarning,
                    stacklevel=4,
                )
                return beta, FitRecord(iteration, evaluations, loss, abs(grad), False, "separable data: T at its lower limit")
        else:
            hi = beta
        # Newton on u = log(beta): f'(u) = beta * grad, f''(u) = beta^2 * hess + beta * grad.
        curvature = beta * hess + grad
        candidate = beta * math.exp(max(-grad / curvature, -30.0)) if curvature > 0 and -grad / curvature < 30 else math.inf
        if not flat and abs(candidate - beta) <= rtol * beta:  # (before the bracket test: beta may be its end)
            return candidate, FitRecord(iteration, evaluations, loss, abs(grad), True, "Newton step below tolerance")
        if grad < 0 and hess * loss <= 2 * grad * grad and math.isinf(hi):
            # The loss is one falling exponential (hess * loss = grad^2 for c e^(-beta m)): separable
            # data, where Newton only adds about 1/m to beta per step (733 steps to the cap).
            candidate = 4 * beta
        if not lo < candidate < hi:
            candidate = (lo + hi) / 2 if math.isfinite(hi) else 4 * beta
        candidate = min(candidate, beta_max)
        if abs(candidate - beta) <= rtol * beta:
            return candidate, FitRecord(iteration, evaluations, loss, abs(grad), True, "Newton step below tolerance")
        beta = candidate
    warnings.warn("temperature fit did not converge", ConvergenceWarning, stacklevel=4)
    return beta, FitRecord(max_iter, evaluations, loss, abs(grad), False, f"stopped at the iteration cap ({max_iter})")


def inverse_temperature_start(
    features: Tensor, labels: Tensor, weights: Tensor | None, process_group: ProcessGroup | None = None
) -> float:
    """The fitted inverse temperature of ``features``, or 1 when it is degenerate (silently).

    Richer maps start from ``beta`` times the identity: temperature scaling is a few cheap passes
    and takes out the dominant miscalibration (over- or under-confidence), so the expensive
    iterations start near the optimum instead of at the raw scores.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        beta, record = fit_inverse_temperature(features, labels, weights, process_group=process_group)
    return beta if record.converged and beta > 0 else 1.0
