"""Per-bin binomial intervals against SciPy, and the coverage of the consistency bands."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from torchcal.functional import reliability_bins
from torchcal.functional.reliability_intervals import binomial_interval, consistency_bands, reliability_intervals

SCIPY_METHOD = {"clopper-pearson": "exact", "wilson": "wilson"}


@pytest.mark.parametrize("method", ["clopper-pearson", "wilson"])
def test_binomial_interval_matches_scipy(method):
    trials = torch.tensor([1, 5, 10, 10, 10, 37, 200, 1000])
    successes = torch.tensor([0, 5, 0, 3, 10, 20, 199, 512])
    lower, upper = binomial_interval(successes, trials, confidence=0.9, method=method)
    for k, n, lo, hi in zip(successes.tolist(), trials.tolist(), lower.tolist(), upper.tolist()):
        expected = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method=SCIPY_METHOD[method])
        assert (lo, hi) == pytest.approx((expected.low, expected.high), abs=1e-10)


@pytest.mark.parametrize("method", ["clopper-pearson", "wilson"])
def test_interval_ends_are_exactly_0_and_1_at_no_and_all_successes(method):
    """Wilson's ends at k = 0 and k = n came out 1e-17 and 1 - 1e-16 (613 of n = 1..1999), beyond
    the bin's frequency: matplotlib refused the reliability diagram's error bars as negative on
    the SST-2 GPT-2 logits (review finding)."""
    n = torch.arange(1, 2000, dtype=torch.float64)
    lower, _ = binomial_interval(torch.zeros_like(n), n, method=method)
    _, upper = binomial_interval(n, n, method=method)
    assert bool((lower == 0).all()) and bool((upper == 1).all())


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99, 1 - 1e-8, 1 - 1e-12])
def test_clopper_pearson_matches_scipy_up_to_millions_of_trials(confidence):
    """The beta quantiles are solved in torch (SciPy is not a dependency): against
    scipy.special.betaincinv from n = 1 to bins of ImageNet-size sets, k near 0, n / 2 and n. The
    upper end is SciPy's at ``alpha / 2`` by symmetry, as ``1 - alpha / 2`` is not resolved in
    float64 at high confidence (solved there, the upper end of k = 50 of 100 was 2e-8 off at
    1 - 1e-12)."""
    rows = [(k, n) for n in (1, 2, 10, 1000, 100_000, 2_000_000) for k in {0, 1, 2, n // 2, n - 2, n - 1, n} if 0 <= k <= n]
    successes, trials = torch.tensor(rows, dtype=torch.float64).T
    lower, upper = binomial_interval(successes, trials, confidence)
    k, n = successes.numpy(), trials.numpy()
    alpha = 1 - confidence
    with np.errstate(invalid="ignore"):
        expected_lower = np.where(k > 0, scipy.special.betaincinv(k, n - k + 1, alpha / 2), 0.0)
        expected_upper = np.where(k < n, 1 - scipy.special.betaincinv(n - k, k + 1, alpha / 2), 1.0)
    np.testing.assert_allclose(lower.numpy(), expected_lower, rtol=0, atol=1e-10)
    np.testing.assert_allclose(upper.numpy(), expected_upper, rtol=0, atol=1e-10)
    middle = (k == n // 2) & (n % 2 == 0) & (n > 0)
    np.testing.assert_allclose(upper.numpy()[middle], 1 - lower.numpy()[middle], rtol=0, atol=1e-12)


def test_clopper_pearson_of_a_bin_does_not_depend_on_the_batch():
    """Converged elements kept taking round-off steps, which the bisection rule turned into jumps:
    in a batch of three, the bin of 34,195 in 78,054 came out as [0.505, 0.442]; 11 of 2,000
    random bins had their ends crossed."""
    gen = torch.Generator().manual_seed(0)
    trials = torch.cat([torch.tensor([78054.0, 999501.0, 6336.0]), torch.randint(1, 1_000_000, (1000,), generator=gen).double()])
    successes = torch.cat([torch.tensor([34195.0, 470388.0, 118.0]), (torch.rand(1000, generator=gen, dtype=torch.float64) * trials[3:]).round()])
    lower, upper = binomial_interval(successes, trials)
    k, n = successes.numpy(), trials.numpy()
    with np.errstate(invalid="ignore"):
        expected_lower = np.where(k > 0, scipy.special.betaincinv(k, n - k + 1, 0.025), 0.0)
        expected_upper = np.where(k < n, scipy.special.betaincinv(k + 1, n - k, 0.975), 1.0)
    np.testing.assert_allclose(lower.numpy(), expected_lower, rtol=0, atol=1e-10)
    np.testing.assert_allclose(upper.numpy(), expected_upper, rtol=0, atol=1e-10)
    alone = binomial_interval(successes[:1], trials[:1])
    assert float(alone.lower[0]) == pytest.approx(float(lower[0]), abs=1e-12)
    assert float(alone.upper[0]) == pytest.approx(float(upper[0]), abs=1e-12)


def test_clopper_pearson_needs_no_scipy(monkeypatch):
    """SciPy is only a dev extra: on a plain install the reliability diagrams of ``torchcal demo``
    crashed importing scipy.special for Clopper-Pearson's beta quantiles."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.special", None)
    lower, upper = binomial_interval(torch.tensor([0.0, 7.0, 0.0]), torch.tensor([10.0, 10.0, 0.0]))
    assert lower[:2].tolist() == pytest.approx([0.0, 0.3475471499], abs=1e-9)
    assert upper[:2].tolist() == pytest.approx([0.3084971078, 0.9332604888], abs=1e-9)
    assert bool(lower[2].isnan() and upper[2].isnan())


