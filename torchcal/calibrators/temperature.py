"""Temperature scaling, ``softmax(logits / T)`` with ``T > 0`` (Guo et al. 2017)."""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch import Tensor

from torchcal._tempered_moments import TEMPERED_LOSSES, tempered_moments
from torchcal._validation import stacklevel_outside_package
from torchcal.calibrators.base import Calibrator, sample_weights
from torchcal.distributed import ProcessGroup, all_reduce_
from torchcal.fit import ConvergenceWarning, FitRecord

__all__ = ["TemperatureScaling", "fit_inverse_temperature", "inverse_temperature_start"]

_log = logging.getLogger(__name__)

# Past this many nats between a row's two largest logits the softmax is one-hot in float64: larger
# inverse temperatures cannot change the loss, so the search stops there (perfectly separable data).
_MAX_SCALED_MARGIN = 1e4
# Newton converges quadratically, so most of its passes only get near the optimum. From four times
# this many logits (over all processes), that part runs on an evenly spaced subsample of about this
# many, and the full passes only polish: three instead of about seven.
_SUBSAMPLE_ELEMENTS = 1 << 20
# The grid of a non-convex loss's first pass: beta_max / 2^j, j = 0 .. this (down to 1e-12 of it).
_GRID_HALVINGS = 40
# Logits whose typical margin is further than this many factors of 2 from 1 are rescaled to a margin
# near 1 (exactly, by a power of 2): a float32 fit of logits of 1e19 overflowed, and one of 1e-20 took 37
# steps of 4x.
_RESCALE_OCTAVES = 16
# Float32 logits beyond this magnitude are searched in float64 passes (see fit_inverse_temperature).
_FLOAT32_EXTENT = 1e18
# Grid values this close to the lowest are tied (a saturated Brier score of 0 came out as -6e-24)
_GRID_TIE = 1e-12


