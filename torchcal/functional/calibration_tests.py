"""Hypothesis tests of calibration with analytic (or, for Hosmer–Lemeshow, resampled) null distributions.

H0 is "the posteriors are calibrated"; a small p-value is evidence against it.

- ``hosmer_lemeshow_test``: binary and multinomial Hosmer–Lemeshow (Fagerland et al. 2008; the
  survey's eq. 20–21 with its erratum: one term per bin and class, and 0/0 terms count 0).
- ``spiegelhalter_test``: Spiegelhalter's (1986) Z of the Brier score, normal under H0.
- ``kolmogorov_smirnov_test`` and ``kuiper_test``: the maximum absolute value and the range of the
  cumulative differences ``sum_{k <= i} (y_k - s_k) / N`` over the samples sorted by score, scaled
  by ``sqrt(sum_i s_i (1 - s_i)) / N``; under H0 they behave as the maximum and the range of a
  standard Brownian motion on [0, 1] (Arrieta-Ibarra, Gujral, Tannen, Tygert & Xu 2022; Tygert 2022).

The last three test one binary problem: ``kind="top-label"`` (confidence vs correctness) or
``"binary"`` (``q_1`` vs ``[y == 1]`` for K = 2), as ``functional.diagnostics``. Tied scores are
one point of the cumulative differences, so the statistics do not depend on the order of the rows
(MAPIE breaks ties by a random jitter instead; without ties the two agree). The Kuiper range
includes the walk's start at 0, as the Brownian motion's does; MAPIE's leaves it out, which
matters when the walk never changes sign (a clearly mis-calibrated model). Both p-values are
one minus a series for the null distribution function where they are large, and the series of
their tails where they are small (down to float64's smallest, about 1e-308).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from torchcal._validation import check_count, check_logits_and_labels
from torchcal.functional._ties import at_least, tie_group_starts
from torchcal.functional.consistency_resampling import resample_labels
from torchcal.functional.diagnostics import bin_indices, binary_problems, check_n_bins, quantile_edges
from torchcal.functional.scoring import to_log_probs

__all__ = [
    "CalibrationTestResult",
    "cumulative_differences",
    "hosmer_lemeshow_test",
    "kolmogorov_smirnov_test",
    "kuiper_test",
    "spiegelhalter_sums",
    "spiegelhalter_test",
    "spiegelhalter_test_from_sums",
]

#: Relative accuracy the series of the Brownian-motion distributions are truncated at.
_SERIES_EPSILON = torch.finfo(torch.float64).eps

Alternative = Literal["two-sided", "greater", "less"]


class CalibrationTestResult(NamedTuple):
    """A test's statistic and p-value (scalar float64 tensors)."""

    statistic: Tensor
    p_value: Tensor


