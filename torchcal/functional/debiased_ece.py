"""Bias-reduced binned calibration errors.

- ``debiased_calibration_error``: the debiased l2 calibration error of Kumar, Liang & Ma 2019
  ("Verified uncertainty calibration"). The plug-in squared error of a bin,
  ``(ybar_m - sbar_m)^2``, overestimates the squared gap by the variance of ``ybar_m``; the
  estimator subtracts its unbiased estimate ``ybar_m (1 - ybar_m) / (n_m - 1)``:
  ``sqrt(max(0, sum_m (n_m / N) [(ybar_m - sbar_m)^2 - ybar_m (1 - ybar_m) / (n_m - 1)]))``, where
  bins with fewer than two samples contribute 0 (as in their ``calibration`` package). Equal-mass
  bins by default, as in the paper.
- ``sweep_calibration_error``: the equal-mass ECE with the monotonic sweep of Roelofs et al. 2022
  ("Mitigating bias in calibration error estimation"): the largest number of equal-mass bins M
  for which the bin frequencies ``ybar_1 <= ... <= ybar_M`` still increase (trying M = 1, 2, ...
  and stopping at the first M that breaks monotonicity), then the l1 or l2 ECE with M bins.

Bins, scores and targets are those of ``functional.diagnostics`` (``quantile_edges``,
right-closed bins, ``kind`` as there).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch import Tensor

from torchcal.functional.diagnostics import (
    COLUMN_CHUNK_ELEMENTS,
    EDGE_TOLERANCE,
    ColumnDecomposition,
    SortedColumns,
    Strategy,
    binned_error_columns,
    binned_scores,
    calibration_error_from_bins,
    check_calibration_error_kind,
    check_n_bins,
    equal_mass_statistics,
    sort_columns,
)

__all__ = [
    "debiased_calibration_error",
    "debiased_calibration_error_columns",
    "debiased_calibration_error_from_bins",
    "sweep_calibration_error",
    "sweep_calibration_error_columns",
    "sweep_n_bins",
]

Reduction = Literal["mean", "sum", "max", "rms"]
REDUCTIONS = ("mean", "sum", "max", "rms")


def _reduce(per_column: Tensor, reduction: str) -> Tensor:
    """Combine the columns' errors (..., C): their mean, sum, maximum or root mean square."""
    if reduction == "mean":
        return per_column.mean(-1)
    if reduction == "sum":
        return per_column.sum(-1)
    if reduction == "max":
        return per_column.amax(-1)
    if reduction == "rms":
        return per_column.square().mean(-1).sqrt()
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")


def debiased_calibration_error_from_bins(
    counts: Tensor, score_sums: Tensor, target_sums: Tensor, reduction: Reduction = "mean"
) -> Tensor:
    """Debiased l2 calibration error from per-bin sums (..., C, M) of 0/1 targets; reduced over C.

    Example (two bins of 4 samples, frequencies 0 and 1, mean scores 0.1 and 0.9):
        >>> counts, score_sums, target_sums = torch.tensor([[4., 4.]]), torch.tensor([[.4, 3.6]]), torch.tensor([[0., 4.]])
        >>> round(float(debiased_calibration_error_from_bins(counts, score_sums, target_sums)), 6)
        0.1
    """
    n = counts.sum(-1, keepdim=True)
    denominator = counts.clamp_min(1)
    frequency, mean_score = target_sums / denominator, score_sums / denominator
    variance = frequency * (1 - frequency) / (counts - 1).clamp_min(1)
    terms = (counts / n) * ((frequency - mean_score).square() - variance)
    terms = torch.where(counts >= 2, terms, torch.zeros_like(terms))
    return _reduce(terms.sum(-1).clamp_min(0).sqrt(), reduction)


def debiased_calibration_error(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "quantile",
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    reduction: Reduction = "mean",
) -> Tensor:
    """Debiased l2 calibration error (Kumar et al. 2019) with ``n_bins`` bins; a scalar.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        n_bins: number of bins M.
        strategy: ``"quantile"`` (equal mass, default, as the paper) or ``"uniform"``.
        kind: ``"top-label"``, ``"binary"`` or ``"classwise"``.
        reduction: how ``"classwise"`` combines the classes' debiased errors: the ``"mean"``,
            ``"sum"`` or ``"max"`` of them, or ``"rms"``, the root of the mean of their squares,
            which is Kumar et al.'s (2019) debiased marginal calibration error with p = 2.

    Example:
        >>> import torch
        >>> generator = torch.Generator().manual_seed(0)
        >>> logits = torch.randn(2000, 3, generator=generator)
        >>> labels = torch.multinomial(logits.softmax(1), 1, generator=generator).squeeze(1)
        >>> bool(debiased_calibration_error(logits, labels) < 0.05 < debiased_calibration_error(3 * logits, labels))
        True
    """
    return debiased_calibration_error_columns(logits, labels, n_bins, strategy, kind, reduction).evaluate()