class TemperatureScaling(Calibrator):
    """Divide the logits by one temperature ``T > 0``; keeps the argmax (and accuracy).

    ``T`` is stored as ``log_temperature``, so it can never become negative. The fit, for the log
    loss and the Brier score alike, uses a dedicated solver, :func:`fit_inverse_temperature`
    (safeguarded Newton on ``1/T``), in the precision of the logits with float64 sums.

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

    def _shifts_class_priors(self) -> bool:
        return False

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"log_temperature": torch.zeros((), dtype=torch.float64)}

    @property
    def temperature(self) -> float:
        """The fitted temperature ``T`` (``inf`` when the scores carry no usable information)."""
        self._check_fitted()
        return math.exp(self.log_temperature.item())

    def _scores(self, features: Tensor) -> Tensor:
        return features * torch.exp(-self.log_temperature.to(features.dtype))

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        if loss not in TEMPERED_LOSSES:  # a loss whose derivatives in 1/T the 1-D solver does not know
            return super()._fit(features.double(), labels, weights, loss, max_iter, process_group)
        beta, record = fit_inverse_temperature(
            features, labels, weights, loss=loss, max_iter=max_iter, process_group=process_group
        )
        with torch.no_grad():
            self.log_temperature.fill_(-math.log(beta) if beta > 0 else math.inf)
        return record


def fit_inverse_temperature(
    logits: Tensor,
    labels: Tensor,
    weights: Tensor | None = None,
    *,
    loss: str = "log",
    max_iter: int = 100,
    rtol: float | None = None,
    process_group: ProcessGroup | None = None,
) -> tuple[float, FitRecord]:
    """Minimise the (weighted) mean ``loss`` of ``softmax(beta * logits)`` over ``beta >= 0``.

    Each pass over the logits gives the mean loss and its first two derivatives in ``beta``
    (:func:`torchcal._tempered_moments.tempered_moments`: one exponential per entry, row sums in
    the precision of the logits, accumulated in float64; one host sync per iteration). Newton
    steps are taken on ``log(beta)`` (better scaled far from the optimum) inside a bracket on the
    sign of the derivative, with bisection when a step would leave it or the curvature is not
    positive, so the search ends where the derivative turns from negative to positive: the
    minimum. The log-loss is convex in ``beta`` (derivative ``mean(E_q[z] - z_y)``, second
    derivative ``mean(Var_q[z])``). The Brier score is not: it can rise from ``beta = 0`` and fall
    lower further on, or have several minima. So its search first evaluates it on a grid of
    ``beta`` spaced by factors of 2 up to the cap below (one pass at all of them, on the subsample
    where there is one), brackets the best grid point by its neighbours, and keeps ``beta = 0``
    only where the loss there is lower than at the minimum found. Quadratic convergence takes
    about five passes from ``beta = 1``; on large data the search starts from the fit on a
    subsample, and three passes polish that.

    Args:
        logits: (N, K) scores, float32 or float64; the passes run in that precision.
        labels: (N,) class indices. weights: optional (K,) per-class weights.
        loss: the proper scoring rule, a key of ``functional.scoring.PER_SAMPLE_SCORES``
            (``"log"`` or ``"brier"``).
        rtol: stop when a step changes ``beta`` by less than this, relatively; the default is
            ``1e-9`` in float64 and ``100 * eps`` (about ``1e-5``) in float32, after which the
            quadratic convergence leaves ``beta`` far more accurate than the step.
        process_group: data-parallel fit over a ``torch.distributed`` group.

    Returns:
        ``(beta, record)``. ``beta == 0`` (``T = inf``) when the scores are not positively
        related to the labels; ``beta`` at its upper limit (1e4 nats between a median row's two
        largest scores) when the loss keeps falling up to it, i.e. the data are (all but) perfectly
        separable, every true-class logit the strict row maximum. Both cases warn.

    Example:
        >>> import torch
        >>> logits = 3 * torch.randn(2000, 5)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> beta, record = fit_inverse_temperature(logits, labels, loss="brier")
        >>> record.converged, 0.2 < beta < 0.5
        (True, True)
    """
    n, k = logits.shape
    if rtol is None:
        rtol = max(1e-9, 100 * torch.finfo(logits.dtype).eps)
    sample_w = sample_weights(labels, weights, process_group)
    loss_name = {"log": "log-loss", "brier": "Brier score"}.get(loss, f"{loss} loss")

    def moments(beta: float) -> tuple[float, float, float]:
        """Mean loss, first and second derivative at ``beta``: one pass over the logits."""
        totals = tempered_moments(logits, labels, [beta], loss, sample_w)[0]
        value, grad, hess = all_reduce_(totals, process_group).tolist()
        return value, grad, hess

    def uniform_is_best() -> tuple[float, FitRecord]:
        warnings.warn(
            "the scores are not positively related to the labels, so the best temperature is "
            "infinite (uniform posteriors); check that logits and labels belong together.",
            ConvergenceWarning,
            stacklevel=stacklevel_outside_package(),
        )
        return 0.0, FitRecord(0, evaluations, uniform_value, abs(uniform_grad), True, "optimum at T = inf (beta = 0)")

    if logits.dtype != torch.float64:
        # A logit far from the others (a class masked at -1e30) overflows the curvature terms
        # w^2 in float32 from |w| of about 1.8e19, whatever the typical margin: the derivatives came
        # out NaN and inf, Newton's step 0, and a fit worse than the uniform posteriors converged.
        low, high = torch.aminmax(logits)
        extent = all_reduce_(torch.maximum(high, -low).to(torch.float64), process_group, op="max")
        if float(extent) > _FLOAT32_EXTENT:
            logits = logits.double()

    # At beta = 0 the posteriors are uniform, and the derivative is exactly 0 when every row is
    # constant (a constant classifier), in any precision: the centred logits are then exactly 0.
    uniform_value, uniform_grad, _ = moments(0.0)
    evaluations = 1
    convex = loss == "log"
    if convex and uniform_grad >= 0:
        return uniform_is_best()
    # Temperature scaling absorbs any scale of the logits into beta, so the search runs on logits /
    # unit: the curvature sums e^(beta w) w^2, whose w^2 overflow float32 from logits of about 1e19
    # (a fit at T = inf reported converged), and beta, near float32's smallest normal number there.
    margin, unit = margin_and_unit(logits, process_group)
    logits = in_units(logits, unit)
    # (finite in the scores' dtype: rows that are constant have no margin, and float32 betas of
    # 1e304 were inf, inf * 0 NaN in every Brier value of the grid)
    beta_max = min(_MAX_SCALED_MARGIN / max(margin / unit, 1e-300), torch.finfo(logits.dtype).max / 2)

    start, lo, hi = 1.0, 0.0, math.inf
    stride = int(all_reduce_(logits.new_tensor(float(n * k), dtype=torch.float64), process_group)) // _SUBSAMPLE_ELEMENTS
    if stride >= 4:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            sub_beta, sub_record = fit_inverse_temperature(
                logits[::stride], labels[::stride], weights, loss=loss, max_iter=max_iter, rtol=1e-3,
                process_group=process_group,
            )
        if sub_record.converged and sub_beta > 0:
            start = sub_beta
    elif not convex:  # the whole range once, on the smallest data the search sees
        grid = [beta_max * 2.0**-j for j in range(_GRID_HALVINGS, -1, -1)]
        values = all_reduce_(tempered_moments(logits, labels, grid, loss, sample_w)[:, 0], process_group).tolist()
        evaluations += 1
        # the largest beta among ties (within round-off): where rows saturate the loss stops moving
        lowest = min(values)
        best = max(i for i, value in enumerate(values) if value <= lowest + _GRID_TIE)
        if uniform_value <= lowest:
            return uniform_is_best()
        start, lo = grid[best], grid[best - 1] if best else 0.0
        hi = grid[best + 1] if best + 1 < len(grid) else math.inf

    beta = min(start, beta_max)
    tiny = torch.finfo(logits.dtype).tiny

    def converged(beta: float, iteration: int, value: float, grad: float) -> tuple[float, FitRecord]:
        if not convex and uniform_value < value:  # a local minimum above the loss at beta = 0
            return uniform_is_best()
        return beta / unit, FitRecord(iteration, evaluations, value, abs(grad) * unit, True, "Newton step below tolerance")

    for iteration in range(1, max_iter + 1):
        value, grad, hess = moments(beta)
        evaluations += 1
        # (host floats only: the log adds no synchronisation)
        _log.debug("temperature Newton (%d x %d) iteration %d: 1/T = %.8g, %s %.10f, derivative %.1e",
                   n, k, iteration, beta, loss_name, value, grad)
        # A derivative and a curvature that underflow (to 0, or to subnormals in float64) mean every
        # row's softmax is one-hot on its label in this precision: the loss is still falling
        # towards 0 (separable data), not at an optimum.
        flat = abs(hess) < tiny and abs(grad) < tiny
        if grad < 0 or flat:
            lo = beta
            if beta >= beta_max:
                # (the Brier score of a wrong row stops rising at 2, so it can also fall throughout
                # where the misclassified rows are few and confidently wrong)
                why = "perfectly separable by the scores" if convex else (
                    "perfectly separable by the scores, or their misclassified rows already score their worst")
                warnings.warn(
                    f"the calibration data are {why}: the {loss_name} keeps falling as T -> 0; stopped at "
                    f"T = {unit / beta_max:.3g}.",
                    ConvergenceWarning,
                    stacklevel=stacklevel_outside_package(),
                )
                return beta / unit, FitRecord(
                    iteration, evaluations, value, abs(grad) * unit, False, "separable data: T at its lower limit")
        else:
            hi = beta
        # Newton on u = log(beta): f'(u) = beta * grad, f''(u) = beta^2 * hess + beta * grad.
        curvature = beta * hess + grad
        candidate = beta * math.exp(max(-grad / curvature, -30.0)) if curvature > 0 and -grad / curvature < 30 else math.inf
        if not flat and abs(candidate - beta) <= rtol * beta:  # (before the bracket test: beta may be its end)
            return converged(candidate, iteration, value, grad)
        if grad < 0 and hess * value <= 2 * grad * grad and math.isinf(hi):
            # The loss is one falling exponential (hess * loss = grad^2 for c e^(-beta m)): separable
            # data, where Newton only adds about 1/m to beta per step (733 steps to the cap).
            candidate = 4 * beta
        if not lo < candidate < hi:
            candidate = (lo + hi) / 2 if math.isfinite(hi) else 4 * beta
        candidate = min(candidate, beta_max)
        if abs(candidate - beta) <= rtol * beta:
            return converged(candidate, iteration, value, grad)
        beta = candidate
    warnings.warn("temperature fit did not converge", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    value, grad, _ = moments(beta)  # (the record's loss and gradient are the returned temperature's)
    evaluations += 1
    return beta / unit, FitRecord(max_iter, evaluations, value, abs(grad) * unit, False, f"stopped at the iteration cap ({max_iter})")


def margin_and_unit(logits: Tensor, process_group: ProcessGroup | None = None) -> tuple[float, float]:
    """A typical row's margin between its largest score and the next one below it, of ``logits:
    (N, K)``, and the power of 2 near it to divide scores by, where it lies beyond 2^16 either way
    (else 1).

    The margin comes from evenly spaced rows, about ``_SUBSAMPLE_ELEMENTS`` scores: not the largest
    margin, as one saturated row must not stop a temperature search short of an optimum that the
    other rows place at a low temperature, nor the row's whole range, which a class masked by a
    logit of -1e4 sets to 1e4 (T was capped at 1)."""
    n, k = logits.shape
    rows = logits[:: max(1, n * k // _SUBSAMPLE_ELEMENTS)]
    # the largest of each row, then the largest below it: a third of topk(2)'s time (10,000 x 100:
    # 3.3 against 10.0 ms, a quarter of the fit). Below it, not the second of topk: where the two
    # largest tie, the scale at which T still matters is that of the next score ([10, 10, 3]: 7),
    # and a margin of 0 had let the search run to betas that overflow the scores' dtype.
    top = rows.amax(dim=1, keepdim=True)
    second = rows.masked_fill(rows >= top, -math.inf).amax(dim=1, keepdim=True)
    margins = (top.to(torch.float64) - second.to(torch.float64)).squeeze(1)
    margins = margins[(margins > 0) & torch.isfinite(margins)]
    typical_margin = margins.median() if margins.numel() else margins.new_zeros(())
    margin = float(all_reduce_(typical_margin, process_group, op="max"))
    octave = math.frexp(margin)[1] - 1  # margin in [2^octave, 2^(octave + 1)); 0 for 0, inf and NaN
    return margin, math.ldexp(1.0, octave) if abs(octave) > _RESCALE_OCTAVES else 1.0


def in_units(logits: Tensor, unit: float) -> Tensor:
    """``logits / unit`` (:func:`margin_and_unit`); scaled up in float64, where a masked class at
    float32's lowest would overflow, and clamped, so that one at float64's lowest does not either
    (-inf made every moment of a temperature fit NaN: T = 5e294)."""
    if unit > 1:
        return logits / unit
    if unit < 1:
        return logits.double().clamp_min(torch.finfo(torch.float64).min * unit) / unit
    return logits


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
