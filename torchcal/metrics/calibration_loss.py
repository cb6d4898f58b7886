"""Streaming calibration loss (Ferrer & Ramos): how much a calibrator lowers a proper score.

Two modes, chosen by whether the calibrator is fitted when the metric is built (the metric keeps
a copy: fitting the calibrator afterwards, or again, does not reach it; build a new metric, or
use ``functional.calibration_loss`` with the calibrator's outputs):

- fitted (``calibrator.is_fitted``): each batch is scored raw and after the calibrator, side by
  side; the state is per-class sums of both per-sample scores and per-class counts, (K,) each;
- unfitted: the logits (in float64) and labels are kept (O(N K) memory, gathered across
  processes, also from a process that saw no samples) and ``compute()`` returns the out-of-fold
  loss of ``functional.cross_validated_calibration_loss``.
  Use ``update()``, not ``forward()``, in this mode: a single batch is usually too small to
  cross-validate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics.utilities import dim_zero_cat

from torchcal._validation import check_folds, check_priors
from torchcal.calibrators.base import Calibrator, check_calibrator
from torchcal.functional.bootstrap import sum_decomposition, sum_reduction
from torchcal.functional.calibration_loss import (
    CalibrationLossResult,
    calibration_loss_from_scores,
    cross_validated_calibration_loss,
)
from torchcal.functional.scoring import class_sums, cross_entropy
from torchcal.metrics._common import ScoreMetric, add_cat_state, add_sum_state

__all__ = ["CalibrationLoss"]


class CalibrationLoss(ScoreMetric):
    """Relative (%) or absolute calibration loss, as ``functional.calibration_loss``.

    ``compute()`` returns one float64 scalar: the relative loss in percent (RCL), or the absolute
    one with ``relative=False``; ``result()`` returns both as a ``CalibrationLossResult``.

    Args:
        calibrator: a torchcal calibrator, fitted (applied to each batch) or not (cross-validated
            at ``compute()``). The metric holds a frozen copy made here, and the mode is set here:
            a later fit of ``calibrator`` changes neither (the module docs).
        num_classes: K.
        score: the proper score, as in ``functional.calibration_loss``; with a fitted calibrator it
            must be a mean of per-sample values (``cross_entropy``, ``brier_score``, ``bayes_risk``,
            ... or a ``functools.partial`` of one).
        priors: optional (K,) deployment priors passed to ``score`` (and, for an unfitted
            calibrator, to the fold calibrators' ``fit``).
        folds, seed: cross-validation settings for an unfitted calibrator.
        relative: ``compute()`` returns the relative loss (%), else the absolute one.
        input, ignore_index, validate_args: see ``torchcal.metrics``; the calibrator receives
            log-domain scores (``log(probs)`` for ``input="probs"``).

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(2000, 3)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> calibrator = torchcal.TemperatureScaling().fit(logits[:1000], labels[:1000])
        >>> metric = CalibrationLoss(calibrator, num_classes=3)
        >>> for batch in range(1000, 2000, 250):
        ...     metric.update(logits[batch:batch + 250], labels[batch:batch + 250])
        >>> bool(metric.compute() > 20)
        True
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = None  # a calibrator can make things worse

    num_classes: int
    raw_sums: Tensor
    calibrated_sums: Tensor
    class_counts: Tensor
    logits: list[Tensor]
    labels: list[Tensor]

    def __init__(
        self,
        calibrator: Calibrator,
        num_classes: int,
        score: Callable[..., Tensor] = cross_entropy,
        priors: Tensor | None = None,
        folds: int = 5,
        seed: int = 0,
        relative: bool = True,
        **kwargs: Any,
    ) -> None:
        check_calibrator(calibrator)
        super().__init__(num_classes, **kwargs)
        self.relative = relative
        # a copy, frozen: a fitted calibrator's trainable parameters in a LightningModule's metric
        # reached its optimiser, and DDP stopped on them as parameters no loss used
        self.calibrator = copy.deepcopy(calibrator).requires_grad_(False)
        self.score = score
        self.score_options = {} if priors is None else {"priors": check_priors(priors, num_classes)}
        self.folds, self.seed = check_folds(folds, seed)
        self.streaming = bool(getattr(calibrator, "is_fitted", False))
        if self.streaming:
            self.reduce = sum_reduction(score, num_classes, **self.score_options)
            for name in ("raw_sums", "calibrated_sums", "class_counts"):
                add_sum_state(self, name, num_classes)
        else:
            add_cat_state(self, "logits", torch.float64, num_classes)
            add_cat_state(self, "labels", torch.int64)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate raw ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        if not self.streaming:
            self.logits.append(logits.to(torch.float64))  # (one dtype in every process: add_cat_state)
            self.labels.append(labels)
            return
        with torch.no_grad():
            calibrated = self.calibrator(logits)
        terms = sum_decomposition(self.score)
        assert terms is not None  # sum_reduction refused any other score in __init__
        raw_sums, counts = class_sums(terms(logits, labels, **self.score_options).per_sample, labels, self.num_classes)
        calibrated_sums, _ = class_sums(terms(calibrated, labels, **self.score_options).per_sample, labels, self.num_classes)
        self.raw_sums += raw_sums
        self.calibrated_sums += calibrated_sums
        self.class_counts += counts

    def compute(self) -> Tensor:
        """The relative loss in percent, or the absolute one with ``relative=False``; float64 scalar."""
        result = self._result()
        return result.relative if self.relative else result.absolute

    def result(self) -> CalibrationLossResult:
        """Both the absolute and the relative loss of the accumulated data (of all processes); both
        NaN without samples."""
        return self._synced_result(self._result, CalibrationLossResult)

    def _result(self) -> CalibrationLossResult:
        if self.streaming:
            return calibration_loss_from_scores(
                self.reduce(self.raw_sums, self.class_counts), self.reduce(self.calibrated_sums, self.class_counts)
            )
        return cross_validated_calibration_loss(
            dim_zero_cat(self.logits), dim_zero_cat(self.labels), self.calibrator, self.score,
            self.score_options.get("priors"), self.folds, self.seed,
        )