def debiased_calibration_error_columns(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "quantile",
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    reduction: Reduction = "mean",
) -> ColumnDecomposition:
    """Validate the inputs of ``debiased_calibration_error`` and return its ``ColumnDecomposition``
    (which it evaluates), for the bootstrap: scores and targets (N, C), binned again on each resample.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> columns = debiased_calibration_error_columns(probs.log(), torch.tensor([0, 0, 0, 0]), n_bins=2)
        >>> columns.scores.shape, round(float(columns.evaluate()), 6)
        (torch.Size([4, 1]), 0.471699)
    """
    check_calibration_error_kind(kind)
    binned = binned_scores(logits, labels, n_bins, strategy, kind)
    return binned_error_columns(binned, strategy, partial(debiased_calibration_error_from_bins, reduction=reduction))


def sweep_n_bins(scores: Tensor, targets: Tensor, max_bins: int | None = None) -> int:
    """The monotonic sweep's bin count for one column: the largest M such that the equal-mass
    bins M' = 1..M all have non-decreasing frequencies. ``scores``, ``targets``: (N,).

    Example:
        >>> scores = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9], dtype=torch.float64)
        >>> sweep_n_bins(scores, torch.tensor([0, 0, 1, 0, 0, 1, 1, 1]))
        2
    """
    column = sort_columns(scores.reshape(-1, 1), targets.reshape(-1, 1).bool())
    # equal-mass edges are scores themselves: the tolerance of EDGE_TOLERANCE, as _swept_errors'
    return int(_sweep_bin_counts(column, _sweep_limit(scores.numel(), max_bins), EDGE_TOLERANCE)[0])


def _sweep_limit(num_samples: int, max_bins: int | None) -> int:
    """The largest bin count the sweep tries: N, or ``max_bins`` if fewer."""
    return num_samples if max_bins is None else min(max_bins, num_samples)


