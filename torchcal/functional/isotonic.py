"""Isotonic regression by pool-adjacent-violators (PAV), the one algorithm behind isotonic
calibration, the CORP decomposition and minimum Cllr.

It lives with the functional forms, which the calibrators build on, so that both can use it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["pool_adjacent_violators"]


def pool_adjacent_violators(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, midpoint: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted isotonic (non-decreasing) regression of ``y`` on ``x`` by PAV.

    Tied ``x`` are pooled first. Returns ``(boundaries, values)``: block ``j`` holds the scores
    ``s >= boundaries[j]`` (``searchsorted(boundaries, s, side="right") - 1``; ``-inf`` for the
    first block; later boundaries lie halfway between neighbouring blocks, ``midpoint(below,
    above)`` of the lower block's last score and the upper block's first (their mean by default),
    or on the upper block's first score where the two are adjacent floats) and its fitted value
    ``values[j]``.

    Example:
        >>> boundaries, values = pool_adjacent_violators(np.array([0.5, np.nextafter(0.5, 1)]), np.array([0.0, 1.0]), np.ones(2))
        >>> [int(np.searchsorted(boundaries, s, side="right")) - 1 for s in (0.5, np.nextafter(0.5, 1))], values.tolist()
        ([0, 1], [0.0, 1.0])
    """
    order = np.argsort(x, kind="stable")
    x, y, w = x[order], y[order], w[order]
    starts = np.flatnonzero(np.r_[True, x[1:] != x[:-1]])
    unique_x = x[starts].tolist()
    sums, weights = np.add.reduceat(w * y, starts).tolist(), np.add.reduceat(w, starts).tolist()
    lowest: list[float] = []
    highest: list[float] = []
    block_sum: list[float] = []
    block_w: list[float] = []
    for xi, si, wi in zip(unique_x, sums, weights):
        lowest.append(xi)
        highest.append(xi)
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
    # Scores one ulp apart have no midpoint between them: it rounds to one of the two, and a
    # boundary on the lower block's last score would hand that score to the upper block.
    boundaries = np.r_[-np.inf, np.where(middle > below, middle, above)]
    return boundaries, np.asarray(block_sum) / np.asarray(block_w)