def _binary_problem(logits: Tensor, labels: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """Validated scores and float64 targets (N,) of the one binary problem ``kind`` selects."""
    scores, targets = binary_problems(logits, labels, kind)
    _check_variance((scores * (1 - scores)).sum())
    return scores[:, 0], targets[:, 0]


def _check_variance(variance: Tensor) -> None:
    """``ValueError`` unless the targets' variance under calibration, ``sum_i s_i (1 - s_i)``, is positive."""
    if not bool(variance > 0):
        raise ValueError(
            "every score is exactly 0 or 1, so the targets have no variance under calibration and the test is "
            "undefined; such posteriors are calibrated only if every target matches its score (check the logits' scale)."
        )


def hosmer_lemeshow_test(
    logits: Tensor,
    labels: Tensor,
    n_groups: int = 10,
    degrees_of_freedom: Literal["fitted", "external"] = "external",
    num_resamples: int = 999,
    seed: int = 0,
) -> CalibrationTestResult:
    """Hosmer–Lemeshow test: binary for K = 2, multinomial (Fagerland et al. 2008) for K > 2.

    The samples are grouped into ``n_groups`` = M equal-mass groups by ``1 - q_0``, summed as
    ``q_1 + ... + q_{K-1}`` (exact where ``q_0`` rounds to 1; for K = 2 the positive-class
    probability ``q_1``), with the quantile edges of ``functional.diagnostics.quantile_edges``
    (right-closed). With ``O_mj`` the number of samples of class j in group m and ``E_mj`` the sum
    of their ``q_j``, ``C = sum_m sum_j (O_mj - E_mj)^2 / E_mj`` (a cell with ``E_mj = 0`` counts 0
    if it is empty too, and makes ``C`` infinite if not: an event of probability 0 happened).

    The p-value depends on where the posteriors come from:

    - ``"fitted"`` (fitted on these samples): chi-square with ``(M' - 2)(K - 1)`` degrees of
      freedom, ``M'`` the number of non-empty groups (ties can leave groups empty): Hosmer &
      Lemeshow's and the survey's rule. On held-out posteriors it rejects calibrated ones too
      often: 12.5 % of the time at the 5 % level in a simulation with N = 1000.
    - ``"external"`` (the default: a held-out test set, how torchcal scores posteriors): ``C``'s
      own null distribution given the posteriors, from ``num_resamples`` = L sets of labels drawn
      from them (``consistency_resampling.resample_labels``, seeded by ``seed``; the groups and
      ``E`` depend on the posteriors alone, so a resample only recounts ``O``): p-value
      ``(1 + #{C_l >= C}) / (L + 1)``, at least ``1 / (L + 1)`` (0 where ``C`` is infinite).
      Both chi-square approximations need about 5 expected samples per cell, which confident
      posteriors leave far behind: on the CIFAR-10 ResNet-110 test logits (tempered by 1/2.4,
      labels drawn from them) 14 of the 100 cells expect fewer than 5 and 6 fewer than 1, and
      the rare sample that lands in such a cell adds ``1 / E_mj`` to ``C``. The chi-square of
      ``C``'s mean and Gaussian variance (Satterthwaite's, this test's null before) put its
      variance at 34 against an actual 143 and rejected 4.2 % of such calibrated label sets at
      the 0.1 % level (3.3 % of synthetic ones at K = 5).

    ``"external"`` costs L draws of N labels, ``O(L N log K)``.

    Example (on the survey's Table 3 data, with ``"fitted"``, it gives its C = 25.3, p = 0.0003;
    see the tests):
        >>> probs = torch.tensor([[.7, .2, .1], [.3, .3, .4], [.2, .5, .3], [.6, .3, .1], [.1, .1, .8]] * 4)
        >>> result = hosmer_lemeshow_test(probs.log(), torch.tensor([0, 2, 1, 1, 2] * 4), n_groups=4, degrees_of_freedom="fitted")
        >>> round(float(result.statistic), 4), round(float(result.p_value), 4)
        (14.0769, 0.0071)
    """
    check_n_bins(n_groups, "n_groups")
    if degrees_of_freedom not in ("fitted", "external"):
        raise ValueError(f'degrees_of_freedom must be "fitted" or "external", got {degrees_of_freedom!r}.')
    check_count(num_resamples, "num_resamples")
    logits, labels = check_logits_and_labels(logits, labels)
    if labels.shape[0] < n_groups:
        raise ValueError(f"{labels.shape[0]} samples cannot fill n_groups = {n_groups} groups; use fewer groups.")
    log_probs = to_log_probs(logits)
    probs = log_probs.exp()
    num_classes = probs.shape[1]
    grouping = probs[:, 1:].sum(1, keepdim=True)
    group = bin_indices(grouping, quantile_edges(grouping, n_groups))[:, 0]
    expected = probs.new_zeros(n_groups, num_classes).index_add_(0, group, probs)
    cells = group.unsqueeze(0) * num_classes  # (1, N): each sample's first cell

    def pearson(label_sets: Tensor) -> Tensor:
        """``C`` of each row of labels (b, N): (b,)."""
        observed = probs.new_zeros(label_sets.shape[0], n_groups * num_classes)
        observed.scatter_add_(1, (cells + label_sets).expand_as(label_sets), probs.new_ones(()).expand(label_sets.shape))
        observed = observed.view(-1, n_groups, num_classes)
        terms = (observed - expected).square() / expected  # inf where E = 0 < O, NaN where E = O = 0
        return torch.where((expected > 0) | (observed > 0), terms, torch.zeros_like(terms)).sum((1, 2))

    statistic = pearson(labels.unsqueeze(0))[0]
    groups = int((expected.sum(1) > 0).sum())
    if degrees_of_freedom == "external":
        null = torch.cat([pearson(drawn) for drawn in resample_labels(log_probs, num_resamples, seed)])
        p_value = (1 + at_least(null, statistic).sum().to(probs.dtype)) / (num_resamples + 1)
        return CalibrationTestResult(statistic, torch.where(statistic == math.inf, 0.0, p_value))  # (H0 excludes C = inf)
    if groups <= 2:
        raise ValueError(f'degrees_of_freedom="fitted" needs 3 or more non-empty groups (df = (M - 2)(K - 1)), got {groups}.')
    return CalibrationTestResult(statistic, _chi2_sf(statistic, statistic.new_tensor((groups - 2) * (num_classes - 1))))


def _chi2_sf(x: Tensor, df: Tensor) -> Tensor:
    """Survival function of the chi-square distribution, ``Q(df / 2, x / 2)``."""
    return torch.special.gammaincc(df / 2, x / 2)


def spiegelhalter_sums(scores: Tensor, targets: Tensor) -> Tensor:
    """The sums Spiegelhalter's Z is made of, (3,) float64: ``sum_i (y_i - s_i)(1 - 2 s_i)``,
    ``sum_i (1 - 2 s_i)^2 s_i (1 - s_i)`` and ``sum_i s_i (1 - s_i)`` of scores and targets (N,).

    Example:
        >>> spiegelhalter_sums(torch.tensor([0.25, 0.5], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64))
        tensor([0.3750, 0.0469, 0.4375], dtype=torch.float64)
    """
    scores, targets = scores.to(torch.float64), targets.to(torch.float64)
    slope, variance = 1 - 2 * scores, scores * (1 - scores)
    return torch.stack([((targets - scores) * slope).sum(), (slope.square() * variance).sum(), variance.sum()])


def spiegelhalter_test_from_sums(sums: Tensor, alternative: Alternative = "two-sided") -> CalibrationTestResult:
    """Spiegelhalter's Z and its p-value from the (3,) ``spiegelhalter_sums`` (summed over batches).

    Example:
        >>> result = spiegelhalter_test_from_sums(torch.tensor([0.3, 0.09, 0.5], dtype=torch.float64))
        >>> round(float(result.statistic), 4), round(float(result.p_value), 4)
        (1.0, 0.3173)
    """
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f'alternative must be "two-sided", "greater" or "less", got {alternative!r}.')
    _check_variance(sums[2])
    if not bool(sums[1] > 0):
        raise ValueError(
            "every score is 0, 1/2 or 1, where the Brier score's variance under calibration, "
            "sum_i (1 - 2 s_i)^2 s_i (1 - s_i), is 0: Spiegelhalter's Z is undefined."
        )
    statistic = sums[0] / sums[1].sqrt()
    if alternative == "two-sided":
        p_value = 2 * _normal_sf(statistic.abs())
    elif alternative == "greater":
        p_value = _normal_sf(statistic)
    else:
        p_value = _normal_sf(-statistic)
    return CalibrationTestResult(statistic, p_value)


