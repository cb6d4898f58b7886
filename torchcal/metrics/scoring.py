"""Streaming expected proper scoring rules: cross-entropy and the Brier score.

State: per-class sums of the per-sample score and per-class counts, (K,) float64 each, so
deployment priors and normalisation are applied exactly at ``compute()``
(``torchcal.functional.scoring.epsr_from_class_sums``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from torchcal._validation import check_priors
from torchcal.functional.scoring import (
    brier_per_sample,
    class_sums,
    epsr_from_class_sums,
    log_loss_per_sample,
    naive_brier_score,
    naive_cross_entropy,
    to_log_probs,
)
from torchcal.metrics._common import ScoreMetric, add_sum_state

__all__ = ["BrierScore", "CrossEntropy"]


class _ExpectedScore(ScoreMetric):
    is_differentiable = True
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0

    per_sample: Callable[[Tensor, Tensor], Tensor]
    naive: Callable[[Tensor], Tensor]
    num_classes: int
    priors: Tensor | None
    class_sums: Tensor
    class_counts: Tensor

    _compute_only_options = ("priors", "normalize")

    def __init__(
        self, num_classes: int, priors: Tensor | None = None, normalize: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(num_classes, **kwargs)
        self.register_buffer("priors", None if priors is None else check_priors(priors, num_classes), persistent=False)
        self.normalize = normalize
        add_sum_state(self, "class_sums", num_classes)
        add_sum_state(self, "class_counts", num_classes)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        sums, counts = class_sums(type(self).per_sample(to_log_probs(logits), labels), labels, self.num_classes)
        self.class_sums += sums
        self.class_counts += counts

    def compute(self) -> Tensor:
        """The score, a float64 scalar."""
        return epsr_from_class_sums(self.class_sums, self.class_counts, type(self).naive, self.priors, self.normalize)


class CrossEntropy(_ExpectedScore):
    """Mean cross-entropy (nats) of ``softmax(logits)``, as ``torchcal.functional.cross_entropy``.

    Args:
        num_classes: K.
        priors: optional (K,) deployment priors (class re-weighting).
        normalize: divide by the prior entropy (NCE); empirical priors unless ``priors`` is given.
        input, ignore_index, validate_args: see ``torchcal.metrics`` (``input="probs"`` for
            probabilities); ``kwargs`` go to ``torchmetrics.Metric``.

    Example:
        >>> import torch
        >>> metric = CrossEntropy(num_classes=2)
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric.update(probs[:1].log(), torch.tensor([0]))
        >>> metric.update(probs[1:].log(), torch.tensor([1, 1, 1]))
        >>> round(float(metric.compute()), 6)
        0.400367
        >>> round(float(CrossEntropy(num_classes=2, input="probs")(probs, torch.tensor([0, 1, 1, 1]))), 6)
        0.400367
    """

    per_sample = staticmethod(log_loss_per_sample)
    naive = staticmethod(naive_cross_entropy)


class BrierScore(_ExpectedScore):
    """Mean Brier score summed over classes (0..2 scale), as ``torchcal.functional.brier_score``.

    Args:
        num_classes: K.
        priors: optional (K,) deployment priors (class re-weighting).
        normalize: divide by the naive system's Brier score (NBS).
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = BrierScore(num_classes=2, normalize=True)
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric.update(probs.log(), torch.tensor([0, 1, 1, 1]))
        >>> round(float(metric.compute()), 6)
        0.666667
    """

    per_sample = staticmethod(brier_per_sample)
    naive = staticmethod(naive_brier_score)
    # (no plot_upper_bound: 2 bounds the score, not its normalised form, 2.94 on real LLRs)
