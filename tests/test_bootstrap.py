"""Bootstrap: the fast and column paths equal the loop, percentile intervals, calibrators, progress."""

from __future__ import annotations

import math
import sys
from functools import partial

import numpy as np
import pytest
import torch

import torchcal
from torchcal.functional import (
    balanced_error_rate,
    bayes_decisions,
    bayes_risk,
    bootstrap,
    brier_score,
    cross_entropy,
    cross_validated_calibration_loss,
    debiased_calibration_error,
    diagnostics,
    error_rate,
    expected_calibration_error,
    expected_cost,
    smooth_calibration_error,
    sweep_calibration_error,
)
from torchcal.functional.bootstrap import column_decomposition, resample_indices

bootstrap_module = sys.modules["torchcal.functional.bootstrap"]  # the package attribute is the function


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(300, 4, generator=g, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 2).sample()
    labels[:4] = torch.arange(4)
    return logits, labels


COSTS = torch.tensor([[0.0, 1.0, 2.0, 1.0, 0.3], [1.0, 0.0, 1.0, 1.0, 0.3], [2.0, 1.0, 0.0, 1.0, 0.3], [1.0, 1.0, 1.0, 0.0, 0.3]])
PRIORS = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)

FAST_CASES = [
    (cross_entropy, {}),
    (cross_entropy, {"priors": PRIORS, "normalize": True}),
    (brier_score, {"normalize": True}),
    (brier_score, {"priors": PRIORS}),
    (bayes_risk, {"costs": COSTS}),
    (bayes_risk, {"costs": COSTS, "priors": PRIORS, "normalize": True}),
    (error_rate, {}),
    (balanced_error_rate, {}),
    (expected_calibration_error, {"n_bins": 5}),
    (expected_calibration_error, {"kind": "classwise", "n_bins": 7, "norm": "l2", "reduction": "sum"}),
    (expected_calibration_error, {"strategy": "uniform", "norm": "max"}),
]


@pytest.mark.parametrize("metric_fn, kwargs", FAST_CASES)
def test_fast_path_equals_the_loop(data, metric_fn, kwargs):
    logits, labels = data
    assert bootstrap_module.metric_decomposition(metric_fn, kwargs) is not None
    fast = bootstrap(metric_fn, logits, labels, num_replicates=40, seed=3, **kwargs)
    stratify = bootstrap_module._stratified_by_default(metric_fn, kwargs, labels)  # a lambda hides what it computes
    loop = bootstrap(lambda z, y, **kw: metric_fn(z, y, **kw), logits, labels, num_replicates=40, seed=3, stratify=stratify, **kwargs)
    assert fast.estimate.item() == pytest.approx(metric_fn(logits, labels, **kwargs).item(), rel=1e-14)
    torch.testing.assert_close(fast.replicates, loop.replicates, rtol=1e-12, atol=1e-14)
    assert fast.replicates.std() > 0


def test_fast_path_of_expected_cost_of_fixed_decisions(data):
    logits, labels = data
    decisions = bayes_decisions(logits, COSTS)
    fast = bootstrap(expected_cost, decisions, labels, num_replicates=30, costs=COSTS, normalize=True, stratify=False)
    by_hand = [
        expected_cost(decisions[i], labels[i], COSTS, normalize=True).item()
        for chunk in resample_indices(300, 30, seed=0)
        for i in chunk
    ]
    assert fast.replicates.tolist() == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("metric_fn, kwargs", [(cross_entropy, {}), (expected_calibration_error, {"kind": "classwise"})])
