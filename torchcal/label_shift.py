"""Unknown deployment priors (label shift): estimate the class priors of unlabelled target data and
adapt calibrated posteriors to them.

Under label shift the class-conditional score distributions are those of the calibration (source)
data and only the class priors change, from ``pi_s`` to ``pi_t``. Bayes' rule then turns source
posteriors into target posteriors, ``q(k | x) ∝ p(k | x) pi_t[k] / pi_s[k]``
(:func:`adapt_to_priors`). With known target priors that is all; the scoring functions and
``Calibrator.fit`` already take deployment ``priors`` (Ferrer & Ramos, App. A). When they are unknown,
:func:`estimate_priors` finds them from unlabelled target scores by maximum likelihood, with the EM
algorithm of Saerens, Latinne & Decaestecker (2002).

Both steps assume the source posteriors are calibrated, and EM is sensitive to it. Alexandari,
Kundaje & Shrikumar (2020) find bias-corrected temperature scaling (BCTS), ``softmax(z / T + b)``,
the calibrator to use: it is :class:`~torchcal.AffineCalibration` (``softmax(alpha *
log_softmax(z) + beta)`` is the same family, since ``log_softmax`` only subtracts a per-row constant),
the default of :class:`LabelShiftAdapter`. The source priors are those the calibrator was fitted
for: the class frequencies of its calibration data, or the ``priors`` given to its ``fit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from torchcal._validation import check_logits, check_logits_and_labels, check_priors, compute_dtype
from torchcal.calibrators.affine import AffineCalibration
from torchcal.calibrators.base import Calibrator
from torchcal.distributed import ProcessGroup, all_reduce_, validate_together
from torchcal.fit import FitRecord
from torchcal.functional.scoring import class_frequencies

__all__ = ["LabelShiftAdapter", "PriorEstimate", "adapt_to_priors", "estimate_priors"]

# EM steps between convergence checks: each check reads one number back from the device.
_CHECK_EVERY = 10


class PriorEstimate(NamedTuple):
    """Result of :func:`estimate_priors`.

    ``priors``: (K,) estimated target priors, float64. ``stderr``: (K,) their standard errors from
    the observed information of the target likelihood (NaN where a prior is at the boundary, 0);
    they do not include the uncertainty of the calibration itself. ``record``: the EM run:
    iterations (convergence is checked every 10 steps), the final negative mean log-likelihood
    ratio against "no shift" (``loss``; <= 0) and the largest change of a prior in the last step
    (``grad_max``).
    """

    priors: Tensor
    stderr: Tensor
    record: FitRecord


def _source_priors(source_priors: Any, num_classes: int, device: torch.device) -> Tensor:
    source = check_priors(source_priors, num_classes, device=device)
    if bool((source == 0).any()):
        raise ValueError(
            "source_priors must be positive: a class the calibration data never showed cannot be "
            "re-weighted; drop it from the scores or give it a small prior."
        )
    return source


def adapt_to_priors(logits: Tensor, source_priors: Tensor, target_priors: Tensor) -> Tensor:
    """Posteriors calibrated for ``source_priors`` moved to ``target_priors`` by Bayes' rule.

    Args:
        logits: (N, K) calibrated scores (any unnormalised log-posteriors).
        source_priors: (K,) priors the posteriors are calibrated for (all positive).
        target_priors: (K,) deployment priors.

    Returns:
        (N, K) log-posteriors ``log_softmax(logits + log(target / source))``, in the input's compute
        dtype (float32 for half precision).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> adapt_to_priors(logits, torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.8])).exp()
        tensor([[0.2000, 0.8000],
                [0.6488, 0.3512]])
    """
    logits = check_logits(logits)
    source = _source_priors(source_priors, logits.shape[1], logits.device)
    target = check_priors(target_priors, logits.shape[1], device=logits.device)
    return _shift(logits, source, target)


def _shift(logits: Tensor, source: Tensor, target: Tensor) -> Tensor:
    """``log_softmax(logits + log(target / source))`` in the compute dtype, without input checks."""
    dtype = compute_dtype(logits.dtype)
    return torch.log_softmax(logits.to(dtype) + (target.log() - source.log()).to(dtype), dim=1)


def estimate_priors(
    logits: Tensor,
    source_priors: Tensor,
    *,
    max_iter: int = 1000,
    tol: float = 1e-8,
    process_group: ProcessGroup | None = None,
) -> PriorEstimate:
    """Maximum-likelihood class priors of unlabelled target data by EM (Saerens et al. 2002).

    With ``a[n, k] = p(k | x_n) / pi_s[k]`` the target likelihood is ``prod_n sum_k a[n, k] pi[k]``;
    EM's step is ``pi[k] <- pi[k] * mean_n(a[n, k] / sum_j a[n, j] pi[j])``, which is the mean of
    the posteriors adapted to the current ``pi``. It starts from the source priors and increases
    the likelihood at every step. Computed in float64 on the scores' device.

    Args:
        logits: (N, K) *calibrated* scores of the unlabelled target samples (any unnormalised
            log-posteriors, e.g. a calibrator's output).
        source_priors: (K,) priors the posteriors are calibrated for (all positive).
        max_iter: EM step cap. tol: stop when no prior changes by more than this in a step.
        process_group: data-parallel over a ``torch.distributed`` group: every process passes its
            own shard of the target scores and all get the estimate from the union (K sums travel
            per step, K^2 + 1 at the end for the standard errors and the likelihood).

    Returns:
        :class:`PriorEstimate` ``(priors, stderr, record)``.

    Example:
        >>> import torch
        >>> source = torch.tensor([0.5, 0.5])
        >>> posteriors = torch.tensor([[0.9, 0.1]] * 70 + [[0.1, 0.9]] * 30)  # calibrated for source
        >>> estimate = estimate_priors(posteriors.log(), source)
        >>> [round(p, 4) for p in estimate.priors.tolist()], estimate.record.converged
        ([0.75, 0.25], True)
    """
    if max_iter < 1 or not tol > 0:
        raise ValueError(f"max_iter must be >= 1 and tol > 0, got max_iter={max_iter}, tol={tol}.")

    def check() -> tuple[Tensor, Tensor]:
        checked = check_logits(logits)
        return checked, _source_priors(source_priors, checked.shape[1], checked.device)

    logits, source = validate_together(check, process_group, logits)
    n_classes = logits.shape[1]
    # (detached: a calibrator's output carries its graph, which every EM step would extend)
    ratio = torch.softmax(logits.detach().to(torch.float64), dim=1) / source  # a[n, k]
    count = all_reduce_(torch.tensor(float(logits.shape[0]), dtype=torch.float64, device=logits.device), process_group)
    priors = source.clone()
    step = torch.zeros((), dtype=torch.float64, device=logits.device)
    iterations, converged = 0, False
    while iterations < max_iter and not converged:
        for _ in range(min(_CHECK_EVERY, max_iter - iterations)):
            inverse_mixture = 1 / (ratio @ priors).clamp_min(torch.finfo(torch.float64).tiny)
            updated = priors * all_reduce_(ratio.T @ inverse_mixture, process_group) / count
            step = (updated - priors).abs().max()
            priors = updated / updated.sum()  # the sum is 1 up to round-off; keep it exact
            iterations += 1
        converged = bool(step <= tol)
    mixture = (ratio @ priors).clamp_min(torch.finfo(torch.float64).tiny)
    gradients = ratio / mixture.unsqueeze(1)  # of each sample's log-likelihood in the priors
    totals = all_reduce_(torch.cat([mixture.log().sum().reshape(1), (gradients.T @ gradients).flatten()]), process_group)
    loss = -float(totals[0] / count)
    stderr = _standard_errors(totals[1:].reshape(n_classes, n_classes), priors)
    message = "EM step below tol" if converged else f"stopped at the iteration cap ({max_iter})"
    record = FitRecord(iterations, iterations, loss, float(step), converged, message)
    return PriorEstimate(priors, stderr, record)


def _standard_errors(information: Tensor, priors: Tensor) -> Tensor:
    """Standard errors (K,) of priors on the simplex from the information matrix ``sum_n g g^T``
    (``g = a / (a . pi)``, the gradient of one sample's log-likelihood): the last prior is one minus
    the others, and classes at the boundary (prior < 1e-6) are held fixed (NaN)."""
    free = (priors > 1e-6).nonzero().flatten()
    stderr = torch.full_like(priors, float("nan"))
    if free.numel() < 2:
        return stderr
    # parametrise the free priors by all but the last of them: J maps the K_f - 1 to the K_f
    k = free.numel()
    jacobian = torch.cat([torch.eye(k - 1, dtype=priors.dtype, device=priors.device), -torch.ones(1, k - 1, dtype=priors.dtype, device=priors.device)])
    reduced = jacobian.T @ information[free][:, free] @ jacobian
    covariance = jacobian @ torch.linalg.pinv(reduced) @ jacobian.T
    stderr[free] = covariance.diagonal().clamp_min(0).sqrt()
    return stderr


class LabelShiftAdapter(nn.Module):
    """A calibrator followed by prior adaptation: calibrated posteriors for the target priors.

    1. :meth:`fit` fits the calibrator on labelled source data (BCTS, i.e.
       :class:`~torchcal.AffineCalibration`, by default) and records the source priors;
    2. :meth:`adapt` sets the target priors: estimated from unlabelled target scores by EM, or known
       ones given as ``priors``;
    3. the module maps logits to log-posteriors for the target priors (a plain module: it
       exports with ``torch.export``, but ``CalibratedModel`` takes calibrators only).

    ``estimate_`` holds the last :class:`PriorEstimate`. ``state_dict()`` round trips into a fresh
    adapter around an unfitted calibrator of the same kind.

    Example:
        >>> import torch
        >>> from torchcal.label_shift import LabelShiftAdapter
        >>> gen = torch.Generator().manual_seed(0)
        >>> def sample(priors, n):
        ...     labels = torch.multinomial(torch.tensor(priors), n, replacement=True, generator=gen)
        ...     return torch.randn(n, 3, generator=gen) + 2.5 * torch.eye(3)[labels], labels
        >>> source_logits, source_labels = sample([1 / 3, 1 / 3, 1 / 3], 3000)
        >>> target_logits, _ = sample([0.7, 0.2, 0.1], 3000)  # the labels stay unknown
        >>> adapter = LabelShiftAdapter().fit(source_logits, source_labels).adapt(target_logits)
        >>> [round(p, 1) for p in adapter.target_priors.tolist()]
        [0.7, 0.2, 0.1]
        >>> adapter(target_logits).shape
        torch.Size([3000, 3])
    """

    def __init__(self, calibrator: Calibrator | None = None) -> None:
        super().__init__()
        self.calibrator = AffineCalibration() if calibrator is None else calibrator
        if not isinstance(self.calibrator, Calibrator):
            raise TypeError(f"calibrator must be a torchcal calibrator, got {type(self.calibrator).__name__}.")
        self.register_buffer("source_priors", torch.empty(0, dtype=torch.float64))
        self.register_buffer("target_priors", torch.empty(0, dtype=torch.float64))
        self.estimate_: PriorEstimate | None = None

    def fit(self, logits: Tensor, labels: Tensor, *, priors: Tensor | None = None, **fit_options: Any) -> LabelShiftAdapter:
        """Fit the calibrator on labelled source ``logits: (N, K)``, ``labels: (N,)``; ``priors``
        and ``fit_options`` go to its ``fit``. The target priors start as the source priors."""
        logits, labels = check_logits_and_labels(logits, labels)
        k = logits.shape[1]
        if priors is None:
            self.calibrator.fit(logits, labels, **fit_options)
            source = class_frequencies(labels, k)
        else:
            self.calibrator.fit(logits, labels, priors=priors, **fit_options)
            source = check_priors(priors, k, device=logits.device)
        self.source_priors = _source_priors(source, k, logits.device)
        self.target_priors = self.source_priors.clone()
        self.estimate_ = None
        return self

    def adapt(self, target_logits: Tensor | None = None, *, priors: Tensor | None = None, **em_options: Any) -> LabelShiftAdapter:
        """Set the target priors: estimated from unlabelled ``target_logits: (N, K)`` (raw, uncalibrated
        scores; ``em_options`` go to :func:`estimate_priors`), or the known ``priors: (K,)``."""
        if self.source_priors.numel() == 0:
            raise RuntimeError("this LabelShiftAdapter is not fitted yet: call .fit(logits, labels) on labelled source data first.")
        if (target_logits is None) == (priors is None):
            raise ValueError("pass either target_logits (to estimate the target priors) or the known priors, not both.")
        if priors is not None:
            self.target_priors = check_priors(priors, self.source_priors.shape[0], device=self.source_priors.device)
            self.estimate_ = None
            return self
        with torch.no_grad():
            calibrated = self.calibrator(target_logits)
        self.estimate_ = estimate_priors(calibrated, self.source_priors, **em_options)
        self.target_priors = self.estimate_.priors.to(self.source_priors.device)
        return self

    def forward(self, logits: Tensor) -> Tensor:
        """Log-posteriors (N, K) for the target priors."""
        if self.source_priors.numel() == 0:
            raise RuntimeError("this LabelShiftAdapter is not fitted yet: call .fit(logits, labels) on labelled source data first.")
        return _shift(self.calibrator(logits), self.source_priors, self.target_priors)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the prior buffers' shapes depend on K: give them the stored shapes before loading
        for name in ("source_priors", "target_priors"):
            stored = state_dict.get(prefix + name)
            if stored is not None:
                setattr(self, name, torch.empty_like(stored, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
