"""Streaming calibration loss (Ferrer & Ramos): how much a calibrator lowers a proper score.

Two modes, chosen by whether the calibrator is fitted:

- fitted (``calibrator.is_fitted``): each batch is scored raw and after the calibrator, side by
  side; the state is per-class sums of both per-sample scores and per-class counts, (K,) each;
- unfitted: the logits and labels are kept (O(N K) memory, gathered across processes) and
  ``compute()`` returns the out-of-fold loss of ``functional.cross_validated_calibration_loss``.
  Use ``update()``, not ``forward()``, in this mode: a single batch is usually too small to
  cross-validate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from torchcal._validation import check_logits_and_labels, check_priors
from torchcal.functional.bootstrap import sum_decomposition, sum_reduction
from torchcal.functional.calibration_loss import (
    CalibrationLossResult,
    calibration_loss_from_scores,
    cross_validated_calibration_loss,
)
from torchcal.functional.scoring import class_sums, cross_entropy
from torchcal.metrics._common import add_sum_state, check_num_classes

__all__ = ["CalibrationLoss"]


class CalibrationLoss(Metric):
    """Absolute and relative (%) calibration loss; ``compute()`` returns a ``CalibrationLossResult``.

    Args:
        calibrator: a torchcal calibrator, fitted (applied to each batch) or not (cross-validated
            at ``compute()``).
        num_classes: K.
        score: the proper score, as in ``functional.calibration_loss``; with a fitted calibrator it
            must be a mean of per-sample values (``cross_entropy``, ``brier_score``, ``bayes_risk``,
            ... or a ``functools.partial`` of one).
        priors: optional (K,) deployment priors passed to ``score``.
        folds, seed: cross-validation settings for an unfitted calibrator.

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(2000, 3)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> calibrator = torchcal.TemperatureScaling().fit(logits[:1000], labels[:1000])
        >>> metric = CalibrationLoss(calibrator, num_classes=3)
        >>> for batch in range(1000, 2000, 250):
        ...     metric.update(logits[batch:batch + 250], labels[batch:batch + 250])
        >>> bool(metric.compute().relative > 20)
        True
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = None  # a calibrator can make things worse

    def __init__(
        self,
        calibrator: torch.nn.Module,
        num_classes: int,
        score: Callable[..., Tensor] = cross_entropy,
        priors: Tensor | None = None,
        folds: int = 5,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_classes = check_num_classes(num_classes)
        self.calibrator = calibrator
        self.score = score
        self.score_options = {} if priors is None else {"priors": check_priors(priors, num_classes)}
        self.folds, self.seed = folds, seed
        self.streaming = bool(getattr(calibrator, "is_fitted", False))
        if self.streaming:
            self.reduce = sum_reduction(score, num_classes, **self.score_options)
            for name in ("raw_sums", "calibrated_sums", "class_counts"):
                add_sum_state(self, name, num_classes)
        else:
            self.add_state("logits", [], dist_reduce_fx="cat", persistent=False)
            self.add_state("labels", [], dist_reduce_fx="cat", persistent=False)

    def update(self, logits: Tensor, labels: Tensor) -> None:
        """Accumulate raw ``logits: (N, K)`` and ``labels: (N,)``."""
        logits, labels = check_logits_and_labels(logits, labels, num_classes=self.num_classes)
        if not self.streaming:
            self.logits.append(logits)
            self.labels.append(labels)
            return
        with torch.no_grad():
            calibrated = self.calibrator(logits)
        terms = sum_decomposition(self.score)
        raw_sums, counts = class_sums(terms(logits, labels, **self.score_options).per_sample, labels, self.num_classes)
        calibrated_sums, _ = class_sums(terms(calibrated, labels, **self.score_options).per_sample, labels, self.num_classes)
        self.raw_sums += raw_sums
        self.calibrated_sums += calibrated_sums
        self.class_counts += counts

    def compute(self) -> CalibrationLossResult:
        if self.streaming:
            return calibration_loss_from_scores(
                self.reduce(self.raw_sums, self.class_counts), self.reduce(self.calibrated_sums, self.class_counts)
            )
        return cross_validated_calibration_loss(
            dim_zero_cat(self.logits), dim_zero_cat(self.labels), self.calibrator, self.score,
            self.score_options.get("priors"), self.folds, self.seed,
        )
