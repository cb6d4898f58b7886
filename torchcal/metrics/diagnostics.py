"""Streaming calibration diagnostics: the ECE family, the signed calibration error and the
entropic calibration difference.

``ExpectedCalibrationError`` with equal-width bins keeps per-bin counts and float64 sums of scores
and targets, (C, M) each (C = K for ``kind="classwise"``, else 1). Equal-mass bins need every score
to place the edges, so with ``strategy="quantile"`` it keeps the scores and targets instead (O(N C)
memory; gathered across processes at ``compute()``). ``EntropicCalibrationDifference`` with
``n_bins`` keeps per-bin sums, or every score for equal-mass bins.
"""

from __future__ import annotations

import operator
from typing import Any, Literal

import torch
from torch import Tensor

from torchcal.functional.diagnostics import (
    Norm,
    Reduction,
    ReliabilityBins,
    Strategy,
    bin_indices,
    bin_statistics,
    binning_scores,
    calibration_error_from_bins,
    check_binary_kind,
    check_n_bins,
    ecd_per_sample,
    edge_tolerance,
    quantile_edges,
    reliability_bins_from_sums,
    uniform_edges,
)
from torchcal.functional.scoring import to_log_probs
from torchcal.metrics._common import ScoreMetric, add_cat_state, add_sum_state
from torchcal.metrics._softmax_rows import softmax_rows

__all__ = [
    "ECD",
    "CalibrationError",
    "EntropicCalibrationDifference",
    "ExpectedCalibrationError",
    "SignedCalibrationError",
]


def _check_strategy(strategy: str) -> None:
    if strategy not in ("uniform", "quantile"):
        raise ValueError(f'strategy must be "uniform" or "quantile", got {strategy!r}.')


def _equal_mass_edges(scores: Tensor, n_bins: int) -> Tensor:
    """``quantile_edges`` of ``scores: (N, C)``; without samples, which have no quantiles, the
    equal-width edges: their empty bins give ``compute()`` its usual shape (NaN, ``_wrap_compute``)."""
    return quantile_edges(scores, n_bins) if scores.shape[0] else uniform_edges(n_bins).to(scores.device)