def test_chunking_does_not_change_the_replicates(data, monkeypatch, metric_fn, kwargs):
    logits, labels = data
    whole = bootstrap(metric_fn, logits, labels, num_replicates=25, seed=5, **kwargs)
    # chunks of 7 replicates; the classwise sums (4 columns per sample) then take 1 replicate at a time
    monkeypatch.setattr(bootstrap_module, "CHUNK_ELEMENTS", 7 * 300)
    chunked = bootstrap(metric_fn, logits, labels, num_replicates=25, seed=5, **kwargs)
    torch.testing.assert_close(chunked.replicates, whole.replicates, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "metric_fn, kwargs",
    [(cross_entropy, {}), (brier_score, {"priors": PRIORS}), (expected_calibration_error, {}), (smooth_calibration_error, {})],
)
def test_logits_that_require_grad_give_the_detached_interval(data, metric_fn, kwargs):
    """A model's output without ``.detach()``: the same interval, without a graph (the fast paths'
    in-place sums raised "a view was created in no_grad mode")."""
    logits, labels = data
    attached = bootstrap(metric_fn, logits.clone().requires_grad_(), labels, num_replicates=20, **kwargs)
    detached = bootstrap(metric_fn, logits, labels, num_replicates=20, **kwargs)
    for got, expected in zip(attached, detached):
        assert not got.requires_grad and torch.equal(got, expected)


def test_percentile_interval_and_seeds(data):
    logits, labels = data
    result = bootstrap(cross_entropy, logits, labels, num_replicates=500, confidence=0.9, seed=1)
    lower, upper = np.percentile(result.replicates.numpy(), [5, 95])
    assert (result.lower.item(), result.upper.item()) == pytest.approx((lower, upper), rel=1e-12)
    again = bootstrap(cross_entropy, logits, labels, num_replicates=500, confidence=0.9, seed=1)
    assert torch.equal(again.replicates, result.replicates)
    other = bootstrap(cross_entropy, logits, labels, num_replicates=500, confidence=0.9, seed=2)
    assert not torch.equal(other.replicates, result.replicates)


def test_interval_width_of_an_error_rate():
    """For an error rate p on N samples the 95 % interval is about 2 * 1.96 * sqrt(p (1 - p) / N)."""
    n, p = 4000, 0.2
    labels = torch.zeros(n, dtype=torch.long)
    logits = torch.zeros(n, 2)
    logits[: int(p * n), 1] = 1.0  # the first 20 % are wrong
    result = bootstrap(error_rate, logits, labels, num_replicates=2000)
    width = (result.upper - result.lower).item()
    assert width == pytest.approx(2 * 1.96 * (p * (1 - p) / n) ** 0.5, rel=0.1)
    assert result.replicates.mean().item() == pytest.approx(p, abs=0.002)


def test_general_path_any_metric_and_tuples(data):
    logits, labels = data
    # equal-mass edges move with the resample: recomputed every time
    assert bootstrap_module.metric_decomposition(expected_calibration_error, {"strategy": "quantile"}) is None
    ece = bootstrap(expected_calibration_error, logits, labels, num_replicates=20, n_bins=5, strategy="quantile")
    assert ece.estimate.item() == pytest.approx(expected_calibration_error(logits, labels, n_bins=5, strategy="quantile").item())
    assert ece.replicates.shape == (20,) and ece.replicates.std() > 0
    pair = bootstrap(lambda z, y: (cross_entropy(z, y), brier_score(z, y)), logits, labels, num_replicates=20)
    assert pair.estimate.shape == pair.lower.shape == (2,) and pair.replicates.shape == (20, 2)
    torch.testing.assert_close(pair.replicates[:, 0], bootstrap(cross_entropy, logits, labels, num_replicates=20).replicates)


def test_each_call_gets_a_fresh_copy_of_the_calibrator(data):
    logits, labels = data
    original = torch.nn.Linear(1, 1)
    seen = []

    def metric(z, y, calibrator):
        seen.append(calibrator)
        calibrator.weight.data.fill_(float(len(seen)))  # mutate the copy
        return cross_entropy(z, y)

    bootstrap(metric, logits, labels, num_replicates=5, calibrator=original)
    assert len(seen) == 6 and len({id(c) for c in seen}) == 6 and all(c is not original for c in seen)
    assert original.weight.item() not in range(1, 7)


