"""Streaming binary detection metrics: actual Cllr and actual DCF.

Both are prior-weighted means of a per-sample value of the LLR, so with the ``priors`` the
posteriors assume given, the state is two per-class sums and two class counts, summed across
batches and processes. Without ``priors`` the LLR subtracts the log-odds of the data's own class
frequencies, which are only known once every batch is in: the metric then keeps every sample's
log-odds and label (O(N) state, gathered at ``compute()``), as ``ExpectedCalibrationError`` does
for equal-mass bins. minCllr, the EER and the minimum DCF need every score at once (PAV, ROC hull,
every threshold) and have only the functional form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics.utilities import dim_zero_cat

from torchcal.functional.detection import (
    bayes_accepts,
    bayes_threshold,
    check_detection_priors,
    cllr,
    cllr_from_class_sums,
    cllr_per_sample,
    detection_cost,
    detection_cost_from_class_sums,
)
from torchcal.functional.scoring import class_sums, to_log_probs
from torchcal.metrics._common import ScoreMetric, add_cat_state, add_sum_state

__all__ = ["Cllr", "DetectionCost"]


class _DetectionMetric(ScoreMetric):
    """A metric of the LLRs of K = 2 scores (class 1 the target): see the module docs."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0

    priors: Tensor | None
    class_sums: Tensor
    class_counts: Tensor
    log_odds: list[Tensor]
    targets: list[Tensor]

    def __init__(self, priors: Tensor | None = None, *, num_classes: int = 2, **kwargs: Any) -> None:
        if num_classes != 2:
            raise ValueError(f"{type(self).__name__} is a binary metric (class 1 the target): num_classes must be 2, got {num_classes!r}.")
        super().__init__(2, **kwargs)
        self.register_buffer("priors", None if priors is None else check_detection_priors(priors), persistent=False)
        if priors is None:
            add_cat_state(self, "log_odds", torch.float64)
            add_cat_state(self, "targets", torch.int64)
        else:
            add_sum_state(self, "class_sums", 2)
            add_sum_state(self, "class_counts", 2)

    def _per_sample(self, log_odds: Tensor, prior_log_odds: Tensor, labels: Tensor) -> Tensor:
        """Each sample's term (N,) of the prior-weighted mean, given its posterior log-odds, the
        priors' and its label (its LLR is their difference)."""
        raise NotImplementedError

    def _from_sums(self, sums: Tensor, counts: Tensor) -> Tensor:
        """The metric from the per-class sums of ``_per_sample`` and the class counts, (2,) each."""
        raise NotImplementedError

    def _functional(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The functional form, on (N, 2) logits and (N,) labels (for ``priors=None``)."""
        raise NotImplementedError

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, 2)``, ``(N, 2, d1, ...)`` or one score of class 1 ``(N, ...)``, and ``labels``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        log_probs = to_log_probs(logits)
        log_odds = log_probs[:, 1] - log_probs[:, 0]
        if self.priors is None:
            self.log_odds.append(log_odds)
            self.targets.append(labels)
            return
        sums, counts = class_sums(self._per_sample(log_odds, self.priors[1].log() - self.priors[0].log(), labels), labels, 2)
        self.class_sums += sums
        self.class_counts += counts

    def compute(self) -> Tensor:
        """The metric, a float64 scalar."""
        if self.priors is None:
            log_odds = dim_zero_cat(self.log_odds)
            return self._functional(torch.stack([torch.zeros_like(log_odds), log_odds], 1), dim_zero_cat(self.targets))
        return self._from_sums(self.class_sums, self.class_counts)


class Cllr(_DetectionMetric):
    """Actual Cllr in bits (Brümmer & du Preez 2006), as ``functional.cllr``.

    Args:
        priors: the (2,) priors the posteriors assume, which turn them into LLRs; then the state is
            per-class sums. None (default): the data's class frequencies, as ``functional.cllr``,
            and every sample's log-odds are kept until ``compute()``.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> metric = Cllr(priors=torch.tensor([0.25, 0.75]))
        >>> metric.update(probs[:2].log(), torch.tensor([0, 1]))
        >>> metric.update(probs[2:].log(), torch.tensor([1, 1]))
        >>> round(float(metric.compute()), 4)
        0.7356
    """

    def _per_sample(self, log_odds: Tensor, prior_log_odds: Tensor, labels: Tensor) -> Tensor:
        return cllr_per_sample(log_odds - prior_log_odds, labels)

    def _from_sums(self, sums: Tensor, counts: Tensor) -> Tensor:
        return cllr_from_class_sums(sums, counts)

    def _functional(self, logits: Tensor, labels: Tensor) -> Tensor:
        return cllr(logits, labels)


class DetectionCost(_DetectionMetric):
    """Actual DCF of the Bayes decisions at an operating point, as ``functional.detection_cost``.

    Args:
        target_prior, cost_miss, cost_false_alarm: the operating point.
        priors: as ``Cllr``: the priors the posteriors assume (per-class sums), or None for the
            data's class frequencies (every sample's log-odds kept).
        normalize: divide by ``min(C_miss P_tar, C_fa (1 - P_tar))``, the best fixed decision.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> metric = DetectionCost(target_prior=0.75, priors=torch.tensor([0.25, 0.75]))
        >>> metric.update(probs.log(), torch.tensor([0, 1, 1, 1]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self,
        target_prior: float = 0.5,
        cost_miss: float = 1.0,
        cost_false_alarm: float = 1.0,
        priors: Tensor | None = None,
        normalize: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(priors, **kwargs)
        self.threshold = bayes_threshold(target_prior, cost_miss, cost_false_alarm)  # validates the operating point
        self.target_prior, self.cost_miss, self.cost_false_alarm = target_prior, cost_miss, cost_false_alarm
        self.normalize = normalize

    def _per_sample(self, log_odds: Tensor, prior_log_odds: Tensor, labels: Tensor) -> Tensor:
        return bayes_accepts(log_odds, prior_log_odds, self.threshold) != (labels == 1)  # a false alarm or a miss

    def _from_sums(self, sums: Tensor, counts: Tensor) -> Tensor:
        return detection_cost_from_class_sums(
            sums, counts, self.target_prior, self.cost_miss, self.cost_false_alarm, self.normalize
        )

    def _functional(self, logits: Tensor, labels: Tensor) -> Tensor:
        return detection_cost(
            logits, labels, self.target_prior, self.cost_miss, self.cost_false_alarm, normalize=self.normalize
        )
