"""Calibration tests: the survey's HL example, MAPIE side by side, NumPy/SciPy references, and
simulations (p-values uniform under a calibrated generator, power on an over-confident one)."""

from __future__ import annotations

import math
import sys
from functools import partial
from importlib.resources import files

import numpy as np
import pytest
import scipy.stats
import torch

from torchcal.functional import balanced_error_rate, bayes_risk, brier_score, cross_entropy, expected_calibration_error
from torchcal.functional.calibration_tests import (
    hosmer_lemeshow_test,
    kolmogorov_smirnov_test,
    kuiper_test,
    spiegelhalter_test,
    spiegelhalter_test_from_sums,
)
from torchcal.functional.consistency_resampling import consistency_resampling_test
from torchcal.functional.smooth_ece import smooth_calibration_error
from torchcal.metrics import SpiegelhalterTest

mapie = pytest.importorskip("mapie.metrics.calibration")

# The survey's Table 3 (K = 3, N = 30; rows s1 s2 s3 and the class 1..3)
TABLE3 = """1 0 0 1; .9 .1 0 1; .8 .1 .1 1; .7 .1 .2 1; .6 .3 .1 1; .4 .1 .5 1; t t t 1; t t t 1; .2 .4 .4 1; .1 .5 .4 1;
.8 .2 0 2; .7 0 .3 2; .5 .2 .3 2; .4 .4 .2 2; .4 .2 .4 2; .3 .4 .3 2; .2 .3 .5 2; .1 .6 .3 2; .1 .3 .6 2; 0 .2 .8 2;
.8 .2 0 3; .8 .1 .1 3; .8 0 .2 3; .6 0 .4 3; .3 0 .7 3; .2 .6 .2 3; .2 .4 .4 3; 0 .4 .6 3; 0 .3 .7 3; 0 .3 .7 3"""


def _table3() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [[1 / 3 if v == "t" else float(v) for v in row.split()] for row in TABLE3.replace("\n", " ").split(";")]
    data = torch.tensor(rows, dtype=torch.float64)
    return data[:, :3].log().clamp_min(-1e4), data[:, 3].long() - 1  # log 0 -> a large negative logit


def _binary_real(real, name):
    data = real(name)
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    return logits, labels, torch.softmax(logits.double(), 1)[:, 1].numpy(), labels.numpy().astype(float)