def test_reliability_intervals_on_cifar10_bins(real):
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    bins = reliability_bins(logits, labels, n_bins=15)
    intervals = reliability_intervals(bins)
    full = bins.counts > 0
    assert bool(torch.isnan(intervals.lower[~full]).all())
    assert bool(((intervals.lower[full] <= bins.frequency[full]) & (bins.frequency[full] <= intervals.upper[full])).all())
    # the over-confident ResNet-110: its fullest bin (confidence ~1) lies above the interval
    fullest = int(bins.counts.argmax())
    assert float(bins.mean_score[fullest]) > float(intervals.upper[fullest])


def _binary(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([(1 - q).log(), q.log()], 1)


def test_consistency_bands_cover_calibrated_frequencies_and_flag_over_confidence():
    generator = torch.Generator().manual_seed(0)
    inside, total = 0, 0
    for seed in range(40):
        q = torch.rand(1000, generator=generator, dtype=torch.float64)
        labels = torch.bernoulli(q, generator=generator).long()
        bins = reliability_bins(_binary(q), labels, n_bins=10, kind="binary")
        band = consistency_bands(_binary(q), labels, n_bins=10, kind="binary", num_resamples=300, confidence=0.9, seed=seed)
        inside += int(((band.lower <= bins.frequency) & (bins.frequency <= band.upper)).sum())
        total += 10
    assert 0.85 < inside / total < 0.95  # 90 % bands
    # sharpened scores: the extreme bins' frequencies fall outside
    q = torch.rand(2000, generator=generator, dtype=torch.float64)
    labels = torch.bernoulli(q, generator=generator).long()
    sharp = torch.sigmoid(3 * torch.logit(q))
    bins = reliability_bins(_binary(sharp), labels, n_bins=10, kind="binary")
    band = consistency_bands(_binary(sharp), labels, n_bins=10, kind="binary", num_resamples=300)
    outside = (bins.frequency < band.lower) | (bins.frequency > band.upper)
    assert bool(outside[[0, 1, 8, 9]].all())


def test_consistency_band_width_matches_the_binomial_approximation():
    generator = torch.Generator().manual_seed(1)
    q = torch.rand(5000, generator=generator, dtype=torch.float64)
    labels = torch.bernoulli(q, generator=generator).long()
    band = consistency_bands(_binary(q), labels, n_bins=5, kind="binary", num_resamples=2000)
    s = q.numpy()
    for m in range(5):
        inside = (s > m / 5) & (s <= (m + 1) / 5)
        half = 1.96 * np.sqrt(np.sum(s[inside] * (1 - s[inside]))) / inside.sum()
        assert float(band.upper[m] - band.lower[m]) / 2 == pytest.approx(half, rel=0.15)


def test_row_order_does_not_change_the_bands():
    generator = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(500, 3, generator=generator), torch.randint(0, 3, (500,), generator=generator)
    band = consistency_bands(logits, labels, n_bins=5, num_resamples=4000)
    permutation = torch.randperm(500, generator=generator)
    other = consistency_bands(logits[permutation], labels[permutation], n_bins=5, num_resamples=4000)
    torch.testing.assert_close(band.lower, other.lower, atol=0.03, rtol=0, equal_nan=True)


def test_bad_input():
    with pytest.raises(ValueError, match="method"):
        binomial_interval(torch.tensor([1.0]), torch.tensor([2.0]), method="agresti")
    with pytest.raises(ValueError, match="confidence"):
        binomial_interval(torch.tensor([1.0]), torch.tensor([2.0]), confidence=1.0)
    with pytest.raises(ValueError, match="class_index"):
        consistency_bands(torch.randn(10, 3), torch.randint(0, 3, (10,)), kind="classwise")


def test_binary_kind_with_more_classes_points_to_a_kind_the_bands_take():
    """The message suggested "classwise", which consistency_bands itself refuses."""
    logits, labels = torch.randn(30, 3, dtype=torch.float64), torch.arange(30) % 3
    with pytest.raises(ValueError, match='needs K = 2 classes.*kind="class" with class_index'):
        consistency_bands(logits, labels, kind="binary")