def _normal_sf(x: Tensor) -> Tensor:
    """``P(Z > x)`` for a standard normal Z, by ``erfc``: relative accuracy in the upper tail, where
    ``1 - Phi(x)`` (``torch.distributions.Normal.cdf``, and ``torch.special.ndtr``) rounds to 0
    from x = 8.3 on."""
    return 0.5 * torch.special.erfc(x / math.sqrt(2))


def spiegelhalter_test(
    logits: Tensor, labels: Tensor, kind: Literal["top-label", "binary"] = "top-label", alternative: Alternative = "two-sided"
) -> CalibrationTestResult:
    """Spiegelhalter's Z test: ``Z = sum_i (y_i - s_i)(1 - 2 s_i) / sqrt(sum_i (1 - 2 s_i)^2 s_i (1 - s_i))``.

    Z is the standardised Brier score (``sum_i (y_i - s_i)^2`` minus its expectation
    ``sum_i s_i (1 - s_i)`` under calibration): asymptotically standard normal under H0, positive
    where the Brier score exceeds that expectation (typically over-confidence: scores further from
    1/2 than the outcomes warrant) and negative where it falls below it (typically
    under-confidence). Undefined when every score is 0, 1/2 or 1 (Z's variance is 0).
    ``alternative``: ``"two-sided"`` (default; detects both), ``"greater"`` (p = P(N(0,1) >= Z),
    MAPIE's p-value: over-confidence only, p near 1 for an under-confident model) or ``"less"``.
    Z is a function of sums, so it also streams: ``metrics.SpiegelhalterTest``.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.3, .7], [.4, .6]])
        >>> result = spiegelhalter_test(probs.log(), torch.tensor([0, 1, 1, 0]), kind="binary")
        >>> round(float(result.statistic), 4), round(float(result.p_value), 4)
        (1.005, 0.3149)
    """
    return spiegelhalter_test_from_sums(spiegelhalter_sums(*_binary_problem(logits, labels, kind)), alternative)


