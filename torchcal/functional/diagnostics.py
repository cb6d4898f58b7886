"""Calibration diagnostics: reliability bins, the ECE family, ESCE and ECD.

Binned diagnostics reduce the problem to C binary ones: a score in [0, 1] and a 0/1 target per
sample and column, where the ``kind`` picks the columns (Silva Filho et al., §3.2):

- ``"top-label"``: the confidence ``max_k q_k`` and whether the first maximal class is correct;
- ``"binary"``: ``q_1`` and ``[y == 1]`` for K = 2 (class 1 is the positive class);
- ``"class"``: ``q_j`` and ``[y == j]`` for one ``class_index`` j;
- ``"classwise"``: all K columns ``q_k`` and ``[y == k]``.

Bins. ``strategy="uniform"``: equal-width bins, right-closed with the first bin closed at 0,
``[0, 1/M], (1/M, 2/M], ..., ((M-1)/M, 1]``, so a score of exactly 1.0 is in the last bin.
``strategy="quantile"``: equal-mass bins whose interior edges are the k/M quantiles of each
column's scores (linear interpolation, as ``numpy.quantile``), again right-closed; the outer edges
are 0 and 1. Ties make equal-mass bins unequal, or empty. A score above an equal-width edge by
less than the relative :func:`edge_tolerance` of the logits' precision (1e-12 for float64, 8 units
in the last place otherwise: 9.5e-7 for float32) counts as on the edge, so a score that is k/M up
to the round-off of ``softmax(log(p))`` (measured up to 6 units in the last place) lands in the
same bin as k/M itself. A wider tolerance would move real scores that lie just above an edge (11
of them in the CIFAR, speech and text logits of the reference data at 64 units) into the lower bin
for float32 logits but not for the same logits in float64. Equal-mass edges, taken from the scores
themselves, use 1e-12. Empty bins contribute 0 to every sum and are left out of the maximum. Bin
sums are accumulated in float64.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels, compute_dtype
from torchcal.functional.scoring import to_log_probs

__all__ = [
    "BinDecomposition",
    "BinnedScores",
    "ColumnDecomposition",
    "ReliabilityBins",
    "SortedColumns",
    "bin_indices",
    "bin_statistics",
    "binned_error_columns",
    "binned_scores",
    "binning_scores",
    "calibration_error_columns",
    "calibration_error_from_bins",
    "calibration_error_terms",
    "check_calibration_error_kind",
    "check_n_bins",
    "ecd_per_sample",
    "edge_tolerance",
    "entropic_calibration_difference",
    "equal_mass_statistics",
    "expected_calibration_error",
    "quantile_edges",
    "reliability_bins",
    "reliability_bins_from_sums",
    "signed_calibration_error",
    "sort_columns",
    "sums_by_key",
    "uniform_bin_indices",
    "uniform_edges",
]

Kind = Literal["top-label", "binary", "class", "classwise"]
Strategy = Literal["uniform", "quantile"]
Norm = Literal["l1", "l2", "max"]
Reduction = Literal["mean", "sum", "max", "none"]

EDGE_TOLERANCE = 1e-12
#: The kinds of the calibration errors (and of binned statistics by default).
CALIBRATION_ERROR_KINDS = ("top-label", "binary", "classwise")
EDGE_ULPS = 8
#: Elements of one (columns, samples) block that column-by-column work handles at once: it bounds the
#: memory of the functionals that sort or round every column of (N, K) scores (32 MB per float64 block).
COLUMN_CHUNK_ELEMENTS = 1 << 22


def edge_tolerance(*dtypes: torch.dtype) -> float:
    """Relative tolerance of the interior bin edges for scores computed from tensors of ``dtypes``
    (e.g. the logits' and the scores'): ``EDGE_ULPS`` units in the last place of the least precise
    (float32 for half precision, which is computed in float32), and at least ``EDGE_TOLERANCE``.

    Example:
        >>> edge_tolerance(torch.float64), edge_tolerance(torch.float32, torch.float64)
        (1e-12, 9.5367431640625e-07)
    """
    return max(EDGE_TOLERANCE, *(EDGE_ULPS * torch.finfo(compute_dtype(d)).eps for d in dtypes))


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin statistics of one binary reliability problem (M bins).

    ``mean_score`` is the mean predicted probability in the bin and ``frequency`` the fraction of
    positive targets (the accuracy for top-label bins); both are 0 in empty bins (``counts == 0``).
    """

    edges: Tensor  # (M + 1,)
    counts: Tensor  # (M,)
    mean_score: Tensor  # (M,)
    frequency: Tensor  # (M,)


def binary_problems(
    logits: Tensor, labels: Tensor, kind: str, allowed: tuple[str, ...] = ("top-label", "binary")
) -> tuple[Tensor, Tensor]:
    """Validated scores and targets (N, C), both float64, of the binary problems ``kind`` selects
    (one of the caller's ``allowed`` kinds) from log-domain scores ``logits: (N, K)`` and
    ``labels: (N,)``: the common first step of the functionals that work on such problems."""
    if kind not in allowed:
        names = [f'"{name}"' for name in allowed]
        raise ValueError(f"kind must be {', '.join(names[:-1])} or {names[-1]}, got {kind!r}.")
    logits, labels = check_logits_and_labels(logits, labels)
    check_binary_kind(kind, logits.shape[1], allowed)
    scores, targets = binning_scores(to_log_probs(logits), labels, kind)  # type: ignore[arg-type]
    return scores.to(torch.float64), targets.to(torch.float64)