def _binary_logits(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([(1 - q).log(), q.log()], -1)


def test_multinomial_hosmer_lemeshow_reproduces_the_survey():
    result = hosmer_lemeshow_test(*_table3(), n_groups=5, degrees_of_freedom="fitted")
    assert float(result.statistic) == pytest.approx(25.3004, abs=5e-5)
    assert float(result.p_value) == pytest.approx(scipy.stats.chi2.sf(25.3004, 6), rel=1e-3)
    assert float(result.p_value) == pytest.approx(0.000300, abs=5e-6)


def test_hosmer_lemeshow_counts_only_non_empty_groups_and_impossible_events():
    """Tied scores leave groups empty: the degrees of freedom count the others. Scores from
    {0.2, 0.5, 0.8} fill 3 of 10 groups; with df = 10 calibrated data gave a mean p-value of 0.94."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)[torch.randint(3, (3000,), generator=gen)]
    labels = torch.bernoulli(q, generator=gen).long()
    result = hosmer_lemeshow_test(_binary_logits(q), labels)
    observed = torch.stack([((labels == 1) & (q == v)).sum() for v in q.unique()]).double()
    counts = torch.stack([(q == v).sum() for v in q.unique()]).double()
    expected = counts * q.unique()
    statistic = ((observed - expected).square() / expected + (observed - expected).square() / (counts - expected)).sum()
    assert float(result.statistic) == pytest.approx(float(statistic), rel=1e-12)
    # (three well-filled groups: C's resampled null is near the chi-square's of 3 degrees of freedom)
    assert float(result.p_value) == pytest.approx(scipy.stats.chi2.sf(float(statistic), 3), abs=0.03)
    # confident negatives (q_1 < 1e-16) are still told apart: grouped by q_1, not 1 - q_0
    tiny = torch.cat([torch.exp(-torch.linspace(40, 60, 500, dtype=torch.float64)), torch.linspace(0.05, 0.95, 500, dtype=torch.float64)])
    logits = torch.stack([torch.zeros_like(tiny), torch.log(tiny) - torch.log1p(-tiny)], 1)
    labels = torch.bernoulli(tiny, generator=gen).long()
    statistic, _ = _hosmer_lemeshow_numpy(torch.softmax(logits, 1).numpy(), labels.numpy(), 10, 10)
    result = hosmer_lemeshow_test(logits, labels)
    assert float(result.statistic) == pytest.approx(statistic, rel=1e-9)
    assert float(result.p_value) == _resampled_p_value(logits, labels)
    # an event of probability 0: C is infinite, p = 0
    log_odds = torch.tensor([-1000.0, -1000.0, 0.0, 0.0, math.log(9), math.log(9)], dtype=torch.float64)  # q_1 = 0, 0.5, 0.9
    impossible = hosmer_lemeshow_test(torch.stack([torch.zeros_like(log_odds), log_odds], 1), torch.tensor([1, 0, 0, 1, 1, 1]), n_groups=3)
    assert float(impossible.statistic) == math.inf and float(impossible.p_value) == 0.0


def _groups_numpy(probs: np.ndarray, groups: int) -> np.ndarray:
    """Each sample's group: numpy percentiles of 1 - q_0, right-closed bins."""
    u = probs[:, 1:].sum(axis=1)
    edges = np.quantile(u, np.linspace(0, 1, groups + 1))
    edges[0], edges[-1] = 0.0, 1.0
    return np.clip(np.searchsorted(edges[1:-1], u, side="left"), 0, groups - 1)


def _hosmer_lemeshow_numpy(probs: np.ndarray, labels: np.ndarray, groups: int, df: int) -> tuple[float, float]:
    """Independent float64 reference: one term per bin and class, chi-square with ``df``."""
    group = _groups_numpy(probs, groups)
    total = 0.0
    for m in range(groups):
        inside = group == m
        for j in range(probs.shape[1]):
            expected = probs[inside, j].sum()
            if expected > 0:
                total += ((labels[inside] == j).sum() - expected) ** 2 / expected
    return total, scipy.stats.chi2.sf(total, df)


def _resampled_p_value(logits: torch.Tensor, labels: torch.Tensor, num_resamples: int = 999, n_groups: int = 10) -> float:
    """The "external" p-value by the consistency-resampling loop (the same seeded draws), ``C``
    recomputed for every set of labels."""
    result = consistency_resampling_test(
        lambda x, y: hosmer_lemeshow_test(x, y, n_groups, degrees_of_freedom="fitted").statistic, logits, labels, num_resamples
    )
    return float(result.p_value)


@pytest.mark.parametrize("name", ["adrenalmnist3d_resnet50_ferrer", "sst2_gpt2-0shot_ferrer"])
def test_binary_hosmer_lemeshow_matches_numpy_on_real_data(real, name):
    logits, labels, _, _ = _binary_real(real, name)
    probs = torch.softmax(logits.double(), 1).numpy()
    statistic, p_value = _hosmer_lemeshow_numpy(probs, labels.numpy(), 10, 8)
    result = hosmer_lemeshow_test(logits, labels, degrees_of_freedom="fitted")
    assert float(result.statistic) == pytest.approx(statistic, rel=1e-9)
    assert float(result.p_value) == pytest.approx(p_value, rel=1e-6, abs=1e-300)
    external = hosmer_lemeshow_test(logits, labels, degrees_of_freedom="external", num_resamples=199)
    assert float(external.p_value) == _resampled_p_value(logits, labels, 199)


def test_multinomial_hosmer_lemeshow_matches_numpy_on_cifar10(real):
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits"]) / 2.395, torch.from_numpy(data["labels"])
    probs = torch.softmax(logits.double(), 1).numpy()
    statistic, p_value = _hosmer_lemeshow_numpy(probs, labels.numpy(), 10, 8 * 9)
    result = hosmer_lemeshow_test(logits, labels, degrees_of_freedom="fitted")
    assert float(result.statistic) == pytest.approx(statistic, rel=1e-9)
    assert float(result.p_value) == pytest.approx(p_value, rel=1e-6)
    # labels drawn from the posteriors (calibrated by construction): the "external" p-value
    # against the consistency-resampling loop's, and C's null far below the chi-square with
    # M (K - 1) degrees of freedom
    generator = torch.Generator().manual_seed(3)
    drawn = torch.multinomial(torch.from_numpy(probs), 1, generator=generator)[:, 0]
    external = hosmer_lemeshow_test(logits, drawn, num_resamples=199)
    assert float(external.p_value) == _resampled_p_value(logits, drawn, 199)
    null = consistency_resampling_test(lambda x, y: hosmer_lemeshow_test(x, y, degrees_of_freedom="fitted").statistic,
                                       logits, drawn, num_resamples=100).null_statistics
    assert float(null.mean()) < 0.6 * 10 * 9


def test_hosmer_lemeshow_keeps_its_level_on_confident_posteriors():
    """Confident posteriors leave many cells expecting far below one sample, where the rare
    sample that lands there adds 1 / E to C. The chi-square of C's mean and Gaussian variance
    (the "external" null before) rejected 3.3 % of calibrated label sets at the 0.1 % level here
    (K = 5, N = 1000, logits 8 randn; p-values down to 4e-30); the resampled null keeps the level."""
    generator = torch.Generator().manual_seed(5)
    p_values = []
    for _ in range(200):
        logits = 8 * torch.randn(1000, 5, generator=generator, dtype=torch.float64)
        labels = torch.multinomial(torch.softmax(logits, 1), 1, generator=generator)[:, 0]
        p_values.append(float(hosmer_lemeshow_test(logits, labels, num_resamples=199).p_value))
    p_values_tensor = torch.tensor(p_values, dtype=torch.float64)
    assert float(p_values_tensor.min()) >= 1 / 200
    assert int((p_values_tensor <= 0.01).sum()) <= 6  # level 1 %: 2 expected, 6 is 3 standard errors above
    assert int((p_values_tensor <= 0.05).sum()) <= 19  # level 5 %: 10 expected


@pytest.mark.parametrize("statistic", [0.3, 0.9, 1.0, 1.7, 3.0, 8.0, 12.0, 30.0, 43.8])
def test_brownian_p_values_keep_their_relative_accuracy_in_the_tail(statistic):
    """Against mpmath at 60 digits: the theta series (Kolmogorov's; Feller's for the range) for
    small statistics, the reflection series for large ones. One minus the distribution function
    floored the recipe's p-values at 1.1e-16 for a statistic of 43.8 (the true ones are about 1e-417)."""
    mpmath = pytest.importorskip("mpmath")
    from torchcal.functional.calibration_tests import _brownian_range_sf, _max_abs_brownian_sf

    mpmath.mp.dps = 60
    x = mpmath.mpf(statistic)
    if statistic < 1.5:  # 1 - the distribution functions' series
        max_abs = 1 - 4 / mpmath.pi * mpmath.nsum(lambda k: (-1) ** k / (2 * k + 1) * mpmath.exp(-((2 * k + 1) ** 2) * mpmath.pi**2 / (8 * x**2)), [0, mpmath.inf])
        spread = 1 - mpmath.nsum(lambda k: (8 / x**2 + 2 / ((k + 0.5) ** 2 * mpmath.pi**2)) * mpmath.exp(-2 * (k + 0.5) ** 2 * mpmath.pi**2 / x**2), [0, mpmath.inf])
    else:
        max_abs = 4 * mpmath.nsum(lambda k: (-1) ** (k - 1) * mpmath.ncdf(-(2 * k - 1) * x), [1, mpmath.inf])
        spread = 8 * mpmath.nsum(lambda k: (-1) ** (k - 1) * k * mpmath.ncdf(-k * x), [1, mpmath.inf])
    for ours, reference in ((_max_abs_brownian_sf, max_abs), (_brownian_range_sf, spread)):
        value = float(ours(torch.tensor(statistic, dtype=torch.float64)))
        assert value == pytest.approx(float(reference), rel=1e-12, abs=1e-300)
    assert (float(max_abs) > 0) == (statistic < 38)  # (float64's underflow: 4 Phi(-38) is about 1e-315)
    # Spiegelhalter's normal tail, from the sums of a Z equal to the statistic
    z = spiegelhalter_test_from_sums(torch.tensor([statistic, 1.0, 1.0], dtype=torch.float64), alternative="greater")
    assert float(z.p_value) == pytest.approx(float(mpmath.ncdf(-x)), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("name", ["adrenalmnist3d_resnet50_ferrer", "sst2_gpt2-0shot_ferrer", "sst2_gpt2-4shot_ferrer"])
def test_ks_and_spiegelhalter_match_mapie(real, name):
    logits, labels, s, y = _binary_real(real, name)
    ks = kolmogorov_smirnov_test(logits, labels, kind="binary")
    assert float(ks.statistic) == pytest.approx(mapie.kolmogorov_smirnov_statistic(y, s), rel=1e-6)
    assert float(ks.p_value) == pytest.approx(max(mapie.kolmogorov_smirnov_p_value(y, s), 0.0), abs=1e-9)
    z = spiegelhalter_test(logits, labels, kind="binary", alternative="greater")
    assert float(z.statistic) == pytest.approx(mapie.spiegelhalter_statistic(y, s), rel=1e-9)
    assert float(z.p_value) == pytest.approx(mapie.spiegelhalter_p_value(y, s), abs=1e-12)
    two_sided = spiegelhalter_test(logits, labels, kind="binary")
    assert float(two_sided.p_value) == pytest.approx(2 * scipy.stats.norm.sf(abs(float(z.statistic))), abs=1e-12)


@pytest.mark.parametrize("name", ["adrenalmnist3d_resnet50_ferrer", "sst2_gpt2-4shot_ferrer"])
def test_streaming_spiegelhalter_equals_mapie_and_the_functional(real, name):
    """Z from three sums: batches, row order and float32 change nothing; ``compute()`` is Z and
    ``result()`` adds the p-value of the chosen alternative."""
    logits, labels, s, y = _binary_real(real, name)
    expected = spiegelhalter_test(logits.double(), labels, kind="binary", alternative="greater")
    assert float(expected.statistic) == pytest.approx(mapie.spiegelhalter_statistic(y, s), rel=1e-9)
    permutation = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(2))
    for x, t, rel in ((logits.double(), labels, 1e-12), (logits.double()[permutation], labels[permutation], 1e-12),
                      (logits.float(), labels, 1e-6)):
        metric = SpiegelhalterTest(2, kind="binary", alternative="greater")
        for part in torch.arange(labels.shape[0]).tensor_split(4):
            metric.update(x[part], t[part])
        z = metric.compute()
        assert z.dtype == torch.float64 and float(z) == pytest.approx(float(expected.statistic), rel=rel)
        assert float(metric.result().p_value) == pytest.approx(mapie.spiegelhalter_p_value(y, s), rel=1e-6, abs=1e-12)
    with pytest.raises(ValueError, match="alternative"):
        SpiegelhalterTest(alternative="bigger")
    degenerate = SpiegelhalterTest(2, kind="binary")
    degenerate.update(torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=torch.float64), torch.tensor([0, 1]))  # q in {0, 1}
    with pytest.raises(ValueError, match="exactly 0 or 1"):
        degenerate.compute()


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric")  # compute() before any update, on purpose
def test_streaming_spiegelhalter_without_samples_is_nan_as_compute():
    """No update, or every label ignored: result() is NaN in both fields, as compute() is, not
    the error about scores of exactly 0 or 1 that its empty sums would give."""
    ignored = SpiegelhalterTest(3, ignore_index=-1)
    ignored.update(torch.randn(4, 3), torch.full((4,), -1))
    for metric in (SpiegelhalterTest(3), ignored):
        result = metric.result()
        assert math.isnan(result.statistic) and math.isnan(result.p_value)
        assert result.p_value.dtype == torch.float64
        assert math.isnan(metric.compute())


