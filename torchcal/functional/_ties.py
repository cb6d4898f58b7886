"""When two scores are tied: the one rule of the functions that group tied scores (PAV, Venn–Abers,
the cumulative differences of the KS and Kuiper tests, the DET curve) and of the resampling tests,
whose null statistics count against H0 where they tie with the observed one.

The same posterior reaches them with different round-off: ``log(0.3)`` from rows ``(0.3, 0.6,
0.1)`` and ``(0.3, 0.5, 0.2)``, or the log-odds of rows of logits shifted by different offsets,
differ in their last bits. Two scores ``a <= b`` are tied when ``b - a <= TIE_ULPS * eps *
max(|a|, |b|, 1)`` (``eps`` float64's): relative to their magnitude, with a floor of ``TIE_ULPS``
ulps of 1 for scores near 0 (log-probabilities near 0, whose round-off is that of the terms of
order 1 they were computed from). Sorted scores are grouped where neighbours are tied, so a
cluster of round-off variants is one group however many there are and wherever it lies.

That covers rows of logits whose offsets are up to about ``TIE_ULPS`` times the score's magnitude
(and at least 1). Larger offsets (raw logits of order 100, a posterior near 0.5) leave about
``eps * |logit|`` of round-off in a derived score, more than this, and such rows tie only where
their scores agree to it: the functions see the scores, not the logits they came from.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Ties are scores within this many float64 ulps of the larger magnitude (and of 1).
TIE_ULPS = 16
_EPS = torch.finfo(torch.float64).eps


def tie_tolerance(scores: Tensor) -> Tensor:
    """How far a score may lie from ``scores`` and still be tied with them: ``TIE_ULPS * eps *
    max(|scores|, 1)`` (exact: ``TIE_ULPS * eps`` is a power of 2)."""
    return TIE_ULPS * _EPS * scores.abs().clamp_min(1)


def tie_group_starts(ordered: Tensor, reach: int = 1) -> Tensor:
    """(n,) bool: where a group of tied scores starts in the sorted ``ordered: (n,)``, i.e. where a
    score lies more than ``reach`` tie tolerances above its lower neighbour (always at 0).

    ``reach=2``: groups whose members are all more than two tolerances apart, so that no score lies
    within a tolerance of two groups (Venn–Abers' look-up).

    Example:
        >>> tie_group_starts(torch.tensor([0.1 + 0.2, 0.3, 0.5, 0.5 + 1e-12], dtype=torch.float64).sort().values).tolist()
        [True, False, True, True]
    """
    starts = torch.ones_like(ordered, dtype=torch.bool)
    if ordered.numel() > 1:
        lower, upper = ordered[:-1], ordered[1:]
        gap = upper - lower
        # (an infinite score ties only with its equal: the tolerance there is infinite too)
        starts[1:] = (gap > reach * tie_tolerance(torch.maximum(lower.abs(), upper.abs()))) | ((gap > 0) & gap.isinf())
    return starts


def at_least(values: Tensor, threshold: Tensor) -> Tensor:
    """``values >= threshold``, where a value tied with ``threshold`` (within its tie tolerance)
    counts as equal: a statistic summed from the same terms in another order differs in its last
    bits (a resampling test's null ECE equal to the observed one, in exact arithmetic, fell below
    it and so did not count against H0).

    Example:
        >>> at_least(torch.tensor([0.1 + 0.2, 0.2], dtype=torch.float64), torch.tensor(0.3 + 1e-16, dtype=torch.float64)).tolist()
        [True, False]
    """
    return values >= threshold - tie_tolerance(threshold)
