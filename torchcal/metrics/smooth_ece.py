"""Streaming smooth ECE: grid sums of ones and residuals, (C, 2, G), summed across batches and processes.

The scores are rounded onto a fixed grid of G points (``round_to_grid`` of the module
``torchcal.functional.smooth_ece``), so the state does not grow with N. relplot rounds onto ``max(2000, round(20 / sigma)) // 2 + 1``
points, which is the default G = 1001 whenever the bandwidth sigma is at least 0.01: there the two
agree to round-off (1e-16 on the top-label smECE of CIFAR-10/100, SST-2, AG News and FVCAUS
scores). Below 0.01 relplot's grid is finer and the two differ (6e-6 on the classwise smECE of
0.0062 of a CIFAR-100 ResNet-20, some of whose classes have bandwidths below 0.01);
``functional.smooth_calibration_error`` without ``grid_points`` takes relplot's grid as well. With
a fixed ``bandwidth`` the metric's default grid is relplot's for it
(``functional.smooth_ece.grid_points_for_bandwidth``: 5001 points at 0.002), and the two agree to
round-off at every bandwidth.

The value depends on G, and a larger ``grid_points`` is not closer to relplot (the module docs
of :mod:`torchcal.functional.smooth_ece` say why, with figures): keep the default to compare with
relplot's values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torchcal.functional.diagnostics import check_binary_kind
from torchcal.functional.smooth_ece import (
    SmoothKind,
    check_bandwidth,
    check_grid_points,
    grid_points_for_bandwidth,
    round_to_grid,
    smooth_ece_from_grids,
)
from torchcal.metrics._common import ScoreMetric, add_sum_state

__all__ = ["SmoothCalibrationError"]


class SmoothCalibrationError(ScoreMetric):
    """Smooth ECE (Błasiok & Nakkiran 2023), as ``functional.smooth_calibration_error(..., grid_points=G)``.

    ``compute()`` returns a float64 scalar.

    Args:
        num_classes: K.
        kind: ``"top-label"``, ``"binary"`` (class 1 of K = 2) or ``"classwise"`` (mean over
            classes of the one-vs-rest smECE).
        bandwidth: fixed kernel bandwidth; None (default) takes the fixed point of each column.
        grid_points: size G of the grid the scores are rounded to (at least 3); by default
            relplot's: for a fixed ``bandwidth`` its grid for that bandwidth, else 1001 (relplot's
            for the automatic bandwidths of at least 0.01; see the module docs).
        input, ignore_index, validate_args: see ``torchcal.metrics``; ``kwargs`` go to
            ``torchmetrics.Metric``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> metric = SmoothCalibrationError(num_classes=2)
        >>> metric.update(probs[:2].log(), torch.tensor([0, 1]))
        >>> metric.update(probs[2:].log(), torch.tensor([1, 0]))
        >>> round(float(metric.compute()), 6)
        0.257774
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    num_classes: int
    grid: Tensor  # (C, 2, G) grid sums of ones and residuals

    def __init__(
        self,
        num_classes: int,
        kind: SmoothKind = "top-label",
        bandwidth: float | None = None,
        grid_points: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_classes, **kwargs)
        if kind not in ("top-label", "binary", "classwise"):
            raise ValueError(f'kind must be "top-label", "binary" or "classwise", got {kind!r}.')
        check_binary_kind(kind, num_classes, ("top-label", "binary", "classwise"))
        if bandwidth is not None:
            bandwidth = check_bandwidth(bandwidth)
        if grid_points is None:  # (a 1001-point grid put the smECE at 0.002 2.4 % above relplot's on CIFAR-100)
            grid_points = 1001 if bandwidth is None else grid_points_for_bandwidth(bandwidth)
        check_grid_points(grid_points)
        self.kind, self.bandwidth, self.grid_points = kind, bandwidth, grid_points
        add_sum_state(self, "grid", num_classes if kind == "classwise" else 1, 2, grid_points)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        problems = self._binary_problems(scores, labels)
        if problems is None:
            return
        scores, targets = problems
        scores = scores.T  # (C, N) float64
        weights = torch.stack([torch.ones_like(scores), scores - targets.T.to(torch.float64)])  # (2, C, N)
        self.grid += round_to_grid(scores, weights, self.grid_points).transpose(0, 1)

    def compute(self) -> Tensor:
        """The smooth ECE, a float64 scalar (the mean over classes for ``"classwise"``); NaN without samples."""
        if not bool(self.sample_count > 0):  # (an empty grid's smECE would read 0: perfectly calibrated)
            return self.grid.new_tensor(math.nan)
        # (in float64 whatever set_dtype made of the grid: torch.fft has no float16 or bfloat16)
        return smooth_ece_from_grids(self.grid.to(torch.float64), self.bandwidth)[0].mean()