def test_kuiper_matches_mapie_when_the_walk_changes_sign_and_numpy_otherwise(real):
    generator = torch.Generator().manual_seed(5)
    q = torch.rand(400, generator=generator, dtype=torch.float64) * 0.9 + 0.05
    labels = torch.bernoulli(q, generator=generator).long()
    s, y = q.numpy(), labels.numpy().astype(float)
    walk = mapie.cumulative_differences(y, s)
    assert walk.min() < 0 < walk.max()
    result = kuiper_test(_binary_logits(q), labels, kind="binary")
    assert float(result.statistic) == pytest.approx(mapie.kuiper_statistic(y, s), rel=1e-6)
    assert float(result.p_value) == pytest.approx(mapie.kuiper_p_value(y, s), abs=1e-7)
    # over-confident GPT-2: the walk stays on one side; the range includes its start at 0
    logits, labels, s, y = _binary_real(real, "adrenalmnist3d_resnet50_ferrer")
    order = np.argsort(s, kind="stable")
    walk = np.concatenate([[0.0], np.cumsum(y[order] - s[order])]) / np.sqrt(np.sum(s * (1 - s)))
    assert float(kuiper_test(logits, labels, kind="binary").statistic) == pytest.approx(walk.max() - walk.min(), rel=1e-9)