def test_calibration_loss_with_refit_in_every_replicate(data):
    logits, labels = data
    result = bootstrap(
        cross_validated_calibration_loss, 3 * logits, labels, num_replicates=4,
        calibrator=torchcal.TemperatureScaling(), folds=3,
    )
    assert result.estimate.shape == (2,) and result.replicates.shape == (4, 2)
    assert torch.all(result.replicates[:, 1] > 10)  # tripled logits: large relative loss


def test_a_cross_validated_calibration_loss_keeps_a_resample_s_copies_in_one_fold(data):
    """Each replicate's cross-validation gets the original row of each drawn copy as its group, so
    no fold calibrator is fitted on copies of what it calibrates (Ferrer & Ramos, App. E); a metric
    without a ``groups`` argument is called as before."""
    logits, labels = data
    calibrator = torchcal.IsotonicCalibration()
    result = bootstrap(cross_validated_calibration_loss, logits, labels, num_replicates=3, seed=5, calibrator=calibrator, folds=3)
    index = next(iter(resample_indices(labels.shape[0], 3, 5, None)))[0]
    grouped = cross_validated_calibration_loss(logits[index], labels[index], calibrator, folds=3, groups=index)
    spread = cross_validated_calibration_loss(logits[index], labels[index], calibrator, folds=3)
    assert result.replicates[0].tolist() == [float(grouped.absolute), float(grouped.relative)]
    assert float(spread.relative) != float(grouped.relative)
    plain = bootstrap(lambda z, y, calibrator: cross_validated_calibration_loss(z, y, calibrator, folds=3), logits, labels,
                      num_replicates=3, seed=5, calibrator=calibrator)
    assert plain.replicates[0].tolist() == [float(spread.absolute), float(spread.relative)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_replicates": 0}, "num_replicates"),
        ({"num_replicates": 2.5}, "num_replicates"),
        ({"confidence": 1.0}, "confidence"),
        ({"confidence": 0}, "confidence"),
    ],
)
def test_bootstrap_rejects_bad_options(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bootstrap(cross_entropy, *data, **kwargs)


def test_bootstrap_rejects_mismatched_data(data):
    logits, labels = data
    with pytest.raises(ValueError, match="same number N of rows"):
        bootstrap(cross_entropy, logits, labels[:-1])
    with pytest.raises(ValueError, match="labels must lie"):
        bootstrap(cross_entropy, logits, labels + 4)


def test_missing_class_in_a_replicate_is_reported_without_stratification():
    logits = torch.zeros(50, 2)
    labels = torch.zeros(50, dtype=torch.long)
    labels[0] = 1  # the rare class is absent from a third of the replicates: they are left out, and said so
    with pytest.warns(UserWarning, match=r"undefined on \d+ of 20 bootstrap resamples .* stratify=True keeps every class"):
        result = bootstrap(cross_entropy, logits, labels, num_replicates=20, priors=torch.tensor([0.5, 0.5]), stratify=False)
    assert 0 < int(result.replicates.isnan().sum()) < 20


def rare_class_data(n=6752, rare=6, seed=0):
    """Nine classes, the last one with only ``rare`` samples (as a rare finding in medical data)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 8, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[:rare]] = 8
    logits = torch.randn(n, 9, generator=g, dtype=torch.float64)
    logits[torch.arange(n), labels] += 1.5
    return logits, labels


@pytest.mark.parametrize("metric_fn, kwargs", [(cross_entropy, {"priors": torch.full((9,), 1 / 9)}), (balanced_error_rate, {}),
                                               (error_rate, {})])
def test_prior_weighted_metrics_resample_within_each_class(metric_fn, kwargs):
    logits, labels = rare_class_data()
    result = bootstrap(metric_fn, logits, labels, num_replicates=400, seed=1, **kwargs)
    counts = torch.bincount(labels)
    stratified = bootstrap_module._stratified_by_default(metric_fn, kwargs, labels)
    for chunk in resample_indices(labels.shape[0], 400, 1, labels if stratified else None):
        drawn = torch.stack([torch.bincount(labels[i], minlength=9) for i in chunk])
        assert torch.equal(drawn, counts.expand_as(drawn)) == stratified
        by_hand = [metric_fn(logits[i], labels[i], **kwargs).item() for i in chunk[:20]]
        assert result.replicates[:20].tolist() == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("name", ["cllr", "min_cllr", "detection_cost", "equal_error_rate"])
def test_detection_metrics_resample_within_each_class(name):
    """They average the two classes' rates: an unstratified replicate of 3 targets in 63 samples
    could draw no target at all (and raised)."""
    metric_fn = getattr(torchcal.functional, name)
    kwargs = {"target_prior": 0.1, "cost_miss": 1.0} if name == "detection_cost" else {}
    g = torch.Generator().manual_seed(0)
    labels = torch.zeros(63, dtype=torch.long)
    labels[:3] = 1
    llr = torch.randn(63, generator=g, dtype=torch.float64) + 2.0 * labels
    logits = torch.stack([torch.zeros_like(llr), llr], 1)
    result = bootstrap(metric_fn, logits, labels, num_replicates=200, seed=2, **kwargs)
    (chunk,) = resample_indices(63, 200, 2, labels)
    assert bool((labels[chunk].sum(1) == 3).all())
    by_hand = [float(metric_fn(logits[i], labels[i], **kwargs)) for i in chunk[:10]]
    assert result.replicates[:10].tolist() == pytest.approx(by_hand, rel=1e-12)


def test_replicate_sums_stay_within_the_memory_bound(monkeypatch):
    """Classwise ECE at K = 1,000 keeps (3, b, K * bins) sums per chunk of replicates: b is bounded
    by the number of keys too, not only by N (peak memory grew with the replicates: 831 MB at 1,000)."""
    seen = []
    original = bootstrap_module._sums_per_replicate

    def recording(keys, values, num_keys, index):
        seen.append(index.shape[0] * num_keys)
        return original(keys, values, num_keys, index)

    monkeypatch.setattr(bootstrap_module, "_sums_per_replicate", recording)
    monkeypatch.setattr(bootstrap_module, "CHUNK_ELEMENTS", 1 << 16)
    logits, labels = torch.randn(50, 300, dtype=torch.float64), torch.arange(50) % 300
    expected = bootstrap(expected_calibration_error, logits, labels, num_replicates=40, kind="classwise")
    assert max(seen) <= 1 << 16 and len(seen) > 1
    monkeypatch.undo()
    assert bootstrap(expected_calibration_error, logits, labels, num_replicates=40, kind="classwise").replicates.tolist() == pytest.approx(
        expected.replicates.tolist(), rel=1e-12)


def test_stratified_interval_of_the_balanced_error_rate():
    """Stratified, BER = mean of K independent per-class error rates: its standard error is
    sqrt(sum_k p_k (1 - p_k) / n_k) / K, dominated here by the rare class."""
    logits, labels = rare_class_data(n=4000, rare=40)
    result = bootstrap(balanced_error_rate, logits, labels, num_replicates=3000, seed=0)
    wrong = (logits.argmax(1) != labels).double().numpy()
    y = labels.numpy()
    variance = sum(wrong[y == k].mean() * (1 - wrong[y == k].mean()) / (y == k).sum() for k in range(9)) / 81
    assert (result.upper - result.lower).item() == pytest.approx(2 * 1.96 * variance**0.5, rel=0.08)


COLUMN_CASES = [
    (smooth_calibration_error, {}),
    (smooth_calibration_error, {"kind": "classwise", "grid_points": 501}),
    (partial(smooth_calibration_error, bandwidth=0.1), {}),
    (debiased_calibration_error, {}),
    (debiased_calibration_error, {"kind": "classwise", "n_bins": 5, "strategy": "uniform", "reduction": "rms"}),
    (sweep_calibration_error, {}),
    (sweep_calibration_error, {"kind": "classwise", "norm": "l1", "reduction": "max", "max_bins": 12}),
    (expected_calibration_error, {"strategy": "quantile"}),
    (partial(expected_calibration_error, strategy="quantile", n_bins=5), {"kind": "classwise", "norm": "l2", "reduction": "none"}),
]


@pytest.mark.parametrize("stratify", [False, True])
@pytest.mark.parametrize("metric_fn, kwargs", COLUMN_CASES)
def test_column_path_equals_the_loop(data, metric_fn, kwargs, stratify):
    logits, labels = data
    logits = logits.float()  # float32 logits, float64 columns: the equal-width tolerance is the logits'
    assert column_decomposition(metric_fn) is not None
    columns = bootstrap(metric_fn, logits, labels, num_replicates=12, seed=4, stratify=stratify, **kwargs)
    loop = bootstrap(lambda z, y, **kw: metric_fn(z, y, **kw), logits, labels, num_replicates=12, seed=4, stratify=stratify, **kwargs)
    assert torch.equal(columns.estimate, loop.estimate)
    torch.testing.assert_close(columns.replicates, loop.replicates, rtol=1e-12, atol=1e-14)
    assert columns.replicates.std(0).min() > 0


@pytest.mark.parametrize("metric_fn, kwargs", COLUMN_CASES[::2])
def test_column_path_computes_the_columns_once(data, monkeypatch, metric_fn, kwargs):
    """The replicates resample the columns: the (N, K) log-posteriors are formed once, for the
    columns, not once per replicate (at 50,000 x 1,000 each took half a second)."""
    calls = []
    original = diagnostics.to_log_probs

    def counting(logits):
        calls.append(logits.shape)
        return original(logits)

    monkeypatch.setattr(diagnostics, "to_log_probs", counting)
    bootstrap(metric_fn, *data, num_replicates=5, **kwargs)
    assert calls == [data[0].shape]


def test_column_path_needs_a_registered_metric():
    assert column_decomposition(cross_entropy) is None
    assert column_decomposition(lambda z, y: smooth_calibration_error(z, y)) is None
    assert column_decomposition(partial(smooth_calibration_error, torch.zeros(3, 2))) is None  # positional: not understood


def test_column_path_reports_bad_options_as_the_metric_does(data):
    with pytest.raises(ValueError, match="grid_points"):
        bootstrap(smooth_calibration_error, *data, grid_points=2)
    with pytest.raises(TypeError, match="bins"):
        bootstrap(sweep_calibration_error, *data, bins=3)


@pytest.mark.parametrize("metric_fn", [smooth_calibration_error, lambda z, y: error_rate(z, y)])
def test_progress_bar_of_the_replicates(data, monkeypatch, metric_fn):
    bars = []

    def recording_tqdm(iterable, **options):  # records the bar's options, passes the iterable through
        bars.append(options)
        return iterable

    monkeypatch.setattr(bootstrap_module, "tqdm", recording_tqdm)
    quiet = bootstrap(metric_fn, *data, num_replicates=7)
    shown = bootstrap(metric_fn, *data, num_replicates=7, progress=True)
    assert torch.equal(quiet.replicates, shown.replicates)
    name = "smooth_calibration_error" if metric_fn is smooth_calibration_error else "<lambda>"
    assert [bar["desc"] for bar in bars] == [f"{name}: bootstrap replicates"] * 2
    assert [bar["total"] for bar in bars] == [7, 7]
    assert [bar["disable"] for bar in bars] == [True, None]  # None: shown on a terminal


def test_progress_bar_is_drawn(data, monkeypatch, capsys):
    """With a terminal the real tqdm draws the bar on stderr; quiet by default."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bootstrap(partial(expected_calibration_error, strategy="quantile"), *data, num_replicates=5)
    assert capsys.readouterr().err == ""
    bootstrap(partial(expected_calibration_error, strategy="quantile"), *data, num_replicates=5, progress=True)
    assert "expected_calibration_error: bootstrap replicates" in capsys.readouterr().err


@pytest.mark.parametrize("fast", [True, False])
def test_resamples_that_leave_a_normalised_score_undefined_are_left_out(fast):
    """Two positives in 100: a resample that draws neither has no naive reference, and the whole
    bootstrap (and `torchcal evaluate` at its default 1,000 replicates) raised (review finding).
    Such replicates are NaN, the interval is that of the others, and a warning counts them.
    (Normalised scores are resampled within classes by default, which keeps both classes.)"""
    gen = torch.Generator().manual_seed(0)
    labels = torch.zeros(100, dtype=torch.long)
    labels[[3, 70]] = 1
    logits = torch.randn(100, 2, generator=gen, dtype=torch.float64)
    metric = partial(cross_entropy, normalize=True) if fast else (lambda x, y: cross_entropy(x, y, normalize=True))
    with pytest.warns(UserWarning, match=r"undefined on (\d+) of 1000 bootstrap resamples") as caught:
        result = bootstrap(metric, logits, labels, num_replicates=1000, seed=3, stratify=False)
    indices = torch.cat(list(resample_indices(100, 1000, 3)))
    one_class = ~(labels[indices] == 1).any(1)
    assert f"undefined on {int(one_class.sum())} of 1000" in str(caught[0].message) and 0 < int(one_class.sum()) < 1000
    assert torch.equal(result.replicates.isnan(), one_class)
    reference = [float(cross_entropy(logits[i], labels[i], normalize=True)) for i in indices[~one_class]]
    lower, upper = np.quantile(reference, [0.025, 0.975])
    assert float(result.lower) == pytest.approx(lower, rel=1e-12) and float(result.upper) == pytest.approx(upper, rel=1e-12)
    with pytest.raises(ValueError, match="undefined on every bootstrap resample"):
        bootstrap(metric, logits[:3], torch.tensor([0, 0, 1]), num_replicates=2, seed=8, stratify=False)  # (neither draws the positive)


def test_a_metric_of_several_values_leaves_out_resamples_where_some_are_undefined():
    """posterior_quality's NCE and NBS are NaN on a one-class resample: only replicates NaN in every
    value counted as undefined, so those two intervals were NaN, with no warning."""
    from torchcal.functional import posterior_quality

    gen = torch.Generator().manual_seed(0)
    labels = torch.zeros(20, dtype=torch.long)
    labels[[3, 11]] = 1
    logits = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"posterior_quality \(some of its values\) is undefined on (\d+) of 500"):
        result = bootstrap(posterior_quality, logits, labels, num_replicates=500, seed=1)
    assert not result.lower.isnan().any() and not result.upper.isnan().any()
    with pytest.warns(UserWarning, match="cross_entropy is undefined"):
        alone = bootstrap(partial(cross_entropy, normalize=True), logits, labels, num_replicates=500, seed=1, stratify=False)
    nce = 1  # (cross_entropy, nce, brier, nbs, error_rate, ece)
    assert float(result.lower[nce]) == float(alone.lower) and float(result.upper[nce]) == float(alone.upper)