def check_binary_kind(kind: str, num_classes: int | None, allowed: Sequence[str]) -> None:
    """Raise where ``kind="binary"`` meets K != 2 classes, naming the caller's ``allowed`` kinds
    (:func:`binning_scores`'s message offers "class" and "classwise", which not every caller takes);
    ``num_classes=None``: a metric built for any K, which the binary kind needs to be 2."""
    if kind == "binary" and num_classes is None:
        raise ValueError('kind="binary" scores class 1 of K = 2 classes: pass num_classes=2.')
    if kind == "binary" and num_classes != 2:
        others = " or ".join(f'kind="{name}"' + (" with class_index=j" if name == "class" else "") for name in allowed if name != "binary")
        raise ValueError(f'kind="binary" needs K = 2 classes, got K = {num_classes}' + (f"; use {others}." if others else "."))


def binning_scores(
    log_probs: Tensor, labels: Tensor, kind: Kind, class_index: int | None = None
) -> tuple[Tensor, Tensor]:
    """Scores (N, C) float64 and targets (N, C) bool of the binary problems that ``kind`` selects.

    ``log_probs: (N, K)`` are normalised log-posteriors. C is 1, except K for ``"classwise"``.

    Example:
        >>> log_probs = torch.tensor([[.7, .2, .1], [.3, .3, .4]], dtype=torch.float64).log()
        >>> scores, targets = binning_scores(log_probs, torch.tensor([0, 1]), "top-label")
        >>> scores.flatten().tolist(), targets.flatten().tolist()
        ([0.7, 0.4], [True, False])
    """
    scores, classes = binning_scores_and_classes(log_probs, kind, class_index)
    return scores, classes == labels.unsqueeze(1)


def binning_scores_and_classes(log_probs: Tensor, kind: Kind, class_index: int | None = None) -> tuple[Tensor, Tensor]:
    """Scores (N, C) float64 and, for each column, the class (N, C) int64 whose indicator is its
    target: the predicted class for ``"top-label"``, column k's class k for ``"classwise"``, the
    one class of ``"binary"`` and ``"class"``. The columns of a sample test distinct classes.

    Example:
        >>> log_probs = torch.tensor([[.7, .2, .1], [.3, .3, .4]], dtype=torch.float64).log()
        >>> binning_scores_and_classes(log_probs, "top-label")[1].flatten().tolist()
        [0, 2]
    """
    num_classes = log_probs.shape[1]
    if class_index is not None and kind != "class" and not (kind == "binary" and class_index == 1):
        raise ValueError(
            f'class_index is used only with kind="class" (one class against the rest), got class_index={class_index!r} '
            f'with kind={kind!r}: pass kind="class", or leave class_index out.'
        )
    if kind == "top-label":
        top, predicted = log_probs.max(dim=1, keepdim=True)  # first maximal class on ties
        return top.exp(), predicted
    if kind == "classwise":
        return log_probs.exp(), torch.arange(num_classes, device=log_probs.device).expand(log_probs.shape[0], -1)
    if kind == "binary":
        if num_classes != 2:
            raise ValueError(
                f'kind="binary" needs K = 2 classes, got K = {num_classes}; use kind="class" with class_index=j '
                f'for one class against the rest, or "classwise" for every class where the function takes it.'
            )
        class_index = 1
    elif kind == "class":
        if isinstance(class_index, bool) or not isinstance(class_index, numbers.Integral) or not 0 <= class_index < num_classes:
            raise ValueError(f'kind="class" needs an integer class_index in [0, {num_classes}), got {class_index!r}.')
        class_index = int(class_index)
    else:
        raise ValueError(f'kind must be "top-label", "binary", "class" or "classwise", got {kind!r}.')
    return log_probs[:, class_index : class_index + 1].exp(), torch.full_like(log_probs[:, :1], class_index, dtype=torch.int64)


def uniform_edges(n_bins: int) -> Tensor:
    """Equal-width bin edges ``k / M``, k = 0..M; (M + 1,) float64.

    Example:
        >>> uniform_edges(4)
        tensor([0.0000, 0.2500, 0.5000, 0.7500, 1.0000], dtype=torch.float64)
    """
    n_bins = check_n_bins(n_bins)
    return torch.arange(n_bins + 1, dtype=torch.float64) / n_bins