def test_statistics_ignore_row_order_and_dtype(synthetic):
    scores, y = synthetic(3, 800, seed=4)
    logits, labels = torch.from_numpy(scores) / 3, torch.from_numpy(y)
    permutation = torch.randperm(labels.shape[0])
    for test in (hosmer_lemeshow_test, spiegelhalter_test, kolmogorov_smirnov_test, kuiper_test):
        reference = test(logits, labels)
        for x, t in ((logits[permutation], labels[permutation]), (logits.float(), labels)):
            other = test(x, t)
            assert float(other.statistic) == pytest.approx(float(reference.statistic), rel=1e-5)
            assert float(other.p_value) == pytest.approx(float(reference.p_value), rel=1e-4, abs=1e-12)


def _calibrated(generator: torch.Generator, n: int, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    if k > 2:  # softmax posteriors of Gaussian logits, labels drawn from them
        logits = 1.5 * torch.randn(n, k, generator=generator, dtype=torch.float64)
        return logits, torch.multinomial(torch.softmax(logits, 1), 1, generator=generator)[:, 0]
    q = torch.rand(n, generator=generator, dtype=torch.float64) * 0.9 + 0.05
    return _binary_logits(q), torch.bernoulli(q, generator=generator).long()


# test and sample size of the null simulation: the walk of N steps has a slightly smaller maximum
# and range than the Brownian motion of the asymptotic p-values (conservative at finite N, by
# about 0.6 N^-1/2 on each side), which a KS test on 1,000 p-values sees at N = 1000 for Kuiper
TESTS = {
    "hosmer-lemeshow": (partial(hosmer_lemeshow_test, degrees_of_freedom="external", num_resamples=199), 1000),
    "hosmer-lemeshow, K = 5": (partial(hosmer_lemeshow_test, degrees_of_freedom="external", num_resamples=199), 1000),
    "spiegelhalter": (partial(spiegelhalter_test, kind="binary"), 1000),
    "kolmogorov-smirnov": (partial(kolmogorov_smirnov_test, kind="binary"), 4000),
    "kuiper": (partial(kuiper_test, kind="binary"), 4000),
}


@pytest.mark.parametrize("name", TESTS)
def test_p_values_are_uniform_under_calibration_and_powerful_against_over_confidence(name):
    test, n = TESTS[name]
    k = 5 if name.endswith("K = 5") else 2
    generator = torch.Generator().manual_seed(11)
    p_values = [float(test(*_calibrated(generator, n, k)).p_value) for _ in range(1000)]
    assert scipy.stats.kstest(p_values, "uniform").pvalue > 0.01
    rejected = 0
    for _ in range(50):
        logits, labels = _calibrated(generator, 500, k)
        rejected += float(test(2 * logits, labels).p_value) < 0.05  # sharpened: over-confident
    assert rejected >= 48


def test_resampling_test_reproduces_the_survey_example():
    # survey E.4.3: classwise-ECE, M = 5, L = 1000 gives p of about 0.016 (0.007-0.019 over seeds)
    result = consistency_resampling_test(expected_calibration_error, *_table3(), num_resamples=1000, kind="classwise", n_bins=5)
    assert 0.003 < float(result.p_value) < 0.04
    assert float(result.statistic) == pytest.approx(241 / 1350, abs=1e-12)
    assert float(result.null_statistics.mean()) == pytest.approx(0.110, abs=0.01)


@pytest.mark.parametrize(
    ("metric", "kwargs"),
    [
        (expected_calibration_error, {"kind": "classwise", "n_bins": 5}),
        (expected_calibration_error, {"norm": "l2"}),
        (cross_entropy, {}),
        (brier_score, {"priors": torch.full((4,), 0.25)}),
        (bayes_risk, {"costs": torch.tensor([[0.0, 1, 1, 1], [5, 0, 1, 1], [1, 1, 0, 1], [1, 1, 2, 0]]), "normalize": True}),
        (balanced_error_rate, {}),
    ],
)
def test_resampling_test_vectorised_path_equals_the_loop(metric, kwargs):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(300, 4, generator=generator, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits).sample()
    fast = consistency_resampling_test(metric, 1.3 * logits, labels, num_resamples=200, **kwargs)
    slow = consistency_resampling_test(lambda x, y, **k: metric(x, y, **k), 1.3 * logits, labels, num_resamples=200, **kwargs)
    torch.testing.assert_close(fast.null_statistics, slow.null_statistics, rtol=1e-12, atol=1e-12)
    assert float(fast.p_value) == float(slow.p_value)
    assert float(fast.p_value) == (1 + int((slow.null_statistics >= slow.statistic).sum())) / 201


def test_resampling_draws_do_not_depend_on_the_chunking_and_the_table_stays_small(monkeypatch):
    """At N = 10,000 the two paths draw their labels in chunks of different sizes; the draws used
    to depend on the chunk (classwise ECE nulls differed by 3.5e-4). The per-label table of a sum
    over samples is formed K labels at a time (it was an (N K, K) copy of the logits: 1.9 GB for
    CIFAR-100) and falls back to the loop beyond its bound."""
    with np.load(str(files("torchcal.data") / "examples" / "cifar10_resnet110_kangsepp.npz")) as f:
        logits, labels = torch.from_numpy(f["logits"]).double() / 2.4, torch.from_numpy(f["labels"]).long()
    options = {"kind": "classwise", "num_resamples": 30}
    fast = consistency_resampling_test(expected_calibration_error, logits, labels, **options)
    slow = consistency_resampling_test(lambda x, y, **k: expected_calibration_error(x, y, **k), logits, labels, **options)
    torch.testing.assert_close(fast.null_statistics, slow.null_statistics, rtol=1e-12, atol=1e-15)
    tabulated = consistency_resampling_test(cross_entropy, logits, labels, num_resamples=30)
    formed = []
    original = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: formed.append(a) or original(*a, **k))
    monkeypatch.setattr(sys.modules[consistency_resampling_test.__module__], "_MAX_TABLE_ELEMENTS", 10_000 * 10 - 1)  # one short
    bounded = consistency_resampling_test(cross_entropy, logits, labels, num_resamples=30)
    torch.testing.assert_close(bounded.null_statistics, tabulated.null_statistics, rtol=1e-12, atol=1e-15)
    assert (10_000, 10) not in formed