def test_normalised_scores_of_rare_classes_are_resampled_within_classes():
    """1,000 classes of 3 samples: free resampling moves the class frequencies that set the naive
    system, and the entropy of a replicate's frequencies is biased low by about (K - 1) / 2N, so
    the NCE's interval [0.652, 0.663] lay wholly above its estimate 0.640 (review finding). Where
    a class has fewer than FEW_PER_CLASS samples, a normalised score is resampled within classes,
    as a NumPy reference does."""
    gen = torch.Generator().manual_seed(0)
    k, per_class = 1000, 3
    labels = torch.arange(k).repeat_interleave(per_class)
    logits = torch.randn(k * per_class, k, generator=gen, dtype=torch.float64)
    logits[torch.arange(k * per_class), labels] += 3
    result = bootstrap(partial(cross_entropy, normalize=True), logits, labels, num_replicates=400, seed=4)
    assert float(result.lower) < float(result.estimate) < float(result.upper)
    free = bootstrap(partial(cross_entropy, normalize=True), logits, labels, num_replicates=400, seed=4, stratify=False)
    assert float(free.lower) > float(result.estimate)  # (what it was)
    losses = -torch.log_softmax(logits, 1)[torch.arange(k * per_class), labels].numpy()
    naive = math.log(k)  # (uniform classes: the frequencies the within-class draws keep)
    reference = [losses[i].mean() / naive for chunk in resample_indices(k * per_class, 400, 4, labels) for i in chunk.numpy()]
    np.testing.assert_allclose([float(result.lower), float(result.upper)], np.quantile(reference, [0.025, 0.975]), rtol=1e-10)