def quantile_edges(scores: Tensor, n_bins: int) -> Tensor:
    """Equal-mass bin edges of each column of ``scores: (N, C)``; (C, M + 1) float64.

    Interior edges are the k/M quantiles with linear interpolation between order statistics (the
    default rule of ``numpy.quantile``); the outer edges are 0 and 1.

    Example:
        >>> quantile_edges(torch.tensor([[0.1], [0.2], [0.4], [0.9]]), 2)
        tensor([[0.0000, 0.3000, 1.0000]], dtype=torch.float64)
    """
    n_bins = check_n_bins(n_bins)
    ordered = scores.to(torch.float64).T.contiguous().sort(dim=-1).values
    positions = _quantile_positions(torch.tensor([n_bins], device=scores.device), scores.shape[0])
    edges = _order_statistics(ordered, positions)
    edges[:, 0], edges[:, -1] = 0.0, 1.0
    return edges


def _quantile_positions(n_bins: Tensor, num_samples: int) -> Tensor:
    """Positions ``k (N - 1) / M`` in the sorted samples of the k/M quantiles, k = 0..max M, for
    bin counts ``n_bins: (...)``; (..., max M + 1) float64, held at N - 1 past each M."""
    k = torch.arange(int(n_bins.max()) + 1, dtype=torch.float64, device=n_bins.device)
    return (k * (num_samples - 1) / n_bins.unsqueeze(-1)).clamp_max(num_samples - 1)


def _order_statistics(ordered: Tensor, positions: Tensor) -> Tensor:
    """Sorted columns ``ordered: (C, N)`` read at fractional ``positions: (C or 1, ...)``, linearly
    interpolated between the neighbouring order statistics; (C, ...)."""
    lower, upper = positions.floor().long(), positions.ceil().long()
    fraction = positions - lower
    shape = (ordered.shape[0], *positions.shape[1:])

    def at(index: Tensor) -> Tensor:
        return ordered.gather(-1, index.expand(shape).reshape(shape[0], -1)).view(shape)

    below = at(lower)
    return below + fraction * (at(upper) - below)


def _raised(edges: Tensor, tolerance: float) -> Tensor:
    """Edges raised by the relative ``tolerance``: a score up to this much above an edge is on it."""
    return edges * (1 + tolerance)


def bin_indices(scores: Tensor, edges: Tensor, tolerance: float | None = None) -> Tensor:
    """Bin index in [0, M) of each score; ``scores: (N, C)``, ``edges: (M + 1,)`` or (C, M + 1).

    Right-closed bins, the first closed at 0 (``torch.bucketize(..., right=False)`` on the interior
    edges, raised by the relative ``tolerance``; by default ``edge_tolerance(scores.dtype)``, but
    scores computed in float64 from float32 logits need ``edge_tolerance(logits.dtype)``, and
    equal-mass edges taken from the scores themselves ``EDGE_TOLERANCE``: with float32 scores'
    tolerance, scores within 1e-6 above an edge that is one of them fall into its bin).

    Example:
        >>> bin_indices(torch.tensor([[0.0], [0.25], [0.2500001], [1.0]], dtype=torch.float64), uniform_edges(4))
        tensor([[0],
                [0],
                [1],
                [3]])
    """
    interior = _raised(edges[..., 1:-1], edge_tolerance(scores.dtype) if tolerance is None else tolerance)
    if interior.ndim == 1:
        return torch.bucketize(scores.contiguous(), interior, right=False)
    return torch.searchsorted(interior.contiguous(), scores.T.contiguous(), right=False).T


def uniform_bin_indices(scores: Tensor, n_bins: int, tolerance: float | None = None) -> Tensor:
    """``bin_indices(scores, uniform_edges(n_bins))``, by arithmetic instead of a binary search.

    The candidate ``ceil(M s / (1 + tolerance)) - 1`` can be one off within round-off of an
    edge, so it is checked against the edges themselves: the result is exactly that of
    ``bin_indices``, about ten times faster on the CPU (the streaming metrics' hot loop). Other
    devices use the binary search.

    Example:
        >>> uniform_bin_indices(torch.tensor([[0.0], [0.25], [0.2500001], [1.0]], dtype=torch.float64), 4)
        tensor([[0],
                [0],
                [1],
                [3]])
    """
    tolerance = edge_tolerance(scores.dtype) if tolerance is None else tolerance
    lower, upper = _uniform_bin_bounds(n_bins, scores.device, tolerance)
    if scores.device.type != "cpu":  # there the search is one cheap kernel, the arithmetic a dozen
        return torch.bucketize(scores.contiguous(), upper[:-1], right=False)
    flat = scores.reshape(-1)
    candidate = (flat * (n_bins / (1 + tolerance))).ceil_().sub_(1)
    index = candidate.nan_to_num_(nan=n_bins - 1).clamp_(0, n_bins - 1).long()  # NaN last, as bucketize
    step = (flat > upper.index_select(0, index)).long()
    step -= (flat <= lower.index_select(0, index)).long()
    return index.add_(step).view(scores.shape)


@lru_cache(maxsize=16)
def _uniform_bin_bounds(n_bins: int, device: torch.device, tolerance: float) -> tuple[Tensor, Tensor]:
    """Lower and upper bounds (M,) of ``uniform_bin_indices``' bins, as ``bin_indices`` draws them:
    bin m is ``(lower[m], upper[m]]``. Cached: building them costs as much as using them."""
    interior = _raised(uniform_edges(n_bins)[1:-1], tolerance).to(device)
    infinity = interior.new_full((1,), float("inf"))
    return torch.cat([-infinity, interior]), torch.cat([interior, infinity])