def cumulative_differences(scores: Tensor, targets: Tensor) -> Tensor:
    """``sum_{k <= i} (y_k - s_k) / N`` over the samples sorted by score, at the last sample of
    each group of tied scores (scores within round-off of each other, ``functional._ties``: the
    same posterior computed from different rows), scaled by ``sqrt(sum_i s_i (1 - s_i)) / N``;
    (number of groups,).

    ``scores`` and ``targets``: (N,) float64. Under H0 the result is close to a standard Brownian
    motion on [0, 1] observed at the cumulative variance fractions.

    Example:
        >>> cumulative_differences(torch.tensor([0.5, 0.5, 0.2], dtype=torch.float64), torch.tensor([1., 0., 1.], dtype=torch.float64))
        tensor([0.9847, 0.9847], dtype=torch.float64)
    """
    order = scores.argsort(stable=True)
    ordered = scores[order]
    walk = (targets[order] - ordered).cumsum(0)
    last_of_tie = torch.ones_like(ordered, dtype=torch.bool)
    last_of_tie[:-1] = tie_group_starts(ordered)[1:]
    return walk[last_of_tie] / (scores * (1 - scores)).sum().sqrt()


def kolmogorov_smirnov_test(
    logits: Tensor, labels: Tensor, kind: Literal["top-label", "binary"] = "top-label"
) -> CalibrationTestResult:
    """Kolmogorov–Smirnov test of calibration (Tygert): the statistic is the maximum absolute
    scaled cumulative difference (ECCE-MAD); the p-value that of the maximum of |B| on [0, 1].

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.3, .7], [.4, .6]])
        >>> result = kolmogorov_smirnov_test(probs.log(), torch.tensor([0, 1, 1, 0]), kind="binary")
        >>> round(float(result.statistic), 4), round(float(result.p_value), 4)
        (0.8367, 0.7815)
    """
    walk = cumulative_differences(*_binary_problem(logits, labels, kind))
    statistic = walk.abs().max()
    return CalibrationTestResult(statistic, _max_abs_brownian_sf(statistic))