def test_sum_reduction_of_the_expected_cost_of_decisions():
    """It built a float dummy of logits for expected_cost, which takes decisions ("decisions must
    be an integer tensor"), though its own message offers expected_cost."""
    from torchcal.functional import expected_cost
    from torchcal.functional.bootstrap import sum_reduction

    costs = torch.tensor([[0.0, 1.0, 0.3], [2.0, 0.0, 0.3]], dtype=torch.float64)
    decisions, labels = torch.tensor([0, 1, 2, 1, 0]), torch.tensor([0, 0, 1, 1, 1])
    sums = torch.zeros(2, dtype=torch.float64).index_add_(0, labels, costs[labels, decisions])
    counts = torch.bincount(labels, minlength=2).double()
    reduce = sum_reduction(expected_cost, 2, costs=costs)
    assert float(reduce(sums, counts)) == pytest.approx(float(expected_cost(decisions, labels, costs)), rel=1e-15)


def test_a_confidence_given_as_a_number_of_any_kind():
    """A 0-d tensor and NumPy scalars are numbers; the option check of a fuzz review had refused a
    tensor (a diff review)."""
    logits, labels = torch.randn(300, 3, generator=torch.Generator().manual_seed(0)), torch.arange(300) % 3
    reference = bootstrap(cross_entropy, logits, labels, num_replicates=50, confidence=0.9)
    for confidence in (torch.tensor(0.9), np.float32(0.9), np.float64(0.9)):
        result = bootstrap(cross_entropy, logits, labels, num_replicates=50, confidence=confidence)
        torch.testing.assert_close(result.lower, reference.lower, rtol=1e-6, atol=0)


