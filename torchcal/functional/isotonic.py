"""Isotonic regression by pool-adjacent-violators (PAV), the one algorithm behind isotonic
calibration, the CORP decomposition and minimum Cllr.

It lives with the functional forms, which the calibrators build on, so that both can use it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pool_adjacent_violators"]


def pool_adjacent_violators(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted isotonic (non-decreasing) regression of ``y`` on ``x`` by PAV.

    Tied ``x`` are pooled first. Returns ``(boundaries, values)``: block ``j`` holds the scores
    above ``boundaries[j]`` (``-inf`` for the first block; later boundaries lie halfway between
    neighbouring blocks, so no training score sits on a step) and its fitted value ``values[j]``.
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
    boundaries = np.r_[-np.inf, (np.asarray(highest[:-1]) + np.asarray(lowest[1:])) / 2]
    return boundaries, np.asarray(block_sum) / np.asarray(block_w)