def kuiper_test(logits: Tensor, labels: Tensor, kind: Literal["top-label", "binary"] = "top-label") -> CalibrationTestResult:
    """Kuiper test of calibration (Tygert): the statistic is the range of the scaled cumulative
    differences (ECCE-R, with the walk's start 0 included); the p-value that of the range of a
    Brownian motion on [0, 1].

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.3, .7], [.4, .6]])
        >>> result = kuiper_test(probs.log(), torch.tensor([0, 1, 1, 0]), kind="binary")
        >>> round(float(result.statistic), 4), round(float(result.p_value), 4)
        (0.9562, 0.9567)
    """
    walk = cumulative_differences(*_binary_problem(logits, labels, kind))
    statistic = walk.max().clamp_min(0) - walk.min().clamp_max(0)
    return CalibrationTestResult(statistic, _brownian_range_sf(statistic))


#: Above this statistic the p-values are summed from their tail series (the reflection principle),
#: which keep their relative accuracy where one minus the distribution function rounds to 0 or to
#: a multiple of 1.1e-16; below it they are at least 0.6 and one minus the distribution functions.
_TAIL_SERIES_FROM = 1.0


def _max_abs_brownian_sf(x: Tensor) -> Tensor:
    """``P(max_{t <= 1} |B_t| > x) = 4 sum_{k >= 1} (-1)^(k-1) P(Z > (2k - 1) x)`` (Z standard
    normal), or one minus :func:`_max_abs_brownian_cdf` below ``_TAIL_SERIES_FROM``."""
    if float(x) < _TAIL_SERIES_FROM:
        return (1 - _max_abs_brownian_cdf(x)).clamp(0, 1)
    k = torch.arange(1, math.ceil(20 / float(x) + 0.5) + 2, dtype=torch.float64, device=x.device)  # to (2k - 1) x > 40
    return (4 * ((-1.0) ** (k - 1) * _normal_sf((2 * k - 1) * x)).sum()).clamp(0, 1)


def _brownian_range_sf(x: Tensor) -> Tensor:
    """``P(max B - min B > x) = 8 sum_{k >= 1} (-1)^(k-1) k P(Z > k x)`` over [0, 1] (the integral
    of Feller's (1951) density ``8 sum (-1)^(k-1) k^2 phi(k x)``), or one minus
    :func:`_brownian_range_cdf` below ``_TAIL_SERIES_FROM``."""
    if float(x) < _TAIL_SERIES_FROM:
        return (1 - _brownian_range_cdf(x)).clamp(0, 1)
    k = torch.arange(1, math.ceil(40 / float(x)) + 2, dtype=torch.float64, device=x.device)  # to k x > 40
    return (8 * ((-1.0) ** (k - 1) * k * _normal_sf(k * x)).sum()).clamp(0, 1)


def _max_abs_brownian_cdf(x: Tensor) -> Tensor:
    """``P(max_{t <= 1} |B_t| <= x)`` by its series, truncated at float64 accuracy (as MAPIE)."""
    if float(x) <= 0:
        return x.new_tensor(0.0)
    terms = math.ceil(0.5 + float(x) * math.sqrt(2) / math.pi * math.sqrt(math.log(4 / (math.pi * _SERIES_EPSILON))))
    k = torch.arange(terms, dtype=torch.float64, device=x.device) + 0.5
    signs = 1 - 2 * (torch.arange(terms, device=x.device) % 2)
    return 2 / math.pi * (signs / k * torch.exp(-(k**2) * math.pi**2 / (2 * x**2))).sum()


def _brownian_range_cdf(x: Tensor) -> Tensor:
    """``P(max B - min B <= x)`` over [0, 1] by its series (Feller 1951), truncated as MAPIE."""
    if float(x) <= 0:
        return x.new_tensor(0.0)
    value = float(x)
    inside = 4 / (math.sqrt(2 * math.pi) * _SERIES_EPSILON) * (1 / value + value / math.pi**2)
    terms = math.ceil(0.5 + value / (math.pi * math.sqrt(2)) * math.sqrt(math.log(inside)))
    k = torch.arange(terms, dtype=torch.float64, device=x.device) + 0.5
    return ((8 / x**2 + 2 / (k**2 * math.pi**2)) * torch.exp(-2 * k**2 * math.pi**2 / x**2)).sum()