@pytest.mark.parametrize("metric_fn", [cross_entropy, brier_score])
def test_normalised_scores_of_the_data_s_frequencies_are_resampled_freely(metric_fn):
    """Binary scores of 600 samples: a new test set's class mix moves the naive system of a
    normalised score without priors, and within-class draws left that out: the stratified 95 %
    interval of the NCE covered its population value in 78 % of 200 subsamples of the SST-2
    logits (review finding). It is resampled freely now, as with stratify=False; with priors, or
    with a rare class, within classes."""
    gen = torch.Generator().manual_seed(0)
    labels = (torch.rand(600, generator=gen) < 0.4).long()
    logits = torch.randn(600, 2, generator=gen, dtype=torch.float64)
    logits[torch.arange(600), labels] += 1.0
    metric = partial(metric_fn, normalize=True)
    default = bootstrap(metric, logits, labels, num_replicates=200, seed=2)
    free = bootstrap(metric, logits, labels, num_replicates=200, seed=2, stratify=False)
    stratified = bootstrap(metric, logits, labels, num_replicates=200, seed=2, stratify=True)
    assert torch.equal(default.replicates, free.replicates) and not torch.equal(default.replicates, stratified.replicates)
    priors = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert torch.equal(bootstrap(metric, logits, labels, num_replicates=200, seed=2, priors=priors).replicates,
                       bootstrap(metric, logits, labels, num_replicates=200, seed=2, priors=priors, stratify=True).replicates)
    rare = labels.clone()
    rare[rare == 1] = torch.where(torch.arange(int((rare == 1).sum())) < 5, 1, 0)
    assert torch.equal(bootstrap(metric, logits, rare, num_replicates=50, seed=2).replicates,
                       bootstrap(metric, logits, rare, num_replicates=50, seed=2, stratify=True).replicates)

