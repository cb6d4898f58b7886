"""Streaming debiased l2 calibration error (Kumar et al. 2019), on ``CalibrationError``'s state.

With equal-width bins the state is the per-bin sums (sum-reducible); with equal-mass bins
(the paper's choice, the default here as in the functional form) the scores are kept, as
``CalibrationError(strategy="quantile")`` does.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from torchcal.functional.debiased_ece import REDUCTIONS, Reduction, debiased_calibration_error_from_bins
from torchcal.functional.diagnostics import Strategy
from torchcal.metrics.diagnostics import CalibrationError

__all__ = ["DebiasedCalibrationError"]


class DebiasedCalibrationError(CalibrationError):
    """Debiased l2 calibration error, as ``functional.debiased_ece.debiased_calibration_error``.

    Args:
        num_classes: K.
        n_bins: number of bins M.
        strategy: ``"quantile"`` (equal mass, O(N) state) or ``"uniform"`` (equal width, O(M) state).
        kind: ``"top-label"``, ``"binary"`` (class 1 of K = 2) or ``"classwise"``.
        reduction: how ``"classwise"`` combines classes: ``"mean"``, ``"sum"``, ``"max"`` or
            ``"rms"`` (Kumar et al.'s marginal calibration error).
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = DebiasedCalibrationError(num_classes=2, n_bins=2, strategy="uniform", kind="binary")
        >>> probs = torch.tensor([[.9, .1], [.9, .1], [.9, .1], [.9, .1], [.1, .9], [.1, .9], [.1, .9], [.1, .9]])
        >>> metric.update(probs[:5].log(), torch.tensor([0, 0, 0, 0, 1]))
        >>> metric.update(probs[5:].log(), torch.tensor([1, 1, 1]))
        >>> round(float(metric.compute()), 6)
        0.1
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        strategy: Strategy = "quantile",
        kind: Literal["top-label", "binary", "classwise"] = "top-label",
        reduction: Reduction = "mean",
        **kwargs: Any,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
        if "norm" in kwargs:  # (the base class takes one; this error is l2 by construction)
            raise ValueError(f"the debiased calibration error is an l2 error (norm='l2' always), got norm={kwargs['norm']!r}; "
                             f"leave norm out.")
        # (the base class knows the binned ECE's reductions; compute() reads this one)
        super().__init__(num_classes, n_bins=n_bins, strategy=strategy, kind=kind, norm="l2", **kwargs)
        self.reduction = reduction  # type: ignore[assignment]  # also "rms", which only this compute() reads

    def compute(self) -> Tensor:
        _, statistics = self._binned()
        return debiased_calibration_error_from_bins(*statistics, reduction=self.reduction)  # type: ignore[arg-type]  # "none" refused in __init__