def bin_statistics(
    scores: Tensor, targets: Tensor, edges: Tensor | int, tolerance: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin ``counts``, ``score_sums`` and ``target_sums`` of each column, each (C, M) float64.

    ``scores: (N, C)`` in [0, 1], ``targets: (N, C)`` bool, ``edges: (M + 1,)`` or (C, M + 1),
    or the number M of equal-width bins (``uniform_edges(M)``, located by ``uniform_bin_indices``);
    ``tolerance`` as in :func:`bin_indices`.

    Example:
        >>> scores = torch.tensor([[0.2], [0.4], [0.9]], dtype=torch.float64)
        >>> counts, score_sums, target_sums = bin_statistics(scores, torch.tensor([[True], [False], [True]]), uniform_edges(2))
        >>> counts, score_sums, target_sums
        (tensor([[2., 1.]], dtype=torch.float64), tensor([[0.6000, 0.9000]], dtype=torch.float64), tensor([[1., 1.]], dtype=torch.float64))
    """
    if isinstance(edges, int):
        n_bins, index = edges, uniform_bin_indices(scores, edges, tolerance)
    else:
        n_bins, index = edges.shape[-1] - 1, bin_indices(scores, edges, tolerance)
    num_columns = scores.shape[1]
    sums = sums_by_key(_bin_keys(index, n_bins), scores, targets, num_columns * n_bins)
    return tuple(x.reshape(num_columns, n_bins) for x in sums)


def _bin_keys(index: Tensor, n_bins: int) -> Tensor:
    """``column * M + bin`` for bin indices (N, C): one key per (column, bin)."""
    return index + n_bins * torch.arange(index.shape[1], device=index.device)


def sums_by_key(keys: Tensor, scores: Tensor, targets: Tensor, num_keys: int) -> Tensor:
    """Counts and sums of ``scores`` and ``targets`` (N, C) per key in [0, num_keys): (3, num_keys)."""
    flat = keys.flatten()
    # index_add_ rather than bincount, which reads the largest index back to the host on a GPU
    sums = torch.zeros(3, num_keys, dtype=torch.float64, device=keys.device)
    for row, values in zip(sums, (torch.ones_like(flat, dtype=torch.float64), scores.flatten(), targets.flatten())):
        row.index_add_(0, flat, values.to(torch.float64))
    return sums


class SortedColumns(NamedTuple):
    """Columns of scores sorted once, with the running sums of their targets and scores: the
    equal-mass bins of any number M read off them in O(M log N) per column
    (:func:`equal_mass_statistics`) instead of a sort and a pass over the samples per M."""

    scores: Tensor  # (C, N) float64, each row ascending
    target_prefix: Tensor  # (C, N + 1) float64: sum of the first n sorted targets at n
    score_prefix: Tensor  # (C, N + 1) float64: sum of the first n sorted scores at n


def sort_columns(scores: Tensor, targets: Tensor) -> SortedColumns:
    """Sort each column of ``scores: (N, C)`` with its ``targets: (N, C)`` (bool or 0/1).

    Example:
        >>> columns = sort_columns(torch.tensor([[0.9], [0.2], [0.4]], dtype=torch.float64), torch.tensor([[True], [False], [True]]))
        >>> columns.scores.tolist(), columns.target_prefix.tolist()
        ([[0.2, 0.4, 0.9]], [[0.0, 0.0, 1.0, 2.0]])
    """
    ordered, order = scores.to(torch.float64).T.contiguous().sort(dim=-1)
    sorted_targets = targets.T.contiguous().gather(-1, order).to(torch.float64)
    return SortedColumns(ordered, _prefix_sums(sorted_targets), _prefix_sums(ordered))


def _prefix_sums(values: Tensor) -> Tensor:
    """Sums (..., N + 1) of the first n of ``values: (..., N)``, n = 0..N."""
    prefix = values.new_zeros(*values.shape[:-1], values.shape[-1] + 1)
    torch.cumsum(values, -1, out=prefix[..., 1:])
    return prefix


def equal_mass_statistics(
    columns: SortedColumns, n_bins: Tensor, tolerance: float = EDGE_TOLERANCE
) -> tuple[Tensor, Tensor, Tensor]:
    """``bin_statistics(scores, targets, quantile_edges(scores, M), tolerance)`` for several M at
    once, read from the sorted columns: equal to it up to the round-off of the running score sums.

    ``n_bins``: bin counts (B,) for every column, or (C, B) for each column its own. Returns
    ``counts``, ``score_sums`` and ``target_sums``, each (C, B, max M); a split into fewer bins
    than the largest is padded with empty bins.

    Example (the four scores of ``quantile_edges``' example in one and in two bins):
        >>> columns = sort_columns(torch.tensor([[0.1], [0.2], [0.4], [0.9]]), torch.tensor([[False], [True], [False], [True]]))
        >>> counts, _, target_sums = equal_mass_statistics(columns, torch.tensor([1, 2]))
        >>> counts.tolist(), target_sums.tolist()
        ([[[4.0, 0.0], [2.0, 2.0]]], [[[2.0, 0.0], [1.0, 1.0]]])
    """
    cuts = _equal_mass_cuts(columns.scores, n_bins, tolerance)
    counts = cuts.diff(dim=-1).to(torch.float64)
    return counts, _sums_between(columns.score_prefix, cuts), _sums_between(columns.target_prefix, cuts)


def _equal_mass_cuts(ordered: Tensor, n_bins: Tensor, tolerance: float) -> Tensor:
    """Where the equal-mass bins split the sorted columns ``ordered: (C, N)``, for bin counts
    ``n_bins: (B,)`` or (C, B); (C, B, max M + 1) int64. Bin m of an M-bin split holds the sorted
    samples ``cut[m]`` to ``cut[m + 1] - 1``: ``cut[0] = 0``, ``cut[m] = N`` for m >= M, and in
    between the number of scores at or below the raised edge, where ``bin_indices`` puts them."""
    num_columns, num_samples = ordered.shape
    positions = _quantile_positions(n_bins if n_bins.ndim == 2 else n_bins.unsqueeze(0), num_samples)
    edges = _raised(_order_statistics(ordered, positions), tolerance)
    cuts = torch.searchsorted(ordered, edges.view(num_columns, -1), right=True).view(edges.shape)
    k = torch.arange(positions.shape[-1], device=ordered.device)
    outer = torch.where(k == 0, 0, num_samples)
    return torch.where((k > 0) & (k < n_bins.unsqueeze(-1)), cuts, outer)


def _sums_between(prefix: Tensor, cuts: Tensor) -> Tensor:
    """Sums (C, ..., P - 1) of the sorted values between consecutive ``cuts: (C, ..., P)``, from
    their running sums ``prefix: (C, N + 1)``."""
    return prefix.gather(-1, cuts.view(cuts.shape[0], -1)).view(cuts.shape).diff(dim=-1)


class BinDecomposition(NamedTuple):
    """A binned calibration error written as ``reduce(counts, score_sums, target_sums)`` of the
    per-bin sums, where each sample adds 1, its score and its target to the bin ``keys`` names.

    With equal-width bins a sample's bin does not depend on the others, so the bootstrap sums the
    keys of each resample directly (equal-mass edges move with the sample and cannot do this).
    """

    keys: Tensor  # (N, C) int64: column * M + bin
    scores: Tensor  # (N, C) float64
    targets: Tensor  # (N, C) bool
    shape: tuple[int, int]  # (C, M)
    reduce: Callable[[Tensor, Tensor, Tensor], Tensor]  # three (..., C, M) sums -> (...)
    #: (N, C) int64: the class whose indicator each column's target is (``targets`` is ``classes ==
    #: labels``): one column, or column k for class k (C = K), so other labels need no new terms
    classes: Tensor

    def evaluate(self) -> Tensor:
        sums = sums_by_key(self.keys, self.scores, self.targets, self.shape[0] * self.shape[1])
        return self.reduce(*sums.reshape(3, *self.shape))


def _column_reduction(kind: str, reduction: Reduction) -> Reduction:
    """``reduction`` for ``"classwise"``; the other kinds have one column and a scalar result
    (any valid ``reduction`` is accepted for them, as it changes nothing)."""
    if reduction not in get_args(Reduction):
        raise ValueError(f"reduction must be one of {get_args(Reduction)}, got {reduction!r}.")
    return reduction if kind == "classwise" else "mean"


def calibration_error_terms(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Literal["uniform"] = "uniform",
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    norm: Norm = "l1",
    reduction: Reduction = "mean",
) -> BinDecomposition:
    """Validate the inputs of ``expected_calibration_error`` with equal-width bins and return its
    ``BinDecomposition``. ``strategy`` must be ``"uniform"``: equal-mass bins have none.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> terms = calibration_error_terms(probs.log(), torch.tensor([0, 1, 1, 0]), n_bins=10)
        >>> terms.keys.flatten().tolist(), round(float(terms.evaluate()), 6)
        ([8, 7, 5, 6], 0.5)
    """
    if strategy != "uniform":
        raise ValueError(
            f'only strategy="uniform" has a BinDecomposition (equal-mass edges depend on the whole '
            f"sample), got {strategy!r}."
        )
    check_calibration_error_kind(kind)
    logits, labels = check_logits_and_labels(logits, labels)
    scores, classes = binning_scores_and_classes(to_log_probs(logits.detach()), kind)
    edges = uniform_edges(n_bins).to(scores.device)
    return BinDecomposition(
        _bin_keys(bin_indices(scores, edges, edge_tolerance(logits.dtype)), n_bins),
        scores,
        classes == labels.unsqueeze(1),
        (scores.shape[1], n_bins),
        _calibration_error_reduction(kind, norm, reduction),
        classes,
    )


def _calibration_error_reduction(kind: str, norm: Norm, reduction: Reduction) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``expected_calibration_error``'s function of the per-bin sums, for its options."""
    return partial(calibration_error_from_bins, norm=norm, reduction=_column_reduction(kind, reduction))


def calibration_error_from_bins(
    counts: Tensor,
    score_sums: Tensor,
    target_sums: Tensor,
    norm: Norm = "l1",
    reduction: Reduction = "mean",
) -> Tensor:
    """Calibration error from per-bin statistics (C, M), reduced over the C columns to a scalar.

    Per column, with ``gap_m = |target_sums_m - score_sums_m| / counts_m`` over non-empty bins:
    ``l1`` is ``sum_m (counts_m / N) gap_m`` (ECE), ``l2`` is ``sqrt(sum_m (counts_m / N) gap_m^2)``
    (RMS calibration error), ``max`` is ``max_m gap_m`` (MCE). ``reduction`` combines the columns,
    or ``"none"`` keeps them: (C,).

    Example (bins of 2 and 1 samples with gaps 0.2 and 0.1):
        >>> counts, score_sums, target_sums = torch.tensor([[2., 1.]]), torch.tensor([[.6, .9]]), torch.tensor([[1., 1.]])
        >>> [round(float(calibration_error_from_bins(counts, score_sums, target_sums, norm)), 6) for norm in ("l1", "max")]
        [0.166667, 0.2]
    """
    n = counts.sum(-1)
    gap = (target_sums - score_sums).abs() / counts.clamp_min(1)
    if norm == "l1":
        per_column = (target_sums - score_sums).abs().sum(-1) / n
    elif norm == "l2":
        per_column = ((counts / n.unsqueeze(-1)) * gap**2).sum(-1).sqrt()
    elif norm == "max":
        per_column = torch.where(counts > 0, gap, torch.zeros_like(gap)).amax(-1)
    else:
        raise ValueError(f'norm must be "l1", "l2" or "max", got {norm!r}.')
    if reduction == "mean":
        return per_column.mean(-1)
    if reduction == "sum":
        return per_column.sum(-1)
    if reduction == "max":
        return per_column.amax(-1)
    if reduction == "none":
        return per_column
    raise ValueError(f'reduction must be "mean", "sum", "max" or "none", got {reduction!r}.')


def check_calibration_error_kind(kind: str) -> None:
    if kind not in CALIBRATION_ERROR_KINDS:
        raise ValueError(f'kind must be "top-label", "binary" or "classwise", got {kind!r}.')


def check_n_bins(n_bins: int, name: str = "n_bins") -> int:
    """``n_bins`` as an int (NumPy's integers too), or ``ValueError`` unless it is a positive
    integer; ``name``: the caller's parameter."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, numbers.Integral) or n_bins < 1:
        raise ValueError(f"{name} must be a positive integer, got {n_bins!r}.")
    return int(n_bins)


def _edges(scores: Tensor, n_bins: int, strategy: Strategy) -> Tensor:
    if strategy == "uniform":
        return uniform_edges(n_bins).to(scores.device)
    if strategy == "quantile":
        return quantile_edges(scores, n_bins)
    raise ValueError(f'strategy must be "uniform" or "quantile", got {strategy!r}.')


class BinnedScores(NamedTuple):
    """The validated inputs of a binned statistic (``binned_scores``)."""

    log_probs: Tensor  # (N, K) float64 normalised log-posteriors
    labels: Tensor  # (N,) int64
    scores: Tensor  # (N, C) float64 binning scores
    targets: Tensor  # (N, C) bool
    edges: Tensor  # (M + 1,) or (C, M + 1)
    tolerance: float  # for bin_indices / bin_statistics with these edges


def binned_scores(
    logits: Tensor, labels: Tensor, n_bins: int, strategy: Strategy, kind: Kind, class_index: int | None = None,
    allowed: Sequence[str] = CALIBRATION_ERROR_KINDS,
) -> BinnedScores:
    """Validate, then return log-posteriors, labels, binning scores and targets, the edges, and
    their tolerance: that of the logits' precision for the fixed equal-width edges (the scores are
    float64 whatever it is), ``EDGE_TOLERANCE`` for equal-mass edges taken from the scores.
    ``allowed``: the caller's kinds, which a message about ``kind="binary"`` offers instead.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.4, .6]], dtype=torch.float64)
        >>> binned = binned_scores(probs.log(), torch.tensor([0, 0]), 2, "uniform", "binary")
        >>> binned.scores.flatten().round(decimals=6).tolist(), binned.edges.tolist()
        ([0.1, 0.6], [0.0, 0.5, 1.0])
    """
    logits, labels = check_logits_and_labels(logits, labels)
    check_binary_kind(kind, logits.shape[1], allowed)
    log_probs = to_log_probs(logits.detach())  # binned errors are counts and sums, not differentiable
    scores, targets = binning_scores(log_probs, labels, kind, class_index)
    edges = _edges(scores, n_bins, strategy)
    tolerance = edge_tolerance(logits.dtype) if strategy == "uniform" else EDGE_TOLERANCE
    return BinnedScores(log_probs, labels, scores, targets, edges, tolerance)


def reliability_bins(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary", "class"] = "top-label",
    class_index: int | None = None,
) -> ReliabilityBins:
    """Per-bin counts, mean scores and frequencies for a reliability diagram.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width) or ``"quantile"`` (equal mass); see the module notes.
        kind: ``"top-label"`` (confidence vs accuracy), ``"binary"`` (class 1 of K = 2) or
            ``"class"`` (``q_j`` vs ``[y == j]`` for ``class_index`` j).
        class_index: the class j for ``kind="class"``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> bins = reliability_bins(probs.log(), torch.tensor([0, 1, 1, 0]), n_bins=2)
        >>> bins.counts, bins.frequency
        (tensor([0., 4.], dtype=torch.float64), tensor([0.0000, 0.5000], dtype=torch.float64))
    """
    if kind == "classwise":
        raise ValueError('reliability_bins describes one binary problem: use kind="class" with a class_index.')
    _, _, scores, targets, edges, tolerance = binned_scores(logits, labels, n_bins, strategy, kind, class_index,
                                                            ("top-label", "binary", "class"))
    counts, score_sums, target_sums = (x[0] for x in bin_statistics(scores, targets, edges, tolerance))
    return reliability_bins_from_sums(edges.reshape(-1, n_bins + 1)[0], counts, score_sums, target_sums)


def reliability_bins_from_sums(edges: Tensor, counts: Tensor, score_sums: Tensor, target_sums: Tensor) -> ReliabilityBins:
    """``ReliabilityBins`` from the per-bin sums (M,) of ``bin_statistics``.

    Example:
        >>> bins = reliability_bins_from_sums(uniform_edges(2), torch.tensor([0., 4.]), torch.tensor([0., 3.]), torch.tensor([0., 2.]))
        >>> bins.mean_score, bins.frequency
        (tensor([0.0000, 0.7500]), tensor([0.0000, 0.5000]))
    """
    denominator = counts.clamp_min(1)
    return ReliabilityBins(edges, counts, score_sums / denominator, target_sums / denominator)


def expected_calibration_error(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    norm: Norm = "l1",
    reduction: Reduction = "mean",
) -> Tensor:
    """Binned calibration error: ECE (``norm="l1"``), RMS calibration error (``"l2"``), MCE (``"max"``).

    ``kind="top-label"`` is the confidence ECE of Guo et al.; ``"binary"`` bins ``q_1`` for K = 2;
    ``"classwise"`` computes the class-j ECE of every class and combines them with ``reduction``:
    ``"mean"`` (the survey's classwise-ECE), ``"sum"`` (Kull et al. 2019's tables) or ``"max"``
    (``norm="max", reduction="max"`` is the survey's classwise-MCE).

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width) or ``"quantile"`` (equal mass); see the module notes.
        kind: ``"top-label"``, ``"binary"`` or ``"classwise"``.
        norm: ``"l1"``, ``"l2"`` or ``"max"``.
        reduction: how ``"classwise"`` combines classes (``"none"``: the (K,) per-class values);
            ignored otherwise.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> labels = torch.tensor([0, 1, 1, 0])
        >>> round(float(expected_calibration_error(probs.log(), labels, n_bins=10)), 6)
        0.5
        >>> round(float(expected_calibration_error(probs.log(), labels, n_bins=10, norm="max")), 6)
        0.8
    """
    return calibration_error_columns(logits, labels, n_bins, strategy, kind, norm, reduction).evaluate()


class ColumnDecomposition(NamedTuple):
    """A metric written as ``of_rows(scores, targets)`` of the columns of its binary problems,
    where row i of ``scores`` and ``targets`` (N, C) depends on sample i alone: the metric on a
    resample of the samples is ``of_rows`` of the same rows of the columns.

    The bootstrap resamples these rows instead of recomputing them from the (N, K) logits in every
    replicate; ``of_rows`` recomputes whatever depends on the whole sample (equal-mass edges, the
    monotonic sweep's bin count, the smooth ECE's bandwidth).
    """

    scores: Tensor  # (N, C) float64
    targets: Tensor  # (N, C) bool or float64 0/1
    of_rows: Callable[[Tensor, Tensor], Tensor]  # rows (n, C) of both -> the metric on them

    def evaluate(self) -> Tensor:
        return self.of_rows(self.scores, self.targets)


def binned_error_columns(
    binned: BinnedScores, strategy: Strategy, from_bins: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> ColumnDecomposition:
    """The binned error ``from_bins(counts, score_sums, target_sums)`` of the columns of ``binned``
    (from ``binned_scores(..., strategy, ...)``) as a ``ColumnDecomposition``: rows other than the
    columns themselves get bins of ``strategy`` drawn from them (equal-mass edges move with a
    resample), with the tolerance of ``binned``.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> binned = binned_scores(probs.log(), torch.tensor([0, 1, 1, 0]), 2, "quantile", "top-label")
        >>> columns = binned_error_columns(binned, "quantile", calibration_error_from_bins)
        >>> round(float(columns.evaluate()), 6), round(float(columns.of_rows(columns.scores[:2], columns.targets[:2])), 6)
        (0.25, 0.45)
    """
    n_bins = binned.edges.shape[-1] - 1

    def of_rows(scores: Tensor, targets: Tensor) -> Tensor:
        # the columns themselves keep the edges binned_scores drew from them (no second sort)
        edges = binned.edges if scores is binned.scores else _edges(scores, n_bins, strategy)
        return from_bins(*bin_statistics(scores, targets, edges, binned.tolerance))

    return ColumnDecomposition(binned.scores, binned.targets, of_rows)


def calibration_error_columns(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary", "classwise"] = "top-label",
    norm: Norm = "l1",
    reduction: Reduction = "mean",
) -> ColumnDecomposition:
    """Validate the inputs of ``expected_calibration_error`` and return its ``ColumnDecomposition``
    (which it evaluates): the bootstrap's way to equal-mass ECE, whose edges move with a resample.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> columns = calibration_error_columns(probs.log(), torch.tensor([0, 1, 1, 0]), 2, "quantile")
        >>> columns.scores.shape, round(float(columns.evaluate()), 6)
        (torch.Size([4, 1]), 0.25)
    """
    check_calibration_error_kind(kind)
    binned = binned_scores(logits, labels, n_bins, strategy, kind)
    return binned_error_columns(binned, strategy, _calibration_error_reduction(kind, norm, reduction))


def signed_calibration_error(
    logits: Tensor, labels: Tensor, kind: Literal["top-label", "binary"] = "top-label"
) -> Tensor:
    """Expected signed calibration error (ESCE): ``sum_m (|B_m| / N) (frequency_m - mean_score_m)``.

    The bin weights cancel the bin sizes, so ESCE does not depend on the binning: it equals the
    mean target minus the mean score. Per-bin signed gaps are ``frequency - mean_score`` of
    ``reliability_bins``.

    Sign convention. ``kind="top-label"`` (default): accuracy minus mean confidence, so a negative
    value means over-confident, a positive one under-confident. ``kind="binary"`` (K = 2, the form
    of Sumler et al.): fraction of positives minus mean ``q_1``; its sign says whether the positive
    class is under- or over-predicted, not whether the model is over-confident: over-confidence
    gives positive gaps in the low bins and negative gaps in the high bins, which cancel.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> round(float(signed_calibration_error(probs.log(), torch.tensor([0, 1, 1, 0]))), 6)
        -0.25
    """
    scores, targets = binary_problems(logits, labels, kind)
    return targets.mean() - scores.mean()


def ecd_per_sample(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Per-sample ECD ``-log q_y - H(q)`` (N,) from normalised log-posteriors ``log_probs: (N, K)``.

    ``H(q) = -sum_k q_k log q_k`` uses the log-probabilities directly: they are finite for finite
    logits, so a probability that underflows to 0 contributes exactly 0 and ``q_y = 1`` gives 0.

    Example (Sumler et al.: 0.9 on the true class gives -0.219722):
        >>> ecd_per_sample(torch.tensor([[0.1, 0.9], [1.0, 0.0]], dtype=torch.float64).log().clamp_min(-1e4), torch.tensor([1, 0]))
        tensor([-0.2197,  0.0000], dtype=torch.float64)
    """
    entropy = -(log_probs.exp() * log_probs).sum(dim=1)
    return -log_probs.gather(1, labels.unsqueeze(1)).squeeze(1) - entropy


