"""Isotonic regression by pool-adjacent-violators (PAV), the one algorithm behind isotonic
calibration, the CORP decomposition and minimum Cllr.

It lives with the functional forms, which the calibrators build on, so that both can use it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from torchcal.functional._ties import tie_group_starts

__all__ = ["pool_adjacent_violators"]


def pool_adjacent_violators(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, midpoint: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted isotonic (non-decreasing) regression of ``y`` on ``x`` by PAV.

    Tied ``x`` are pooled first: scores within round-off of each other (``functional._ties``: 16
    float64 ulps of ``max(|x|, 1)``, neighbour to neighbour), which the same posterior computed
    two ways is. Returns ``(boundaries, values)``: block ``j`` holds the scores
    ``s >= boundaries[j]`` (``searchsorted(boundaries, s, side="right") - 1``; ``-inf`` for the
    first block; later boundaries lie halfway between neighbouring blocks, ``midpoint(below,
    above)`` of the lower block's last score and the upper block's first (their mean by default),
    or on the upper block's first score where the midpoint does not fall between them) and its
    fitted value ``values[j]``.

    Example (``0.1 + 0.2`` is one ulp above ``0.3``: a tie):
        >>> boundaries, values = pool_adjacent_violators(np.array([0.3, 0.1 + 0.2, 0.5]), np.array([0.0, 1.0, 1.0]), np.ones(3))
        >>> boundaries.tolist(), values.tolist()
        ([-inf, 0.4], [0.5, 1.0])
    """
    order = np.argsort(x, kind="stable")
    x, y, w = x[order], y[order], w[order]
    starts = np.flatnonzero(tie_group_starts(torch.from_numpy(x)).numpy())
    firsts, lasts = x[starts].tolist(), x[np.r_[starts[1:], x.size] - 1].tolist()  # each tie group's lowest and highest
    sums, weights = np.add.reduceat(w * y, starts).tolist(), np.add.reduceat(w, starts).tolist()
    lowest: list[float] = []
    highest: list[float] = []
    block_sum: list[float] = []
    block_w: list[float] = []
    for first, last, si, wi in zip(firsts, lasts, sums, weights):
        lowest.append(first)
        highest.append(last)
        block_sum.append(si)
        block_w.append(wi)
        while len(block_w) > 1 and block_sum[-2] * block_w[-1] >= block_sum[-1] * block_w[-2]:
            lowest.pop()
            top = highest.pop()
            highest[-1] = top
            last_sum, last_w = block_sum.pop(), block_w.pop()
            block_sum[-1] += last_sum
            block_w[-1] += last_w
    below, above = np.asarray(highest[:-1]), np.asarray(lowest[1:])
    middle = below / 2 + above / 2 if midpoint is None else midpoint(below, above)
    # Neighbouring blocks are more than the tie tolerance apart, so their mean lies between them;
    # a midpoint computed otherwise may round onto either score, and a boundary on the lower
    # block's last score would hand that score to the upper block.
    boundaries = np.r_[-np.inf, np.where((middle > below) & (middle <= above), middle, above)]
    return boundaries, np.asarray(block_sum) / np.asarray(block_w)
