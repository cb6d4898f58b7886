"""Streaming calibration diagnostics: the ECE family and the entropic calibration difference.

``CalibrationError`` with equal-width bins keeps per-bin counts and float64 sums of scores and
targets, (C, M) each (C = K for ``kind="classwise"``, else 1). Equal-mass bins need every score to
place the edges, so with ``strategy="quantile"`` it keeps the scores and targets instead (O(N C)
memory; gathered across processes at ``compute()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from torchcal._validation import check_logits_and_labels
from torchcal.functional.diagnostics import (
    ReliabilityBins,
    bin_statistics,
    binning_scores,
    calibration_error_from_bins,
    ecd_per_sample,
    edge_tolerance,
    quantile_edges,
    reliability_bins_from_sums,
    uniform_edges,
)
from torchcal.functional.scoring import to_log_probs
from torchcal.metrics._common import add_sum_state, check_num_classes
from torchcal.metrics._softmax_rows import softmax_rows

__all__ = ["ECD", "CalibrationError"]


class CalibrationError(Metric):
    """Binned calibration error (ECE, RMS or MCE), as ``functional.expected_calibration_error``.

    Args:
        num_classes: K.
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width, O(M) state) or ``"quantile"`` (equal mass, O(N) state).
        kind: ``"top-label"``, ``"binary"`` (class 1 of K = 2) or ``"classwise"``.
        norm: ``"l1"`` (ECE), ``"l2"`` (RMS calibration error) or ``"max"`` (MCE).
        reduction: how ``"classwise"`` combines classes: ``"mean"``, ``"sum"`` or ``"max"``.

    Example:
        >>> import torch
        >>> metric = CalibrationError(num_classes=2, n_bins=10)
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> metric.update(probs[:2].log(), torch.tensor([0, 1]))
        >>> metric.update(probs[2:].log(), torch.tensor([1, 0]))
        >>> round(float(metric.compute()), 6)
        0.5
        >>> metric.reliability_bins().counts.tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        strategy: str = "uniform",
        kind: str = "top-label",
        norm: str = "l1",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_classes = check_num_classes(num_classes)
        if kind not in ("top-label", "binary", "classwise"):
            raise ValueError(f'kind must be "top-label", "binary" or "classwise", got {kind!r}.')
        if kind == "binary" and num_classes != 2:
            raise ValueError(f'kind="binary" needs K = 2 classes, got K = {num_classes}; use "classwise".')
        if strategy not in ("uniform", "quantile"):
            raise ValueError(f'strategy must be "uniform" or "quantile", got {strategy!r}.')
        if norm not in ("l1", "l2", "max") or reduction not in ("mean", "sum", "max"):
            raise ValueError(f'norm must be "l1", "l2" or "max" and reduction "mean", "sum" or "max"; got {norm!r}, {reduction!r}.')
        self.n_bins, self.strategy, self.kind, self.norm, self.reduction = n_bins, strategy, kind, norm, reduction
        edges = uniform_edges(n_bins)  # also validates n_bins
        if strategy == "uniform":
            self.register_buffer("edges", edges, persistent=False)
            columns = num_classes if kind == "classwise" else 1
            for name in ("counts", "score_sums", "target_sums"):
                add_sum_state(self, name, columns, n_bins)
        else:
            self.add_state("scores", [], dist_reduce_fx="cat", persistent=False)
            self.add_state("targets", [], dist_reduce_fx="cat", persistent=False)

    def update(self, logits: Tensor, labels: Tensor) -> None:
        """Accumulate ``logits: (N, K)`` and ``labels: (N,)``."""
        logits, labels = check_logits_and_labels(logits, labels, num_classes=self.num_classes)
        if self.kind == "top-label":  # binning_scores' result, from one exponential per entry
            rows = softmax_rows(logits, labels, torch.float64)
            scores, targets = rows.confidence.unsqueeze(1), rows.correct.unsqueeze(1)
        else:
            scores, targets = binning_scores(to_log_probs(logits), labels, self.kind)
        if self.strategy == "uniform":
            counts, score_sums, target_sums = bin_statistics(scores, targets, self.n_bins, edge_tolerance(logits.dtype))
            self.counts += counts
            self.score_sums += score_sums
            self.target_sums += target_sums
        else:
            self.scores.append(scores)
            self.targets.append(targets.to(torch.uint8))  # bool cannot be all-gathered by every backend

    def _binned(self) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """Edges, (M + 1,) or (C, M + 1), and the per-bin statistics (C, M)."""
        if self.strategy == "uniform":
            return self.edges, (self.counts, self.score_sums, self.target_sums)
        scores, targets = dim_zero_cat(self.scores), dim_zero_cat(self.targets).bool()
        edges = quantile_edges(scores, self.n_bins)
        return edges, bin_statistics(scores, targets, edges)

    def compute(self) -> Tensor:
        _, statistics = self._binned()
        return calibration_error_from_bins(*statistics, norm=self.norm, reduction=self.reduction)

    def reliability_bins(self, class_index: int | None = None) -> ReliabilityBins:
        """The accumulated ``ReliabilityBins``; ``class_index`` picks the class for ``"classwise"``."""
        if self.kind == "classwise":
            if class_index is None or not 0 <= class_index < self.num_classes:
                raise ValueError(f'kind="classwise" needs class_index in [0, {self.num_classes}), got {class_index}.')
            column = class_index
        else:
            column = 0
        edges, statistics = self._binned()
        edges = edges if edges.ndim == 1 else edges[column]
        return reliability_bins_from_sums(edges, *(x[column] for x in statistics))

    def plot(self, ax: Any = None, class_index: int | None = None) -> Any:
        """Reliability diagram of the accumulated bins by ``torchcal.plots.reliability_diagram``.

        Returns ``(fig, ax)``; ``class_index`` picks the class for ``kind="classwise"``.
        """
        from torchcal.plots import reliability_diagram  # matplotlib only when plotting

        kind = "class" if self.kind == "classwise" else self.kind
        return reliability_diagram(
            self.reliability_bins(class_index), kind=kind, class_index=class_index, n_bins=self.n_bins,
            strategy=self.strategy, ax=ax,
        )


class ECD(Metric):
    """Entropic calibration difference: mean NLL minus mean predictive entropy (Sumler et al.).

    Positive means over-confident, negative under-confident; a signed diagnostic, not a loss to
    minimise (see ``functional.entropic_calibration_difference``). It is bounded below by -log K.

    Example:
        >>> import torch
        >>> metric = ECD()
        >>> metric.update(torch.tensor([[.1, .9], [.5, .5]]).log(), torch.tensor([1, 0]))
        >>> round(float(metric.compute()), 6)
        -0.109861
    """

    is_differentiable = True
    higher_is_better = None  # signed: 0 is the target
    full_state_update = False
    plot_lower_bound = None  # -log K depends on K

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_sum_state(self, "total")
        add_sum_state(self, "count")

    def update(self, logits: Tensor, labels: Tensor) -> None:
        """Accumulate ``logits: (N, K)`` and ``labels: (N,)``."""
        logits, labels = check_logits_and_labels(logits, labels)
        self.total += ecd_per_sample(to_log_probs(logits), labels).sum()
        self.count += labels.shape[0]

    def compute(self) -> Tensor:
        return self.total / self.count