def entropic_calibration_difference(
    logits: Tensor,
    labels: Tensor,
    n_bins: int | None = None,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary"] = "top-label",
) -> Tensor:
    """Entropic calibration difference (Sumler et al. 2025): mean NLL minus mean predictive entropy.

    ECD > 0 means over-confident, ECD < 0 under-confident; it is 0 for a calibrated model in
    expectation, but also for uniform predictions, so |ECD| near 0 means "safe", not "calibrated".
    It is a signed diagnostic, not a proper scoring rule: do not minimise it. Natural log.
    It is at least ``-log K``; for K = 2 its minimum is -0.278465 (true-class probability 0.782188).

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        n_bins: if given, return the mean ECD of each of ``n_bins`` bins (0 for empty bins),
            binned like ``reliability_bins(..., n_bins, strategy, kind)``; (n_bins,).
        strategy: binning strategy when ``n_bins`` is given.
        kind: which score is binned: ``"top-label"`` confidence or ``"binary"`` ``q_1`` (K = 2).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.1, .9], [.5, .5]])
        >>> round(float(entropic_calibration_difference(probs.log(), torch.tensor([1, 0]))), 6)
        -0.109861
    """
    if kind not in ("top-label", "binary"):
        raise ValueError(f'kind must be "top-label" or "binary", got {kind!r}.')
    if n_bins is None:
        logits, labels = check_logits_and_labels(logits, labels)
        check_binary_kind(kind, logits.shape[1], ("top-label", "binary"))  # (unbinned, kind changes nothing: refused alike)
        return ecd_per_sample(to_log_probs(logits), labels).mean()
    log_probs, labels, scores, _, edges, tolerance = binned_scores(logits, labels, n_bins, strategy, kind,
                                                                   allowed=("top-label", "binary"))
    index = bin_indices(scores, edges, tolerance).squeeze(1)
    sums = torch.bincount(index, weights=ecd_per_sample(log_probs, labels), minlength=n_bins)
    return sums / torch.bincount(index, minlength=n_bins).clamp_min(1)