def _count_decompositions(monkeypatch) -> list[int]:
    """A list that grows by one each time consistency_resampling_test forms a metric's decomposition."""
    module = sys.modules[consistency_resampling_test.__module__]
    original, calls = module.metric_decomposition, []

    def counting(metric_fn, metric_kwargs):
        terms = original(metric_fn, metric_kwargs)
        return None if terms is None else lambda *a, **k: calls.append(1) or terms(*a, **k)

    monkeypatch.setattr(module, "metric_decomposition", counting)
    return calls


def test_binned_null_needs_neither_the_table_nor_a_call_per_resample(monkeypatch):
    """The equal-width ECE's null only re-sums the targets: at K >= L (K = 1,000 and the report's
    L = 199) it called the metric once per resample, about a second each at 50,000 x 1,000 (the
    report spent nine of its twelve minutes there). Its decomposition is now formed once, at any
    K, for every kind, and gives the loop's null."""
    calls = _count_decompositions(monkeypatch)
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(400, 50, generator=generator, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 3).sample()
    for options in ({}, {"kind": "classwise", "n_bins": 5}, {"norm": "max"}):
        calls.clear()
        fast = consistency_resampling_test(expected_calibration_error, logits, labels, num_resamples=20, **options)
        assert len(calls) == 1  # K = 50 >= L = 20, and still no loop
        loop = consistency_resampling_test(lambda x, y, **k: expected_calibration_error(x, y, **k), logits, labels,
                                           num_resamples=20, **options)
        torch.testing.assert_close(fast.null_statistics, loop.null_statistics, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(fast.statistic, loop.statistic, rtol=1e-12, atol=1e-15)
    binary = torch.stack([torch.zeros(400, dtype=torch.float64), logits[:, 0]], 1)
    for options in ({"kind": "binary"}, {}):
        fast = consistency_resampling_test(expected_calibration_error, binary, labels % 2, num_resamples=50, **options)
        loop = consistency_resampling_test(lambda x, y, **k: expected_calibration_error(x, y, **k), binary, labels % 2,
                                           num_resamples=50, **options)
        torch.testing.assert_close(fast.null_statistics, loop.null_statistics, rtol=1e-12, atol=1e-15)


def test_resampling_with_a_class_weighting_metric_says_why_it_failed():
    logits = torch.zeros(40, 3, dtype=torch.float64)
    logits[:, 2] = -4.0  # class 2 has probability 0.9 %: most resamples draw none
    labels = torch.arange(40) % 3
    with pytest.raises(ValueError, match="labels resampled from the posteriors.*needs every class in every resample"):
        consistency_resampling_test(balanced_error_rate, logits, labels, num_resamples=50)


def test_resampling_p_values_are_uniform_under_calibration_and_powerful():
    generator = torch.Generator().manual_seed(3)
    p_values = []
    for seed in range(1000):
        logits, labels = _calibrated(generator, 200)
        p_values.append(float(consistency_resampling_test(expected_calibration_error, logits, labels, 199, seed).p_value))
    assert scipy.stats.kstest(p_values, "uniform").pvalue > 0.01
    over = [consistency_resampling_test(expected_calibration_error, 2 * x, y, 99, seed).p_value for seed, (x, y) in enumerate(_calibrated(generator, 500) for _ in range(50))]
    assert sum(float(p) < 0.05 for p in over) >= 48
    # any metric, through the loop over resamples
    x, y = _calibrated(generator, 500)
    assert float(consistency_resampling_test(smooth_calibration_error, 2 * x, y, 39).p_value) == 1 / 40


def test_bad_input():
    logits, labels = _table3()
    with pytest.raises(ValueError, match="degrees_of_freedom"):
        hosmer_lemeshow_test(logits, labels, degrees_of_freedom="both")
    with pytest.raises(ValueError, match="3 or more non-empty groups"):
        hosmer_lemeshow_test(logits, labels, n_groups=2, degrees_of_freedom="fitted")
    with pytest.raises(ValueError, match="cannot fill n_groups = 10"):
        hosmer_lemeshow_test(logits[:5], labels[:5])
    with pytest.raises(ValueError, match="kind"):
        kuiper_test(logits, labels, kind="classwise")
    with pytest.raises(ValueError, match="K = 2"):
        spiegelhalter_test(logits, labels, kind="binary")
    with pytest.raises(ValueError, match="alternative"):
        spiegelhalter_test(logits, labels, alternative="bigger")
    halves = _binary_logits(torch.full((4,), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="every score is 0, 1/2 or 1"):
        spiegelhalter_test(halves, torch.tensor([0, 1, 1, 1]), kind="binary")
    saturated = torch.tensor([[80.0, 0.0], [0.0, 90.0]], dtype=torch.float64)  # scores exactly 1.0
    for test in (kolmogorov_smirnov_test, kuiper_test, spiegelhalter_test):
        with pytest.raises(ValueError, match="exactly 0 or 1"):
            test(saturated, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_resamples"):
        consistency_resampling_test(cross_entropy, logits, labels, num_resamples=0)


def test_resampling_loops_when_the_label_table_costs_more_than_the_resamples(monkeypatch):
    """Forming the per-label table evaluates the metric's terms once per class: at K = 1,000 and
    the report's L = 199 that took 3-25 times as long as calling the metric L times."""
    calls = _count_decompositions(monkeypatch)
    logits = torch.randn(400, 50, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits).sample()
    few = consistency_resampling_test(cross_entropy, 2 * logits, labels, num_resamples=20)
    assert len(calls) == 1  # K = 50 >= L = 20: the loop (the decomposition gives the observed value)
    loop = consistency_resampling_test(lambda x, y: cross_entropy(x, y), 2 * logits, labels, num_resamples=20)
    torch.testing.assert_close(few.null_statistics, loop.null_statistics, rtol=1e-12, atol=1e-12)
    consistency_resampling_test(cross_entropy, 2 * logits, labels, num_resamples=60)
    assert len(calls) >= 50  # K < L: the table, one labelling per class


def test_binned_null_chunks_its_resamples_by_the_bins_too(monkeypatch):
    """The resamples' per-bin sums are (b, C M): with few samples and many classes (N = 50, K =
    1,000, classwise, L = 2,000) chunking by N alone took 1.17 GB. Any chunking gives the same null."""
    module = sys.modules[consistency_resampling_test.__module__]
    logits = 2 * torch.randn(50, 40, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    labels = torch.arange(50) % 40
    whole = consistency_resampling_test(expected_calibration_error, logits, labels, 300, kind="classwise", n_bins=5)
    chunks = []
    original = module.resample_labels
    monkeypatch.setattr(module, "resample_labels", lambda *a: chunks.append(a[3]) or original(*a))
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 40 * 5 * 7)
    chunked = consistency_resampling_test(expected_calibration_error, logits, labels, 300, kind="classwise", n_bins=5)
    assert chunks == [7]  # CHUNK_ELEMENTS // (C M), not // N = 28
    torch.testing.assert_close(chunked.null_statistics, whole.null_statistics, rtol=0, atol=1e-15)


def test_spiegelhalter_z_is_positive_for_over_and_negative_for_under_confidence():
    """(The docstrings said positive for both; "greater" then misses an under-confident model.)"""
    from torchcal.functional import spiegelhalter_test

    g = torch.Generator().manual_seed(0)
    truth = torch.where(torch.rand(5000, generator=g) < 0.5, 0.9, 0.1).double()
    labels = torch.bernoulli(truth, generator=g).long()

    def logits_of(p1):
        return torch.stack([(1 - p1).log(), p1.log()], 1)

    under = spiegelhalter_test(logits_of(torch.where(truth > 0.5, 0.6, 0.4).double()), labels)
    over = spiegelhalter_test(logits_of(truth) * 3, labels)
    assert float(under.statistic) < -10 and float(over.statistic) > 10 and float(under.p_value) < 1e-10
    assert float(spiegelhalter_test(logits_of(torch.where(truth > 0.5, 0.6, 0.4).double()), labels, alternative="greater").p_value) > 0.99


def test_binary_kind_with_more_classes_names_only_the_kinds_the_function_takes():
    """The shared message said 'use kind="class" with class_index=j', which these refuse."""
    from torchcal.functional import (
        corp_decomposition,
        kolmogorov_smirnov_test,
        smooth_calibration_error,
        spiegelhalter_test,
    )
    from torchcal.metrics import SpiegelhalterTest

    logits, labels = torch.randn(20, 3), torch.randint(0, 3, (20,))
    for function in (spiegelhalter_test, kolmogorov_smirnov_test, corp_decomposition, smooth_calibration_error):
        with pytest.raises(ValueError, match='needs K = 2 classes, got K = 3; use kind="top-label"') as caught:
            function(logits, labels, kind="binary")
        assert "class_index" not in str(caught.value)
    with pytest.raises(ValueError, match='got K = 3; use kind="top-label".$'):
        SpiegelhalterTest(kind="binary").update(logits, labels)
    # the unbinned ECD, where kind changes nothing, took kind="binary" at K = 3 (a review finding)
    from torchcal.functional import entropic_calibration_difference
    from torchcal.metrics import EntropicCalibrationDifference

    with pytest.raises(ValueError, match='needs K = 2 classes, got K = 3; use kind="top-label"'):
        entropic_calibration_difference(logits, labels, kind="binary")
    with pytest.raises(ValueError, match='needs K = 2 classes, got K = 3; use kind="top-label"'):
        EntropicCalibrationDifference(kind="binary").update(logits, labels)


def test_numpy_integer_seeds_are_seeds_everywhere():
    """``np.int64`` seeds raised "TypeError: an integer is required" in the label resampling, the
    Hosmer-Lemeshow test, the consistency bands and the folds of the cross-validation; a seed out
    of a generator's range came back wrapped as a failure on resampled labels."""
    from torchcal.fit import fold_indices
    from torchcal.functional.reliability_intervals import consistency_bands

    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(300, 3, generator=gen, dtype=torch.float64), torch.randint(0, 3, (300,), generator=gen)
    calls = [
        lambda seed: consistency_resampling_test(expected_calibration_error, logits, labels, 19, seed=seed).p_value,
        lambda seed: consistency_resampling_test(smooth_calibration_error, logits, labels, 5, seed=seed).p_value,
        lambda seed: hosmer_lemeshow_test(logits, labels, num_resamples=19, seed=seed).p_value,
        lambda seed: consistency_bands(logits, labels, n_bins=4, num_resamples=19, seed=seed).upper,
        lambda seed: torch.cat(fold_indices(labels, 5, seed)),
    ]
    for call in calls:
        torch.testing.assert_close(call(np.int64(3)), call(3), rtol=0, atol=0, equal_nan=True)
        with pytest.raises(ValueError, match="seed must"):
            call(2**64)
        with pytest.raises(ValueError, match="seed must be an integer"):
            call(1.5)


def test_a_bad_metric_option_is_the_metrics_own_error_not_a_resampling_failure():
    logits, labels = torch.randn(200, 3, dtype=torch.float64), torch.randint(0, 3, (200,))
    from torchcal.functional.debiased_ece import debiased_calibration_error

    with pytest.raises(ValueError, match="n_bins must be a positive integer, got 0") as info:
        consistency_resampling_test(debiased_calibration_error, logits, labels, 9, n_bins=0)
    assert "resampled" not in str(info.value)
    with pytest.raises(ValueError, match="binary") as info:
        consistency_resampling_test(debiased_calibration_error, logits, labels, 9, kind="binary")
    assert "resampled" not in str(info.value)


def test_ks_and_kuiper_pool_confidences_equal_up_to_round_off():
    """K = 3 posteriors (0.6, 0.3, 0.1) and (0.6, 0.2, 0.2) have one confidence, 0.6, which the
    log-probabilities give as 0.6 and one ulp below: the walk stepped between them (KS 2.143 and
    Kuiper 3.628 against 1.485 for the one tie group; a review's reproducer)."""
    from conftest import one_confidence_two_accuracies

    p, y = one_confidence_two_accuracies()
    confidence, correct = p.max(1), (y == 0).astype(np.float64)
    expected = abs((correct - confidence).sum()) / np.sqrt((confidence * (1 - confidence)).sum())  # a walk of one point
    logits, labels = torch.from_numpy(np.log(p)), torch.from_numpy(y)
    assert float(kolmogorov_smirnov_test(logits, labels).statistic) == pytest.approx(expected, rel=1e-12)
    assert float(kuiper_test(logits, labels).statistic) == pytest.approx(expected, rel=1e-12)


def test_resampling_tests_count_null_statistics_tied_up_to_round_off():
    """A null ECE equal to the observed one in exact (rational) arithmetic came out 3e-17 below it,
    summed in another order, and did not count against H0 as documented: p 0.215 instead of 0.225
    (review finding; the generator of the reviewer's script, its data set 15)."""
    rng, k, n = np.random.default_rng(5), 3, 20
    for _ in range(16):
        z = rng.normal(size=(n, k)) * 1.5
        q = np.exp(z - z.max(1, keepdims=True))
        q /= q.sum(1, keepdims=True)
        y = np.minimum((rng.random(n)[:, None] > q.cumsum(1)).sum(1), k - 1)
    result = consistency_resampling_test(expected_calibration_error, torch.tensor(z), torch.tensor(y), 199, 15, n_bins=15)
    assert float(result.p_value) == pytest.approx(45 / 200, abs=1e-12)
    strictly = int((result.null_statistics > result.statistic).sum())
    tied = int(((result.null_statistics - result.statistic).abs() <= 1e-15).sum())
    assert (1 + strictly + tied) / 200 == float(result.p_value) and tied > int((result.null_statistics == result.statistic).sum())
