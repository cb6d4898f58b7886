"""Temperature scaling, ``softmax(logits / T)`` with ``T > 0`` (Guo et al. 2017)."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from torchcal.calibrators.base import Calibrator
from torchcal.fit import ConvergenceWarning, FitRecord

__all__ = ["TemperatureScaling", "fit_inverse_temperature"]

# Past this many nats of logit spread per row the softmax is one-hot in float64: larger inverse
# temperatures cannot change the loss, so the search stops there (perfectly separable data).
_MAX_SCALED_SPREAD = 1e4


class TemperatureScaling(Calibrator):
    """Divide the logits by one temperature ``T > 0``; keeps the argmax (and accuracy).

    ``T`` is stored as ``log_temperature``, so it can never become negative. The log-loss fit uses
    a dedicated solver, :func:`fit_inverse_temperature` (safeguarded Newton on ``1/T``, in which the
    loss is convex); other losses use the generic L-BFGS driver.

    Example:
        >>> import torch
        >>> from torchcal import TemperatureScaling
        >>> logits = 4 * torch.randn(1000, 10)
        >>> labels = torch.distributions.Categorical(logits=logits / 4).sample()
        >>> ts = TemperatureScaling().fit(logits, labels)
        >>> 3.0 < ts.temperature < 5.5
        True
    """

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"log_temperature": torch.zeros((), dtype=torch.float64)}

    @property
    def temperature(self) -> float:
        """The fitted temperature ``T`` (``inf`` when the scores carry no usable information)."""
        return math.exp(self.log_temperature.item())

    def _scores(self, features: Tensor) -> Tensor:
        return features * torch.exp(-self.log_temperature.to(features.dtype))

    def _fit(self, features, labels, weights, loss, max_iter) -> FitRecord:
        if loss != "log":
            return super()._fit(features, labels, weights, loss, max_iter)
        beta, record = fit_inverse_temperature(features, labels, weights, max_iter=max_iter)
        with torch.no_grad():
            self.log_temperature.fill_(-math.log(beta) if beta > 0 else math.inf)
        return record


def fit_inverse_temperature(
    logits: Tensor,
    labels: Tensor,
    weights: Optional[Tensor] = None,
    *,
    max_iter: int = 100,
    rtol: float = 1e-12,
) -> tuple[float, FitRecord]:
    """Minimise the (weighted) mean log-loss of ``softmax(beta * logits)`` over ``beta >= 0``.

    The loss is convex in ``beta`` with derivative ``mean(E_q[z] - z_y)`` and second derivative
    ``mean(Var_q[z])``, so Newton's method converges quadratically; a bracket on the sign of the
    derivative keeps every step safe (bisection when Newton would leave it).

    Args:
        logits: (N, K) float64 scores. labels: (N,) class indices.
        weights: optional (K,) per-class weights (prior re-weighting).

    Returns:
        ``(beta, record)``. ``beta == 0`` (``T = inf``) when the scores are not positively
        related to the labels; ``beta`` at its upper limit (a row spread of 1e4 nats) when the
        data are perfectly separable, i.e. every true-class logit is the strict row maximum.
        Both cases warn.
    """
    z_true = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    sample_w = None if weights is None else weights[labels]
    n = logits.shape[0]

    def mean(x: Tensor) -> Tensor:
        return x.mean() if sample_w is None else (sample_w * x).sum() / n

    def derivatives(beta: float) -> tuple[float, float, float]:
        log_q = torch.log_softmax(beta * logits, dim=1)
        q = log_q.exp()
        expected = (q * logits).sum(dim=1)
        variance = (q * (logits - expected.unsqueeze(1)).square()).sum(dim=1)
        z_true_lq = log_q.gather(1, labels.unsqueeze(1)).squeeze(1)
        stats = torch.stack([mean(-z_true_lq), mean(expected - z_true), mean(variance)])
        loss, grad, hess = stats.tolist()
        return loss, grad, hess

    spread = float((logits.max(dim=1).values - logits.min(dim=1).values).max())
    beta_max = _MAX_SCALED_SPREAD / max(spread, 1e-300)
    evaluations = 1
    loss, grad, hess = derivatives(0.0)
    if grad >= 0:
        warnings.warn(
            "the scores are not positively related to the labels, so the best temperature is "
            "infinite (uniform posteriors); check that logits and labels belong together.",
            ConvergenceWarning,
            stacklevel=4,
        )
        return 0.0, FitRecord(0, evaluations, loss, abs(grad), True, "optimum at T = inf (beta = 0)")

    # Every true-class logit the strict row maximum: the loss falls towards 0 as T -> 0.
    competitors = logits.scatter(1, labels.unsqueeze(1), -math.inf).max(dim=1).values
    margin_ok = z_true > competitors
    if bool(margin_ok.all() if sample_w is None else (margin_ok | (sample_w == 0)).all()):
        warnings.warn(
            "the calibration data are perfectly separable by the scores: the log-loss keeps "
            f"falling as T -> 0; stopped at T = {1 / beta_max:.3g}.",
            ConvergenceWarning,
            stacklevel=4,
        )
        loss, grad, _ = derivatives(beta_max)
        return beta_max, FitRecord(0, evaluations + 1, loss, abs(grad), False, "separable data: T at its lower limit")

    lo, hi, beta = 0.0, math.inf, min(1.0, beta_max)
    for iteration in range(1, max_iter + 1):
        loss, grad, hess = derivatives(beta)
        evaluations += 1
        if grad < 0:
            lo = beta
        else:
            hi = beta
        step = -grad / hess if hess > 0 else math.inf
        candidate = beta + step
        if not lo < candidate < hi:
            candidate = (lo + hi) / 2 if math.isfinite(hi) else 2 * beta
        candidate = min(candidate, beta_max)
        if abs(candidate - beta) <= rtol * beta:
            return candidate, FitRecord(iteration, evaluations, loss, abs(grad), True, "Newton step below tolerance")
        beta = candidate
    warnings.warn("temperature fit did not converge", ConvergenceWarning, stacklevel=4)
    return beta, FitRecord(max_iter, evaluations, loss, abs(grad), False, f"stopped at the iteration cap ({max_iter})")
