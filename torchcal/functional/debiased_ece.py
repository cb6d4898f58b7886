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
    ColumnDecomposition,
    Strategy,
    bin_statistics,
    binned_error_columns,
    binned_scores,
    calibration_error_from_bins,
    check_calibration_error_kind,
    check_n_bins,
    quantile_edges,
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
    column, target = scores.reshape(-1, 1), targets.reshape(-1, 1).bool()
    limit = column.shape[0] if max_bins is None else min(max_bins, column.shape[0])
    chosen = 1
    for n_bins in range(2, limit + 1):
        counts, _, target_sums = (x[0] for x in bin_statistics(column, target, quantile_edges(column, n_bins)))
        frequency = (target_sums / counts.clamp_min(1))[counts > 0]
        if bool((frequency[1:] < frequency[:-1]).any()):
            break
        chosen = n_bins
    return chosen


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
    own bin count. ``max_bins`` caps the sweep (default N). One read-back per bin count tried.

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
        check_n_bins(max_bins)
    _, _, scores, targets, _, _ = binned_scores(logits, labels, 1, "uniform", kind)
    return ColumnDecomposition(scores, targets, partial(_sweep_of_columns, norm=norm, reduction=reduction, max_bins=max_bins))


def _sweep_of_columns(scores: Tensor, targets: Tensor, norm: Literal["l1", "l2"], reduction: Reduction, max_bins: int | None) -> Tensor:
    """The sweep ECE of the columns ``scores``, ``targets`` (N, C), each at its own bin count."""
    per_column = []
    for column, target in zip(scores.T, targets.T):
        n_bins = sweep_n_bins(column, target, max_bins)
        statistics = bin_statistics(column.unsqueeze(1), target.unsqueeze(1), quantile_edges(column.unsqueeze(1), n_bins))
        per_column.append(calibration_error_from_bins(*statistics, norm=norm))
    return _reduce(torch.stack(per_column), reduction)
