"""Smooth ECE and the smoothed reliability curve (Błasiok & Nakkiran 2023).

For one binary problem with scores ``f`` in [0, 1] and 0/1 targets ``y``, the smooth ECE at
bandwidth sigma is ``sum_t |r(t)| d(t) / sum_t d(t)`` over a mesh t of [0, 1], where ``d`` is the
kernel density of the scores and ``r`` the kernel regression of the residuals ``f - y`` on them,
with a Gaussian kernel reflected at 0 and 1. The automatic bandwidth is the fixed point
``sigma = smECE(sigma)`` found by bisection. ``smooth_calibration_error`` computes it (named like
``expected_calibration_error`` and its class ``metrics.SmoothCalibrationError``; ``smooth_ece`` is
an alias).

The computation follows the ``relplot`` package step by step, so that the two agree to round-off:
each sample's weight is split linearly between the two nearest points of a grid of G points on
[0, 1] ("rounding to the grid"), the grid is convolved with the reflected kernel (here by FFT),
and the result is interpolated linearly onto the mesh. relplot picks
``G = max(2000, round(20 / sigma)) // 2 + 1`` (1001 for sigma >= 0.01) and adds 1e-4 to the
density. Because the grid sums are sums over samples, they accumulate batch by batch and across
processes (``torchcal.metrics.SmoothCalibrationError``), on a fixed grid of ``grid_points``.

The value depends on G beyond round-off: the reflected kernel counts the share of a score rounded
onto the end point 1 (or 0) once, as relplot's does, where a score just inside counts nearly
twice (itself and its mirror image). On scores with many confidences near 1 a larger G moves the
value by several % and away from relplot's (top-label smECE of a CIFAR-100 ResNet-20: 0.1082,
0.1059, 0.1044 at G = 1001, 4001, 16001; relplot 0.1082). Without ``grid_points`` the result is
relplot's to round-off (1e-16, top-label and classwise, on CIFAR-10/100, SST-2, AG News and
FVCAUS scores).

The C binary problems of ``"classwise"`` are computed together: the grids of all columns are
smoothed in batches, and the fixed-point searches run side by side, each column with its own
bracket, one batch per distinct bandwidth tried in a step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import check_count
from torchcal.functional.bootstrap import resample_indices
from torchcal.functional.diagnostics import COLUMN_CHUNK_ELEMENTS, ColumnDecomposition, binary_problems

__all__ = [
    "SmoothReliabilityCurve",
    "grid_points_for_bandwidth",
    "round_to_grid",
    "smooth_calibration_error",
    "smooth_calibration_error_columns",
    "smooth_ece",
    "smooth_ece_bandwidth",
    "smooth_ece_from_grid",
    "smooth_ece_from_grids",
    "smooth_reliability_curve",
]

#: Added to the smoothed density before dividing by it (relplot's ``eps``).
DENSITY_FLOOR = 1e-4
#: Bandwidths below this stop the bisection (relplot's ``eps``).
MIN_BANDWIDTH = 1e-3
#: Halvings of the bandwidth interval in the fixed-point search (relplot's ``refine``).
BISECTION_STEPS = 10
#: The most points a grid or mesh may have (``grid_points``, ``mesh_points``): a million intervals,
#: 8 MB per float64 row; a larger one runs for minutes and may not fit in memory.
MAX_GRID_POINTS = 1_000_001
#: The smallest bandwidth accepted: relplot's grid for it, ``max(2000, round(20 / sigma)) // 2 + 1``,
#: and the mesh the smECE is integrated on, ``round(10 / sigma)``, reach :data:`MAX_GRID_POINTS`.
SMALLEST_BANDWIDTH = 1e-5


def check_bandwidth(bandwidth: Any) -> float:
    """``bandwidth`` as a float (a number, NumPy's or a one-element tensor, such as
    :func:`smooth_ece_bandwidth` returns), or ``ValueError`` unless it lies in
    [:data:`SMALLEST_BANDWIDTH`, 1]."""
    if isinstance(bandwidth, (torch.Tensor, np.ndarray)):
        if math.prod(bandwidth.shape) != 1:
            raise ValueError(f"bandwidth must be one number, got {tuple(bandwidth.shape)} of them; for one bandwidth per "
                             f"column (kind='classwise'), pass bandwidth=None (each column's automatic one).")
        bandwidth = bandwidth.item()
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, numbers.Real) or not SMALLEST_BANDWIDTH <= float(bandwidth) <= 1:
        raise ValueError(
            f"bandwidth must lie in [{SMALLEST_BANDWIDTH:g}, 1], got {bandwidth!r}: a smaller one needs a grid of "
            f"about 10 / bandwidth points, more than the {MAX_GRID_POINTS:,} allowed. Pass bandwidth=None for the "
            f"automatic (fixed-point) bandwidth."
        )
    return float(bandwidth)


def check_grid_points(points: int, name: str = "grid_points", minimum: int = 3) -> None:
    """``ValueError`` unless ``points`` is an integer in [``minimum``, :data:`MAX_GRID_POINTS`]."""
    check_count(points, name, minimum)
    if points > MAX_GRID_POINTS:
        raise ValueError(
            f"{name} must be at most {MAX_GRID_POINTS:,} (a grid of {SMALLEST_BANDWIDTH:g} per step, "
            f"finer than any bandwidth accepted needs), got {points:,}."
        )

SmoothKind = Literal["top-label", "binary", "classwise"]
#: ``(G, columns) -> (c, 2, G)``: the grid sums of ones and residuals of some columns (c,) on G points.
GridSums = Callable[[int, Tensor], Tensor]
#: ``(columns, sigma) -> (c,)``: the smECE of some columns (c,) at one bandwidth.
SmoothEceAt = Callable[[Tensor, float], Tensor]


class SmoothReliabilityCurve(NamedTuple):
    """The kernel-smoothed reliability curve of one binary problem on a mesh of [0, 1].

    ``frequency`` is the smoothed fraction of positives at each mesh point, ``density`` the
    smoothed score density (up to a constant), and ``lower``/``upper`` the percentile band of the
    bootstrap replicates of ``frequency`` (all (T,)).
    """

    mesh: Tensor
    frequency: Tensor
    density: Tensor
    lower: Tensor
    upper: Tensor
    bandwidth: Tensor
    smooth_ece: Tensor


def grid_points_for_bandwidth(bandwidth: float) -> int:
    """relplot's grid size for a bandwidth: ``max(2000, round(20 / sigma)) // 2 + 1``.

    Example:
        >>> grid_points_for_bandwidth(0.05), grid_points_for_bandwidth(0.002)
        (1001, 5001)
    """
    return max(2000, round(20 / bandwidth)) // 2 + 1


def round_to_grid(scores: Tensor, weights: Tensor, grid_points: int) -> Tensor:
    """Split each weight between the two grid points around its score; sums (..., G) float64.

    ``scores: (N,)`` in [0, 1], ``weights: (..., N)``. The grid is ``linspace(0, 1, G)``.

    Example:
        >>> round_to_grid(torch.tensor([0.25, 1.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64), 3)
        tensor([0.5000, 0.5000, 1.0000], dtype=torch.float64)
    """
    position = scores.to(torch.float64) * (grid_points - 1)
    lower = position.floor().clamp_(0, grid_points - 2)
    fraction = position - lower
    index = lower.long()
    weights = weights.to(torch.float64)
    sums = weights.new_zeros(*weights.shape[:-1], grid_points)
    index = index.expand_as(weights)
    sums.scatter_add_(-1, index, weights * (1 - fraction))
    sums.scatter_add_(-1, index + 1, weights * fraction)
    return sums


def _reflected_gaussian_smooth(values: Tensor, bandwidth: float) -> Tensor:
    """Convolve grid sums (..., G) with a Gaussian reflected at both ends of [0, 1] (relplot's
    ``ReflectedGaussianKernel.convolve``: kernel values at the grid offsets, not normalised)."""
    g = values.shape[-1]
    offsets = torch.linspace(0, 1, g, dtype=torch.float64, device=values.device) - 0.5
    kernel = torch.exp(-offsets * offsets / (2 * bandwidth**2)) / (math.sqrt(2 * math.pi) * bandwidth)
    extended = torch.cat([values.flip(-1)[..., :-1], values, values.flip(-1)[..., 1:]], dim=-1)
    # A circular convolution of any length >= len(extended) = 3g - 2 equals the linear one from
    # index g - 1 on (overlap-save), which holds the part kept; a length made of the factors 2, 3
    # and 5 has an FFT 5 to 20 times faster than that of the odd 4g - 3 of the full convolution.
    size = _fast_fft_length(extended.shape[-1])
    full = torch.fft.irfft(torch.fft.rfft(extended, size) * torch.fft.rfft(kernel, size), size)
    start = g - 1 + g // 2  # numpy.convolve's "valid" part starts at g - 1
    return full[..., start : start + g]


@lru_cache(maxsize=64)
def _fast_fft_length(n: int) -> int:
    """The smallest length >= n whose only prime factors are 2, 3 and 5."""
    best = 1 << (n - 1).bit_length()
    power_of_5 = 1
    while power_of_5 < best:
        odd = power_of_5
        while odd < best:
            best = min(best, odd << (-(-n // odd) - 1).bit_length())  # odd times the power of 2 that reaches n
            odd *= 3
        power_of_5 *= 5
    return best


def _interpolate(mesh: Tensor, values: Tensor) -> Tensor:
    """Piecewise-linear interpolation of grid values (..., G) on ``linspace(0, 1, G)`` at ``mesh``."""
    g = values.shape[-1]
    index = (mesh * (g - 1)).floor().long().clamp(0, g - 2)
    fraction = mesh * (g - 1) - index
    return values[..., index] * (1 - fraction) + values[..., index + 1] * fraction


def _mesh_points(bandwidth: float) -> int:
    return max(round(10 / bandwidth), 200)


def _mesh(bandwidth: float, device: torch.device) -> Tensor:
    return torch.linspace(0, 1, _mesh_points(bandwidth), dtype=torch.float64, device=device)


def _smooth_ece_at(grid: Tensor, bandwidth: float) -> Tensor:
    """smECE at one bandwidth from grid sums (..., 2, G) of ones and residuals ``f - y``; (...)."""
    mesh = _mesh(bandwidth, grid.device)
    smoothed = _interpolate(mesh, _reflected_gaussian_smooth(grid, bandwidth))
    density = smoothed[..., 0, :] + DENSITY_FLOOR
    return (smoothed[..., 1, :] / density).abs().mul(density).sum(-1) / density.sum(-1)


def smooth_ece_from_grid(
    grid_sums: Callable[[int], Tensor] | Tensor, bandwidth: float | None = None
) -> tuple[Tensor, float]:
    """smECE of one binary problem and its bandwidth, from grid sums of ones and residuals.

    Args:
        grid_sums: a (2, G) tensor (rows: ones and ``f - y`` rounded to a grid of G points), or a
            function ``G -> (2, G)`` for relplot's bandwidth-dependent grid size.
        bandwidth: the kernel bandwidth; None finds relplot's fixed point ``sigma = smECE(sigma)``
            by bisection on [0, 1] (one read-back to the host per step).

    Example:
        >>> scores = torch.tensor([0.2, 0.7, 0.9], dtype=torch.float64)
        >>> grid = round_to_grid(scores, torch.stack([torch.ones(3), scores - torch.tensor([0., 1., 1.])]), 1001)
        >>> value, sigma = smooth_ece_from_grid(grid)
        >>> round(float(value), 4), sigma
        (0.1753, 0.17578125)
    """
    if isinstance(grid_sums, Tensor):
        values, bandwidths = smooth_ece_from_grids(grid_sums.unsqueeze(0), bandwidth)
    else:
        values, bandwidths = _smooth_ece_columns(lambda points, _: grid_sums(points).unsqueeze(0), 1, bandwidth, None)
    return values[0], float(bandwidths[0])


def smooth_ece_from_grids(grid_sums: Tensor, bandwidth: float | None = None) -> tuple[Tensor, Tensor]:
    """smECE (C,) and bandwidths (C,) of C binary problems from their grid sums (C, 2, G).

    As ``smooth_ece_from_grid`` for each problem, computed together: with ``bandwidth=None`` each
    problem's fixed point is searched for separately, all problems in one batch per step and
    distinct bandwidth.

    Example (the problem of ``smooth_ece_from_grid``'s example, and its mirror image):
        >>> scores = torch.tensor([[0.2, 0.7, 0.9], [0.8, 0.3, 0.1]], dtype=torch.float64)
        >>> residuals = scores - torch.tensor([[0., 1., 1.], [1., 0., 0.]])
        >>> grids = round_to_grid(scores, torch.stack([torch.ones(2, 3), residuals]), 1001).transpose(0, 1)
        >>> values, sigmas = smooth_ece_from_grids(grids)
        >>> values.round(decimals=4).tolist(), sigmas.tolist()
        ([0.1753, 0.1753], [0.17578125, 0.17578125])
    """
    num_columns, _, grid_points = grid_sums.shape
    return _smooth_ece_columns(lambda _, columns: grid_sums[columns], num_columns, bandwidth, grid_points)


def _smooth_ece_columns(
    grids: GridSums, num_columns: int, bandwidth: float | None, grid_points: int | None
) -> tuple[Tensor, Tensor]:
    """smECE (C,) and bandwidths (C,) of C columns from their ``grids``: at ``bandwidth`` or at each
    column's fixed point, on ``grid_points`` or on relplot's grid of each bandwidth tried."""

    def at(columns: Tensor, sigma: float) -> Tensor:
        points = grid_points or grid_points_for_bandwidth(sigma)
        # per column the FFT holds about 2 x 3G values, the mesh of a small bandwidth more than G
        chunk = max(1, COLUMN_CHUNK_ELEMENTS // (6 * max(points, _mesh_points(sigma))))
        return torch.cat([_smooth_ece_at(grids(points, part), sigma) for part in columns.split(chunk)])

    columns = torch.arange(num_columns)
    if bandwidth is None:
        return _at_fixed_points(at, columns)
    bandwidth = check_bandwidth(bandwidth)
    values = at(columns, bandwidth)
    return values, torch.full_like(values, bandwidth)


def _at_fixed_points(smooth_ece_at: SmoothEceAt, columns: Tensor) -> tuple[Tensor, Tensor]:
    """relplot's ``search_param`` for each of the ``columns`` (C,), each with its own bracket: the
    bandwidth is 1 where even 1 is too small (``sigma < smECE(sigma)``), else the upper end of the
    bisection of [0, 1]. ``smooth_ece_at(columns, sigma)`` is the smECE (c,) of some columns at one
    sigma. Returns the smECE (C,) at the bandwidths (C,), and these."""
    value = smooth_ece_at(columns, 1.0)
    columns = columns.to(value.device)  # the index follows the grids
    upper, lower = torch.ones_like(value), torch.zeros_like(value)
    searching = ~_too_small(upper, value)
    for _ in range(BISECTION_STEPS):
        middle = (upper + lower) / 2
        at_middle = _at_own_bandwidths(smooth_ece_at, middle, columns[searching & (middle >= MIN_BANDWIDTH)])
        too_small = _too_small(middle, at_middle)
        lower = torch.where(searching & too_small, middle, lower)
        upper = torch.where(searching & ~too_small, middle, upper)
        value = torch.where(searching & ~too_small, at_middle, value)
    return value, upper


def _too_small(bandwidth: Tensor, smooth_ece: Tensor) -> Tensor:
    """relplot's test of the bandwidths of the search: below ``MIN_BANDWIDTH`` (where the smECE is
    not needed: NaN) or below the smECE there."""
    return (bandwidth < MIN_BANDWIDTH) | (bandwidth < smooth_ece)


def _at_own_bandwidths(smooth_ece_at: SmoothEceAt, bandwidth: Tensor, columns: Tensor) -> Tensor:
    """smECE (C,) of the ``columns`` (c,) each at its own ``bandwidth`` (C,), one call per distinct
    bandwidth; NaN for the other columns."""
    value = torch.full_like(bandwidth, math.nan)
    for sigma in bandwidth[columns].unique().tolist():
        group = columns[bandwidth[columns] == sigma]
        value[group] = smooth_ece_at(group, sigma)
    return value


def _columns(logits: Tensor, labels: Tensor, kind: SmoothKind) -> tuple[Tensor, Tensor]:
    """Validated scores and float64 targets (N, C) of the binary problems of ``kind``."""
    return binary_problems(logits, labels, kind, ("top-label", "binary", "classwise"))


#: Samples rounded to the grid at once: the temporaries of ``round_to_grid`` (about ten values per
#: sample) then stay in the cache; batches of 4 to 16 times this took up to twice as long per sample.
ROUNDING_CHUNK_ELEMENTS = 1 << 16


class _ColumnGrids:
    """Grid sums (c, 2, G) of ones and residuals ``f - y`` of any columns of ``scores, targets: (N, C)``
    on any number G of grid points, rounded on demand a few columns at a time. The sums on
    ``kept_points`` are kept for all columns: the fixed grid, or relplot's grid of every bandwidth
    >= 0.01, asked for at several steps of the search; it asks for a smaller one once per column."""

    def __init__(self, scores: Tensor, targets: Tensor, kept_points: int) -> None:
        self.scores = scores.T.contiguous()  # (C, N): each column's samples side by side
        self.residuals = self.scores - targets.T
        self.kept_points = kept_points
        self.kept: Tensor | None = None

    def __call__(self, points: int, columns: Tensor) -> Tensor:
        if points != self.kept_points:
            return self._round(points, columns)
        if self.kept is None:
            self.kept = self._round(points, torch.arange(self.scores.shape[0], device=self.scores.device))
        return self.kept[columns]

    def _round(self, points: int, columns: Tensor) -> Tensor:
        chunk = max(1, ROUNDING_CHUNK_ELEMENTS // self.scores.shape[1])
        return torch.cat([self._round_chunk(points, part) for part in columns.split(chunk)])

    def _round_chunk(self, points: int, columns: Tensor) -> Tensor:
        scores = self.scores[columns]
        weights = torch.stack([torch.ones_like(scores), self.residuals[columns]])
        return round_to_grid(scores, weights, points).transpose(0, 1)


def _per_column(
    scores: Tensor, targets: Tensor, bandwidth: float | None, grid_points: int | None
) -> tuple[Tensor, Tensor]:
    """smECE (C,) and bandwidths (C,) of the columns ``scores``, ``targets`` (N, C), a chunk of columns at a time."""
    kept_points = grid_points or grid_points_for_bandwidth(1.0)
    chunk = max(1, COLUMN_CHUNK_ELEMENTS // scores.shape[0])
    results = [
        _smooth_ece_columns(_ColumnGrids(f, y, kept_points), f.shape[1], bandwidth, grid_points)
        for f, y in zip(scores.split(chunk, dim=1), targets.split(chunk, dim=1))
    ]
    return torch.cat([value for value, _ in results]), torch.cat([sigma for _, sigma in results])


def smooth_calibration_error(
    logits: Tensor,
    labels: Tensor,
    kind: SmoothKind = "top-label",
    bandwidth: float | None = None,
    grid_points: int | None = None,
) -> Tensor:
    """Smooth ECE (smECE) of Błasiok & Nakkiran, as ``relplot.smECE``; a scalar float64 tensor.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        kind: ``"top-label"`` (confidence vs correctness, relplot's multiclass reduction),
            ``"binary"`` (``q_1`` vs ``[y == 1]`` for K = 2) or ``"classwise"`` (the mean over
            classes of the one-vs-rest smECE, each at its own bandwidth).
        bandwidth: the kernel bandwidth sigma in [1e-5, 1]; None (default) takes the fixed point
            ``sigma = smECE(sigma)``, as the paper and relplot do.
        grid_points: size G of the grid the scores are rounded to; None (default) takes relplot's
            ``max(2000, round(20 / sigma)) // 2 + 1``, which the streaming metric cannot know in
            advance: it uses a fixed G, and so does this function when given one. The value is
            then relplot's only for bandwidths where relplot's grid has G points too (G = 1001:
            sigma >= 0.01); a larger G is not closer to it (module docs).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> round(float(smooth_calibration_error(probs.log(), torch.tensor([0, 1, 1, 0]))), 6)
        0.257774
    """
    return smooth_calibration_error_columns(logits, labels, kind, bandwidth, grid_points).evaluate()


def smooth_calibration_error_columns(
    logits: Tensor,
    labels: Tensor,
    kind: SmoothKind = "top-label",
    bandwidth: float | None = None,
    grid_points: int | None = None,
) -> ColumnDecomposition:
    """Validate the inputs of ``smooth_calibration_error`` and return its ``ColumnDecomposition``
    (which it evaluates), for the bootstrap: scores and targets (N, C), smoothed again (at a
    bandwidth found again, if not given) on each resample.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> columns = smooth_calibration_error_columns(probs.log(), torch.tensor([0, 1, 1, 0]), kind="classwise")
        >>> columns.scores.shape, round(float(columns.evaluate()), 6)
        (torch.Size([4, 2]), 0.22689)
    """
    if grid_points is not None:
        check_grid_points(grid_points)
    if bandwidth is not None:
        bandwidth = check_bandwidth(bandwidth)
    scores, targets = _columns(logits, labels, kind)
    return ColumnDecomposition(scores, targets, partial(_mean_over_columns, bandwidth=bandwidth, grid_points=grid_points))


def _mean_over_columns(scores: Tensor, targets: Tensor, bandwidth: float | None, grid_points: int | None) -> Tensor:
    """The mean smECE of the columns ``scores``, ``targets`` (N, C), each at its own bandwidth."""
    return _per_column(scores, targets, bandwidth, grid_points)[0].mean()


#: The paper's name, kept as an alias.
smooth_ece = smooth_calibration_error


def smooth_ece_bandwidth(logits: Tensor, labels: Tensor, kind: SmoothKind = "top-label") -> Tensor:
    """The automatic bandwidths (C,) of ``smooth_calibration_error`` (C = K for ``"classwise"``, else 1).

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> smooth_ece_bandwidth(probs.log(), torch.tensor([0, 1, 1, 0]))
        tensor([0.2578], dtype=torch.float64)
    """
    return _per_column(*_columns(logits, labels, kind), None, None)[1]


def smooth_reliability_curve(
    logits: Tensor,
    labels: Tensor,
    kind: Literal["top-label", "binary"] = "top-label",
    bandwidth: float | None = None,
    mesh_points: int = 200,
    num_replicates: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
) -> SmoothReliabilityCurve:
    """The kernel-smoothed reliability curve with a percentile bootstrap band (relplot's diagram).

    The curve is the Nadaraya–Watson regression of the targets on the scores with the reflected
    Gaussian kernel at the smECE bandwidth (relplot's ``KernelSmoother``), on ``mesh_points``
    equally spaced scores; the band holds the bandwidth fixed and resamples the samples, all
    replicates at once on the logits' device. Seeds as ``functional.bootstrap``.

    Example:
        >>> import torch
        >>> logits, labels = torch.randn(300, 3), torch.randint(0, 3, (300,))
        >>> curve = smooth_reliability_curve(logits, labels, num_replicates=50)
        >>> curve.frequency.shape, bool((curve.lower <= curve.upper).all())
        (torch.Size([200]), True)
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}.")
    check_count(num_replicates, "num_replicates", 2)  # a percentile band needs two replicates
    check_grid_points(mesh_points, "mesh_points", 2)
    if bandwidth is not None:
        bandwidth = check_bandwidth(bandwidth)
    columns = binary_problems(logits, labels, kind, ("top-label", "binary"))  # (one curve: no classwise kind)
    values, bandwidths = _per_column(*columns, bandwidth, None)
    (scores, targets), value, sigma = (x[:, 0] for x in columns), values[0], float(bandwidths[0])
    points = grid_points_for_bandwidth(sigma)
    mesh = torch.linspace(0, 1, mesh_points, dtype=torch.float64, device=scores.device)

    def smoothed(weights: Tensor, draws: Tensor | None) -> tuple[Tensor, Tensor]:
        """Density and frequency on the mesh, of all data or of the resamples ``draws: (b, N)``."""
        f = scores if draws is None else scores[draws]
        grid = _scatter_rows(f, weights if draws is None else weights[:, draws], points)
        ones, positives = _interpolate(mesh, _reflected_gaussian_smooth(grid, sigma)).unbind(-2)
        return ones, positives / (ones + DENSITY_FLOOR)

    weights = torch.stack([torch.ones_like(scores), targets])
    density, frequency = smoothed(weights, None)
    per_draw = 6 * max(points, mesh_points)  # each replicate's grid, FFT and mesh (a small bandwidth's grid is large)
    replicates = torch.cat(
        [smoothed(weights, part.to(scores.device))[1] for draws in resample_indices(scores.shape[0], num_replicates, seed)
         for part in draws.split(max(1, COLUMN_CHUNK_ELEMENTS // per_draw))]
    )
    alpha = (1 - confidence) / 2
    levels = torch.tensor([alpha, 1 - alpha], dtype=torch.float64, device=scores.device)
    lower, upper = torch.quantile(replicates, levels, dim=0)
    return SmoothReliabilityCurve(mesh, frequency, density, lower, upper, scores.new_tensor(sigma), value)


def _scatter_rows(scores: Tensor, weights: Tensor, grid_points: int) -> Tensor:
    """``round_to_grid`` of scores (N,) or (b, N) with weights (W, N) or (W, b, N); (..., W, G)."""
    if scores.ndim == 1:
        return round_to_grid(scores, weights, grid_points)
    return round_to_grid(scores.unsqueeze(0), weights, grid_points).transpose(0, 1)