class ExpectedCalibrationError(ScoreMetric):
    """Binned calibration error (ECE, RMS or MCE), as ``functional.expected_calibration_error``.

    ``compute()`` returns a float64 scalar, or the (K,) per-class values with
    ``kind="classwise", reduction="none"`` (for ``torchmetrics.wrappers.ClasswiseWrapper``).
    ``plot()`` plots the value; ``plot_reliability()`` draws the reliability diagram.

    Args:
        num_classes: K.
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width, O(M) state) or ``"quantile"`` (equal mass, O(N) state).
        kind: ``"top-label"``, ``"binary"`` (class 1 of K = 2) or ``"classwise"``.
        norm: ``"l1"`` (ECE), ``"l2"`` (RMS calibration error) or ``"max"`` (MCE).
        reduction: how ``"classwise"`` combines classes: ``"mean"``, ``"sum"``, ``"max"`` or
            ``"none"`` (per class).
        input, ignore_index, validate_args: see ``torchcal.metrics``.

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
    plot_lower_bound = 0.0  # (no upper bound: summed over the classes, up to K)

    num_classes: int
    edges: Tensor
    counts: Tensor
    score_sums: Tensor
    target_sums: Tensor
    scores: list[Tensor]
    targets: list[Tensor]

    _compute_only_options = ("norm", "reduction")

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        strategy: Strategy = "uniform",
        kind: Literal["top-label", "binary", "classwise"] = "top-label",
        norm: Norm = "l1",
        reduction: Reduction = "mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(num_classes, **kwargs)
        if kind not in ("top-label", "binary", "classwise"):
            raise ValueError(f'kind must be "top-label", "binary" or "classwise", got {kind!r}.')
        check_binary_kind(kind, num_classes, ("top-label", "binary", "classwise"))
        _check_strategy(strategy)
        if norm not in ("l1", "l2", "max") or reduction not in ("mean", "sum", "max", "none"):
            raise ValueError(
                f'norm must be "l1", "l2" or "max" and reduction "mean", "sum", "max" or "none"; got {norm!r}, {reduction!r}.'
            )
        n_bins = check_n_bins(n_bins)
        self.n_bins, self.strategy, self.kind, self.norm, self.reduction = n_bins, strategy, kind, norm, reduction
        edges = uniform_edges(n_bins)
        columns = num_classes if kind == "classwise" else 1
        if strategy == "uniform":
            self.register_buffer("edges", edges, persistent=False)
            for name in ("counts", "score_sums", "target_sums"):
                add_sum_state(self, name, columns, n_bins)
        else:
            add_cat_state(self, "scores", torch.float64, columns)
            add_cat_state(self, "targets", torch.uint8, columns)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
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
        scores, targets = self._cat("scores"), self._cat("targets").bool()
        edges = _equal_mass_edges(scores, self.n_bins)
        return edges, bin_statistics(scores, targets, edges)

    def compute(self) -> Tensor:
        """The calibration error: a float64 scalar, or (K,) with ``reduction="none"``."""
        _, statistics = self._binned()
        return calibration_error_from_bins(*statistics, norm=self.norm, reduction=self.reduction)

    def reliability_bins(self, class_index: int | None = None) -> ReliabilityBins:
        """The accumulated ``ReliabilityBins``; ``class_index`` picks the class for ``"classwise"``."""
        if self.kind == "classwise":
            try:  # (any integer, a 0-d integer tensor among them; not a bool)
                column = -1 if isinstance(class_index, bool) else operator.index(class_index)  # type: ignore[arg-type]
            except TypeError:
                column = -1
            if not 0 <= column < self.num_classes:
                raise ValueError(f'kind="classwise" needs an integer class_index in [0, {self.num_classes}), got {class_index!r}.')
        elif class_index is not None:
            raise ValueError(f'class_index picks a class of kind="classwise"; this metric is kind="{self.kind}", which has '
                             f'one set of bins: leave class_index out.')
        else:
            column = 0
        edges, statistics = self._binned()
        edges = edges if edges.ndim == 1 else edges[column]
        return reliability_bins_from_sums(edges, *(x[column] for x in statistics))

    def plot_reliability(self, ax: Any = None, class_index: int | None = None) -> Any:
        """Reliability diagram of the accumulated bins by ``torchcal.plots.reliability_diagram``.

        Returns ``(fig, ax)``; ``class_index`` picks the class for ``kind="classwise"``.
        """
        from torchcal.plots import reliability_diagram  # matplotlib only when plotting

        kind = "class" if self.kind == "classwise" else self.kind
        return reliability_diagram(
            self.reliability_bins(class_index), kind=kind, class_index=class_index, n_bins=self.n_bins,
            strategy=self.strategy, ax=ax,
        )


#: The kinds of the signed calibration error and of the ECD.
_SIGNED_KINDS = ("top-label", "binary")


class SignedCalibrationError(ScoreMetric):
    """Expected signed calibration error (ESCE), as ``functional.signed_calibration_error``: the
    mean target minus the mean score (accuracy minus confidence for ``"top-label"``).

    State: three float64 sums, whatever N.

    Args:
        num_classes: K, or None for any.
        kind: ``"top-label"`` (negative: over-confident) or ``"binary"`` (``q_1``, K = 2).
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> metric = SignedCalibrationError(input="probs")
        >>> metric.update(probs, torch.tensor([0, 1, 1, 0]))
        >>> round(float(metric.compute()), 6)
        -0.25
    """

    is_differentiable = False
    higher_is_better = None  # signed: 0 is the target
    full_state_update = False
    plot_lower_bound = -1.0
    plot_upper_bound = 1.0

    sums: Tensor

    def __init__(
        self, num_classes: int | None = None, kind: Literal["top-label", "binary"] = "top-label", **kwargs: Any
    ) -> None:
        super().__init__(num_classes, **kwargs)
        if kind not in _SIGNED_KINDS:
            raise ValueError(f'kind must be "top-label" or "binary", got {kind!r}.')
        if num_classes is not None:
            check_binary_kind(kind, num_classes, _SIGNED_KINDS)
        self.kind = kind
        add_sum_state(self, "sums", 3)  # targets, scores, count

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        problems = self._binary_problems(scores, labels, allowed=_SIGNED_KINDS)
        if problems is None:
            return
        scores, targets = problems
        self.sums += torch.stack([targets.sum().double(), scores.sum(), scores.new_tensor(float(scores.shape[0]))])

    def compute(self) -> Tensor:
        """ESCE, a float64 scalar."""
        targets, scores, count = self.sums
        return (targets - scores) / count


class EntropicCalibrationDifference(ScoreMetric):
    """Entropic calibration difference: mean NLL minus mean predictive entropy (Sumler et al.), as
    ``functional.entropic_calibration_difference``, with the same options.

    Positive means over-confident, negative under-confident; a signed diagnostic, not a loss to
    minimise. It is bounded below by -log K. ``compute()`` returns a float64 scalar, or with
    ``n_bins`` the (n_bins,) mean ECD of each bin (0 for empty bins). ``is_differentiable`` (a
    class constant in torchmetrics) holds for the scalar; the binned values pass no gradient.

    Args:
        num_classes: K, or None for any.
        n_bins: if given, the mean ECD per bin of the binned score (O(n_bins) state for
            ``strategy="uniform"``, every sample for ``"quantile"``).
        strategy: ``"uniform"`` or ``"quantile"`` bins.
        kind: which score is binned: ``"top-label"`` confidence or ``"binary"`` ``q_1`` (K = 2).
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = EntropicCalibrationDifference()
        >>> metric.update(torch.tensor([[.1, .9], [.5, .5]]).log(), torch.tensor([1, 0]))
        >>> round(float(metric.compute()), 6)
        -0.109861
    """

    is_differentiable = True
    higher_is_better = None  # signed: 0 is the target
    full_state_update = False
    plot_lower_bound = None  # -log K depends on K

    sums: Tensor
    scores: list[Tensor]
    values: list[Tensor]

    def __init__(
        self,
        num_classes: int | None = None,
        n_bins: int | None = None,
        strategy: Strategy = "uniform",
        kind: Literal["top-label", "binary"] = "top-label",
        **kwargs: Any,
    ) -> None:
        super().__init__(num_classes, **kwargs)
        _check_strategy(strategy)
        if kind not in _SIGNED_KINDS:
            raise ValueError(f'kind must be "top-label" or "binary", got {kind!r}.')
        if num_classes is not None:
            check_binary_kind(kind, num_classes, _SIGNED_KINDS)
        if n_bins is not None:
            n_bins = check_n_bins(n_bins)
        self.n_bins, self.strategy, self.kind = n_bins, strategy, kind
        if n_bins is not None and strategy == "quantile":
            add_cat_state(self, "scores", torch.float64, 1)
            add_cat_state(self, "values", torch.float64)
        else:
            add_sum_state(self, "sums", 2, 1 if n_bins is None else n_bins)  # ECD sums, counts

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        log_probs = to_log_probs(logits)
        values = ecd_per_sample(log_probs, labels)
        check_binary_kind(self.kind, log_probs.shape[1], _SIGNED_KINDS)
        if self.n_bins is None:
            self.sums += torch.stack([values.sum(), values.new_tensor(float(labels.shape[0]))]).unsqueeze(1)
            return
        binned, _ = binning_scores(log_probs, labels, self.kind)
        if self.strategy == "quantile":
            self.scores.append(binned.detach())
            self.values.append(values.detach())
            return
        index = bin_indices(binned, uniform_edges(self.n_bins).to(binned.device), edge_tolerance(logits.dtype)).squeeze(1)
        sums = torch.zeros(2, self.n_bins, dtype=torch.float64, device=values.device)
        sums[0].index_add_(0, index, values.detach())
        sums[1].index_add_(0, index, torch.ones_like(values))
        self.sums += sums

    def compute(self) -> Tensor:
        """Mean ECD: a float64 scalar, or (n_bins,) per bin."""
        if self.n_bins is not None and self.strategy == "quantile":
            scores, values = self._cat("scores"), self._cat("values")
            index = bin_indices(scores, _equal_mass_edges(scores, self.n_bins)).squeeze(1)
            totals = torch.zeros(2, self.n_bins, dtype=torch.float64, device=values.device)
            totals[0].index_add_(0, index, values)
            totals[1].index_add_(0, index, torch.ones_like(values))
        else:
            totals = self.sums
        means = totals[0] / totals[1].clamp_min(1) if self.n_bins is not None else totals[0] / totals[1]
        return means if self.n_bins is not None else means.squeeze(0)


#: Former names, kept as aliases.
CalibrationError = ExpectedCalibrationError
ECD = EntropicCalibrationDifference