def _sweep_bin_counts(columns: SortedColumns, limit: int, tolerance: float) -> Tensor:
    """The sweep's bin count (C,) int64 of each sorted column: the M before the first M in
    2..``limit`` whose equal-mass frequencies decrease, ``limit`` if none does (1 if it is below 2).

    All columns try the same M together, in blocks of consecutive M that grow with M (as long as
    the block's statistics fit ``COLUMN_CHUNK_ELEMENTS``); a column stops at its first decrease.
    Once the sweep has read about as many bins as there are samples (M^2 > N), the columns whose
    frequencies cannot decrease at any M are found and given ``limit`` instead of being swept on.
    """
    (num_columns, num_samples), device = columns.scores.shape, columns.scores.device
    chosen = torch.full((num_columns,), max(limit, 1), dtype=torch.int64, device=device)
    held, index = columns, torch.arange(num_columns, device=device)  # the rows held, and their columns
    sweeping = torch.ones(num_columns, dtype=torch.bool, device=device)
    first, checked = 2, False
    while first <= limit:
        if not checked and first * first > num_samples:
            sweeping &= ~_frequencies_never_decrease(held)
            checked = True
        if not bool(sweeping.any()):
            break
        if 2 * int(sweeping.sum()) <= sweeping.numel():  # copy the rows still swept once half are done
            held, index, sweeping = _select(held, sweeping), index[sweeping], sweeping[sweeping]
        length = max(1, min(first, limit + 1 - first, COLUMN_CHUNK_ELEMENTS // (sweeping.numel() * 2 * first)))
        n_bins = torch.arange(first, first + length, device=device)
        counts, _, target_sums = equal_mass_statistics(held, n_bins, tolerance)
        decreasing = _decreasing_frequencies(counts, target_sums) & sweeping.unsqueeze(1)  # (rows, length)
        stopped = decreasing.any(-1)
        # argmax finds the first M of the block that decreases; the sweep keeps the one before it
        chosen[index[stopped]] = first - 1 + decreasing[stopped].int().argmax(-1)
        sweeping &= ~stopped
        first += length
    return chosen


def _select(columns: SortedColumns, index: Tensor) -> SortedColumns:
    """The sorted columns that ``index`` (a mask or indices) picks."""
    return SortedColumns(*(x[index] for x in columns))


def _decreasing_frequencies(counts: Tensor, target_sums: Tensor) -> Tensor:
    """Whether the frequencies of the non-empty bins (..., M) decrease somewhere; (...) bool.

    A sequence decreases somewhere if and only if one of its terms lies below the largest term
    before it; empty bins are left out of both.
    """
    frequency = target_sums / counts.clamp_min(1)
    nonempty = counts > 0
    highest = torch.where(nonempty, frequency, -1.0).cummax(-1).values
    return (nonempty[..., 1:] & (frequency[..., 1:] < highest[..., :-1])).any(-1)


def _frequencies_never_decrease(columns: SortedColumns) -> Tensor:
    """Whether no equal-mass split of each sorted column has decreasing frequencies; (C,) bool.

    Bins split a column only between distinct scores, so a bin's frequency is a weighted mean of
    the frequencies of the groups of tied scores in it: if these do not decrease with the score,
    neither do the bins' frequencies, for any M (columns of one class only, or separable ones,
    which the sweep would otherwise take to M = N).
    """
    ordered = columns.scores
    num_columns, num_samples = ordered.shape
    position = torch.arange(num_samples, device=ordered.device).expand(num_columns, -1)
    starts = torch.ones_like(ordered, dtype=torch.bool)  # whether a group of tied scores starts here
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    ends = torch.ones_like(starts)  # whether one ends here
    ends[:, :-1] = starts[:, 1:]
    # each sample's group: from the last start at or before it to one past the first end at or after it
    first = torch.where(starts, position, 0).cummax(-1).values
    last = torch.where(ends, position + 1, num_samples).flip(-1).cummin(-1).values.flip(-1)
    positives = columns.target_prefix.gather(-1, last) - columns.target_prefix.gather(-1, first)
    sizes = (last - first).to(torch.float64)
    # neighbouring samples' group frequencies p / n <= p' / n', compared without rounding
    return (positives[:, :-1] * sizes[:, 1:] <= positives[:, 1:] * sizes[:, :-1]).all(-1)


def _swept_errors(columns: SortedColumns, limit: int, norm: Literal["l1", "l2"]) -> Tensor:
    """The calibration error (C,) of each sorted column with its sweep's equal-mass bins."""
    n_bins = _sweep_bin_counts(columns, limit, EDGE_TOLERANCE)
    counts, score_sums, target_sums = (x.squeeze(1) for x in equal_mass_statistics(columns, n_bins.unsqueeze(1)))
    return calibration_error_from_bins(counts, score_sums, target_sums, norm=norm, reduction="none")


def sweep_calibration_error(
    logits: Tensor,
    labels: Tensor,
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    norm: Literal["l1", "l2"] = "l2",
    reduction: Reduction = "mean",
    max_bins: int | None = None,
) -> Tensor:
    """Equal-mass ECE with the monotonic sweep of bin counts (Roelofs et al. 2022); a scalar.

    ``norm="l2"`` (the paper's ECE_sweep) or ``"l1"``; each column of ``"classwise"`` sweeps its
    own bin count. ``max_bins`` caps the sweep (default N). Each column is sorted once and every
    bin count's bins read from the sorted order; the columns are swept together, in chunks that
    bound the memory, with one read-back per block of bin counts tried.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.7, .3], [.6, .4], [.4, .6], [.3, .7], [.2, .8], [.1, .9]])
        >>> round(float(sweep_calibration_error(probs.log(), torch.tensor([0, 0, 1, 0, 1, 1, 0, 1]), kind="binary")), 6)
        0.11547
    """
    return sweep_calibration_error_columns(logits, labels, kind, norm, reduction, max_bins).evaluate()


def sweep_calibration_error_columns(
    logits: Tensor,
    labels: Tensor,
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    norm: Literal["l1", "l2"] = "l2",
    reduction: Reduction = "mean",
    max_bins: int | None = None,
) -> ColumnDecomposition:
    """Validate the inputs of ``sweep_calibration_error`` and return its ``ColumnDecomposition``
    (which it evaluates), for the bootstrap: scores and targets (N, C), swept again on each resample.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.7, .3], [.6, .4], [.4, .6], [.3, .7], [.2, .8], [.1, .9]])
        >>> columns = sweep_calibration_error_columns(probs.log(), torch.tensor([0, 0, 1, 0, 1, 1, 0, 1]), kind="binary")
        >>> columns.scores.shape, round(float(columns.evaluate()), 6)
        (torch.Size([8, 1]), 0.11547)
    """
    check_calibration_error_kind(kind)
    if norm not in ("l1", "l2"):
        raise ValueError(f'norm must be "l1" or "l2", got {norm!r}.')
    if max_bins is not None:
        check_n_bins(max_bins, "max_bins")
    _, _, scores, targets, _, _ = binned_scores(logits, labels, 1, "uniform", kind)
    return ColumnDecomposition(scores, targets, partial(_sweep_of_columns, norm=norm, reduction=reduction, max_bins=max_bins))


def _sweep_of_columns(scores: Tensor, targets: Tensor, norm: Literal["l1", "l2"], reduction: Reduction, max_bins: int | None) -> Tensor:
    """The sweep ECE of the columns ``scores``, ``targets`` (N, C), each at its own bin count."""
    limit = _sweep_limit(scores.shape[0], max_bins)
    chunk = max(1, COLUMN_CHUNK_ELEMENTS // scores.shape[0])
    per_column = [
        _swept_errors(sort_columns(f, y), limit, norm) for f, y in zip(scores.split(chunk, 1), targets.split(chunk, 1))
    ]
    return _reduce(torch.cat(per_column), reduction)
