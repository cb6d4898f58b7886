"""ECE family, reliability bins, ESCE and ECD: exact toy values, NumPy references, real data."""

from __future__ import annotations

import math
from importlib.resources import files

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcal.metrics
from torchcal.functional import (
    brier_score,
    cross_entropy,
    entropic_calibration_difference,
    error_rate,
    expected_calibration_error,
    murphy_decomposition,
    reliability_bins,
    signed_calibration_error,
)
from torchcal.functional.diagnostics import (
    EDGE_TOLERANCE,
    bin_indices,
    bin_statistics,
    calibration_error_terms,
    ecd_per_sample,
    edge_tolerance,
    equal_mass_statistics,
    quantile_edges,
    sort_columns,
    uniform_bin_indices,
    uniform_edges,
)

# --------------------------------------------------------------------------- the survey's toy problem

# Silva Filho et al., Table 3: (s1, s2, s3) and the class (1-based), 10 samples per class.
T = 1 / 3
TOY_ROWS = [
    (1, 0, 0), (.9, .1, 0), (.8, .1, .1), (.7, .1, .2), (.6, .3, .1), (.4, .1, .5), (T, T, T), (T, T, T),
    (.2, .4, .4), (.1, .5, .4),
    (.8, .2, 0), (.7, 0, .3), (.5, .2, .3), (.4, .4, .2), (.4, .2, .4), (.3, .4, .3), (.2, .3, .5),
    (.1, .6, .3), (.1, .3, .6), (0, .2, .8),
    (.8, .2, 0), (.8, .1, .1), (.8, 0, .2), (.6, 0, .4), (.3, 0, .7), (.2, .6, .2), (.2, .4, .4),
    (0, .4, .6), (0, .3, .7), (0, .3, .7),
]


@pytest.fixture
def toy():
    probs = torch.tensor(TOY_ROWS, dtype=torch.float64)
    logits = probs.log().clamp_min(-1e4)  # exp(-1e4) underflows to exactly 0
    labels = torch.arange(3).repeat_interleave(10)
    return logits, labels


def test_toy_classwise_values(toy):
    logits, labels = toy
    ece = lambda **kw: expected_calibration_error(logits, labels, n_bins=5, kind="classwise", **kw).item()
    assert ece() == pytest.approx(241 / 1350, abs=1e-14)
    assert ece(reduction="sum") == pytest.approx(169 / 900 + 131 / 900 + 91 / 450, abs=1e-14)
    assert ece(reduction="max") == pytest.approx(91 / 450, abs=1e-14)  # max class-j ECE (class 3)
    assert ece(norm="max", reduction="max") == pytest.approx(17 / 35, abs=1e-14)  # classwise-MCE
    assert ece(norm="max") == pytest.approx((17 / 35 + 7 / 30 + 3 / 10) / 3, abs=1e-14)


def test_toy_confidence_values(toy):
    logits, labels = toy
    assert expected_calibration_error(logits, labels, n_bins=5).item() == pytest.approx(19 / 90, abs=1e-14)
    assert expected_calibration_error(logits, labels, n_bins=5, norm="max").item() == pytest.approx(0.3, abs=1e-14)
    assert error_rate(logits, labels).item() == pytest.approx(17 / 30, abs=1e-14)  # first-index argmax
    for reduction in ("none", "sum", "max"):  # ignored: one column, one scalar
        assert expected_calibration_error(logits, labels, n_bins=5, reduction=reduction).shape == ()


def test_toy_values_from_float32_log_probabilities(toy):
    """float32 ``log(p)`` moves 0.8 to 0.8000000057 after the softmax: within float32's edge
    tolerance, so the bins and the survey's exact values are those of float64."""
    logits, labels = toy
    logits = logits.float()
    assert expected_calibration_error(logits, labels, n_bins=5).item() == pytest.approx(19 / 90, abs=1e-7)
    assert expected_calibration_error(logits, labels, n_bins=5, kind="classwise").item() == pytest.approx(241 / 1350, abs=1e-7)
    assert reliability_bins(logits, labels, n_bins=5).counts.tolist() == [0, 7, 10, 11, 2]
    for metric in (torchcal.metrics.CalibrationError(3, n_bins=5), torchcal.metrics.CalibrationError(3, n_bins=5, kind="classwise")):
        metric.update(logits, labels)
        exact = 19 / 90 if metric.kind == "top-label" else 241 / 1350
        assert metric.compute().item() == pytest.approx(exact, abs=1e-7)
    quality = torchcal.metrics.PosteriorQuality(num_classes=3, n_bins=5)
    quality.update(logits, labels)
    assert quality.compute()["ece"].item() == pytest.approx(19 / 90, abs=1e-7)
    decomposition = calibration_error_terms(logits, labels, n_bins=5)
    assert decomposition.evaluate().item() == pytest.approx(19 / 90, abs=1e-7)


def test_edge_tolerance_follows_the_precision():
    assert edge_tolerance(torch.float64) == 1e-12
    assert edge_tolerance(torch.float32) == edge_tolerance(torch.float16) == 8 * torch.finfo(torch.float32).eps
    # a float32 score 2 ulps above 0.6 counts as 0.6 (bin 2 of 5); in float64 the same value is above it
    above = torch.nextafter(torch.nextafter(torch.tensor([[0.6]]), torch.tensor(1.0)), torch.tensor(1.0))
    assert bin_indices(above, uniform_edges(5)).item() == uniform_bin_indices(above, 5).item() == 2
    assert bin_indices(above.double(), uniform_edges(5)).item() == uniform_bin_indices(above.double(), 5).item() == 3
    assert bin_indices(above.double(), uniform_edges(5), edge_tolerance(torch.float32)).item() == 2


def test_float32_and_float64_logits_bin_alike_on_real_scores():
    """At 64 units in the last place the float32 edge tolerance moved real scores that lie just
    above an edge into the lower bin: the ResNet-110 classwise ECE read 0.098397 in float32 against
    0.098290 (SOURCES.md: 0.0983) in float64. Every variant, and the binned ECD metric, must agree."""
    with np.load(str(files("torchcal.data") / "examples" / "cifar10_resnet110_kangsepp.npz")) as f:
        logits, labels = torch.from_numpy(f["logits"]).float(), torch.from_numpy(f["labels"]).long()
    for options in ({"kind": "classwise", "reduction": "sum"}, {"norm": "l2"}, {"norm": "max"}, {}):
        assert float(expected_calibration_error(logits, labels, **options)) == pytest.approx(
            float(expected_calibration_error(logits.double(), labels, **options)), rel=1e-12, abs=0), options
    assert float(expected_calibration_error(logits, labels, kind="classwise", reduction="sum")) == pytest.approx(0.0983, abs=5e-5)
    metric = torchcal.metrics.EntropicCalibrationDifference(10, n_bins=15)
    metric.update(logits, labels)
    for scores in (logits, logits.double()):
        torch.testing.assert_close(metric.compute(), entropic_calibration_difference(scores, labels, n_bins=15), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="kind must be"):
        entropic_calibration_difference(logits, labels, kind="classwise")


def test_toy_per_bin_tables(toy):
    logits, labels = toy
    class1 = reliability_bins(logits, labels, n_bins=5, kind="class", class_index=0)
    assert class1.counts.tolist() == [11, 7, 3, 7, 2]
    expected_mean = [0.1, 2.46667 / 7, 1.7 / 3, 5.4 / 7, 0.95]
    assert class1.mean_score.tolist() == pytest.approx(expected_mean, abs=1e-5)
    assert class1.frequency.tolist() == pytest.approx([2 / 11, 3 / 7, 1 / 3, 2 / 7, 1.0], abs=1e-14)
    assert class1.edges.tolist() == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-15)
    for j, counts in ((1, [15, 12, 3, 0, 0]), (2, [11, 11, 4, 4, 0])):
        bins = reliability_bins(logits, labels, n_bins=5, kind="class", class_index=j)
        assert bins.counts.tolist() == counts
        assert bins.mean_score[bins.counts == 0].tolist() == bins.frequency[bins.counts == 0].tolist() == [0.0] * (
            counts.count(0)
        )
    confidence = reliability_bins(logits, labels, n_bins=5)
    assert confidence.counts.tolist() == [0, 7, 10, 11, 2]
    assert confidence.frequency.tolist() == pytest.approx([0, 3 / 7, 3 / 10, 5 / 11, 1], abs=1e-14)


def test_toy_class1_murphy_decomposition(toy):
    """The reference notes' Murphy terms for class 1 of the toy problem, 5 bins (calibration-survey.md,
    B.2): REL .0645, RES .0407, UNC .2222 (BS .2433: not their sum, scores vary within bins)."""
    logits, labels = toy
    class1 = torch.stack([torch.log1p(-logits[:, 0].exp()).clamp_min(-1e4), logits[:, 0]], dim=1)
    rel, res, unc = murphy_decomposition(class1, (labels == 0).long(), n_bins=5, kind="binary")
    assert [rel.item(), res.item(), unc.item()] == pytest.approx([0.0645, 0.0407, 0.2222], abs=5e-5)


def test_survey_footnote_2_classwise_calibrated_but_not_confidence_calibrated():
    """Silva Filho et al., footnote 2 (calibration-survey.md, E.4.4): 40 instances in 4 groups whose
    class frequencies equal their scores: classwise-ECE 0, confidence-ECE 0.025, at M = 5, 10, 15."""
    groups = [((.3, .3, .4), (4, 2, 4)), ((.4, .3, .3), (3, 4, 3)), ((.4, .6, 0), (5, 5, 0)), ((.3, .6, .1), (2, 7, 1))]
    probs = torch.tensor([s for s, counts in groups for n in counts for _ in range(n)], dtype=torch.float64)
    labels = torch.tensor([k for _, counts in groups for k, n in enumerate(counts) for _ in range(n)])
    logits = probs.log().clamp_min(-1e4)
    for n_bins in (5, 10, 15):
        assert expected_calibration_error(logits, labels, n_bins=n_bins, kind="classwise").item() == pytest.approx(0, abs=1e-12)
        assert expected_calibration_error(logits, labels, n_bins=n_bins).item() == pytest.approx(0.025, abs=5e-4)


@pytest.mark.parametrize("n_bins, ece, mce, tolerance", [(10, 0.049187, 0.15, 5e-3), (5, 0.049187, 0.10, 5e-3), (2, 0.032114, 0.0824, 5e-5)])
def test_hallenbeck_reliability_table(n_bins, ece, mce, tolerance):
    """Hallenbeck (1920), the survey's Table 1: 123 rain forecasts at the decile centres
    (calibration-survey.md, E.4.6), binned in 10, 5 and 2."""
    counts, rains = [0, 22, 31, 18, 15, 13, 15, 7, 1, 1], [0, 4, 7, 6, 8, 8, 11, 6, 1, 1]
    scores = torch.tensor([0.05 + 0.1 * i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.float64)
    labels = torch.tensor([int(j < r) for n, r in zip(counts, rains) for j in range(n)])
    logits = torch.stack([torch.log1p(-scores), scores.log()], dim=1)
    assert expected_calibration_error(logits, labels, n_bins=n_bins, kind="binary").item() == pytest.approx(ece, abs=5e-7)
    assert expected_calibration_error(logits, labels, n_bins=n_bins, kind="binary", norm="max").item() == pytest.approx(mce, abs=tolerance)


# --------------------------------------------------------------------------- NumPy reference


def np_softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_columns(probs, labels, kind):
    if kind == "top-label":
        pred = probs.argmax(axis=1)
        return probs.max(axis=1)[:, None], (pred == labels)[:, None].astype(float)
    if kind == "binary":
        return probs[:, 1:], (labels == 1)[:, None].astype(float)
    return probs, np.eye(probs.shape[1])[labels]


def np_bins(s, n_bins, strategy):
    """Bin index per score: right-closed bins, first closed at 0."""
    if strategy == "uniform":
        return np.clip(np.ceil(s * n_bins).astype(int) - 1, 0, n_bins - 1)
    interior = np.quantile(s, np.arange(1, n_bins) / n_bins)
    return np.searchsorted(interior, s, side="left")


def np_calibration_error(logits, labels, n_bins, strategy, kind, norm, reduction):
    scores, targets = np_columns(np_softmax(logits), labels, kind)
    per_column = []
    for s, t in zip(scores.T, targets.T):
        idx = np_bins(s, n_bins, strategy)
        gaps, weights = [], []
        for m in range(n_bins):
            inside = idx == m
            if inside.any():
                gaps.append(abs(t[inside].mean() - s[inside].mean()))
                weights.append(inside.mean())
        gaps, weights = np.array(gaps), np.array(weights)
        per_column.append(
            {"l1": (weights * gaps).sum(), "l2": np.sqrt((weights * gaps**2).sum()), "max": gaps.max()}[norm]
        )
    return {"mean": np.mean, "sum": np.sum, "max": np.max}[reduction](per_column)


def random_scores(n, k, scale, seed):
    rs = np.random.RandomState(seed)
    logits = scale * rs.standard_normal((n, k))
    labels = np.array([rs.choice(k, p=p) for p in np_softmax(logits / 2)]) if k < 100 else rs.randint(0, k, n)
    return logits, labels


SHAPES = [(3000, 2, 3.0), (2000, 10, 2.0), (500, 1000, 5.0), (1000, 4, 1e4)]


@pytest.mark.parametrize("n, k, scale", SHAPES)
@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
def test_calibration_error_matches_numpy(n, k, scale, strategy, norm):
    logits, labels = random_scores(n, k, scale, seed=k)
    z, y = torch.from_numpy(logits), torch.from_numpy(labels)
    kinds = [("top-label", "mean"), ("classwise", "mean"), ("classwise", "sum"), ("classwise", "max")]
    if k == 2:
        kinds.append(("binary", "mean"))
    for kind, reduction in kinds:
        if kind == "classwise" and k == 1000 and strategy == "quantile" and norm != "l1":
            continue  # one quantile case per K = 1000 keeps the NumPy loop short
        expected = np_calibration_error(logits, labels, 15, strategy, kind, norm, reduction)
        got = expected_calibration_error(z, y, 15, strategy, kind, norm, reduction)
        assert got.dtype == torch.float64
        assert got.item() == pytest.approx(expected, rel=1e-10, abs=1e-13), (kind, reduction)


def test_quantile_edges_match_numpy():
    rs = np.random.RandomState(0)
    scores = rs.beta(0.5, 2.0, size=(777, 3))
    scores[:100, 0] = 0.25  # ties
    edges = quantile_edges(torch.from_numpy(scores), 7).numpy()
    expected = np.quantile(scores, np.arange(8) / 7, axis=0).T
    np.testing.assert_allclose(edges[:, 1:-1], expected[:, 1:-1], rtol=0, atol=1e-15)
    assert np.all(edges[:, 0] == 0) and np.all(edges[:, -1] == 1)


def test_equal_mass_statistics_are_bin_statistics_of_quantile_edges():
    """Read from the sorted columns, for every M at once, the bins are those of quantile_edges and
    bin_indices, ties and all: the same counts and positives, the score sums up to round-off."""
    rs = np.random.RandomState(1)
    scores = rs.beta(0.5, 2.0, size=(101, 5))
    scores[:40, 0] = 0.25  # a block of ties
    scores[:, 1] = scores[:, 1].round(1)  # ties everywhere
    scores[:, 2] = 0.5  # all tied
    scores[::7, 3] = quantile_edges(torch.from_numpy(scores[:, 3:4]), 3)[0, 1] * (1 + 1e-13)  # on an edge, within tolerance
    scores, targets = torch.from_numpy(scores), torch.from_numpy(rs.rand(101, 5) < scores)
    permutation = torch.randperm(101)
    n_bins = torch.arange(1, 110)
    counts, score_sums, target_sums = equal_mass_statistics(sort_columns(scores[permutation], targets[permutation]), n_bins)
    for b, m in enumerate(n_bins.tolist()):
        expected = bin_statistics(scores, targets, quantile_edges(scores, m), EDGE_TOLERANCE)
        assert torch.equal(counts[:, b, :m], expected[0]) and torch.equal(target_sums[:, b, :m], expected[2]), m
        torch.testing.assert_close(score_sums[:, b, :m], expected[1], rtol=0, atol=1e-13)
        assert not counts[:, b, m:].any()  # the padding of the shorter splits is empty
    # one bin count per column
    own = torch.tensor([[3], [7], [1], [3], [12]])
    counts, score_sums, target_sums = equal_mass_statistics(sort_columns(scores, targets), own)
    for column, m in enumerate(own.flatten().tolist()):
        expected = bin_statistics(scores[:, column : column + 1], targets[:, column : column + 1], quantile_edges(scores[:, column : column + 1], m), EDGE_TOLERANCE)
        assert torch.equal(counts[column, 0, :m], expected[0][0]) and torch.equal(target_sums[column, 0, :m], expected[2][0])


def test_quantile_bins_are_equal_mass():
    logits, labels = random_scores(3000, 5, 2.0, seed=1)
    bins = reliability_bins(torch.from_numpy(logits), torch.from_numpy(labels), n_bins=10, strategy="quantile")
    assert bins.counts.tolist() == [300.0] * 10


def test_confidence_one_lands_in_the_last_bin():
    """torchmetrics #3510: a saturated softmax must not create a phantom (M+1)-th bin."""
    logits = torch.tensor([[0.0, -1e4], [0.0, -1e4], [0.0, 0.0]])
    bins = reliability_bins(logits, torch.tensor([0, 1, 0]), n_bins=10)
    assert torch.softmax(logits.double(), 1)[0, 0].item() == 1.0
    assert bins.counts.tolist() == [0] * 4 + [1] + [0] * 4 + [2]
    assert bins.frequency[-1].item() == 0.5 and bins.mean_score[-1].item() == 1.0
    ece = expected_calibration_error(logits, torch.tensor([0, 1, 0]), n_bins=10).item()
    assert ece == pytest.approx(2 / 3 * 0.5 + 1 / 3 * 0.5, abs=1e-15)


def test_nominal_edges_go_to_the_lower_bin():
    """0.6 after log/softmax may come back one ulp above 0.6: it still belongs to (0.4, 0.6]."""
    q = torch.tensor([0.6, 0.4, 0.2, 0.8, 1.0, 0.0], dtype=torch.float64)
    logits = torch.stack([q.log().clamp_min(-1e4), (1 - q).log().clamp_min(-1e4)], dim=1)
    bins = reliability_bins(logits, torch.zeros(6, dtype=torch.long), n_bins=5, kind="class", class_index=0)
    assert bins.counts.tolist() == [2, 1, 1, 1, 1]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(1, 60),
    st.integers(1, 20),
    st.floats(0.1, 50),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["uniform", "quantile"]),
)
def test_norms_are_ordered(k, n, n_bins, scale, seed, strategy):
    """l1 <= l2 <= max (Jensen), all in [0, 1], and binning into 1 bin gives |accuracy - confidence|."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, k, generator=g, dtype=torch.float64)
    labels = torch.randint(0, k, (n,), generator=g)
    l1, l2, mx = (expected_calibration_error(logits, labels, n_bins, strategy, norm=nm).item() for nm in ("l1", "l2", "max"))
    assert 0 <= l1 <= l2 + 1e-12 and l2 <= mx + 1e-12 and mx <= 1 + 1e-12
    one_bin = expected_calibration_error(logits, labels, 1, strategy).item()
    assert one_bin == pytest.approx(abs(signed_calibration_error(logits, labels).item()), abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_bins": 0}, "n_bins"),
        ({"n_bins": 2.5}, "n_bins"),
        ({"strategy": "adaptive"}, "strategy"),
        ({"kind": "multiclass"}, "kind"),
        ({"kind": "binary"}, "K = 2"),
        ({"norm": "l3"}, "norm"),
        ({"kind": "classwise", "reduction": "median"}, "reduction"),
    ],
)
def test_calibration_error_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        expected_calibration_error(torch.randn(10, 3), torch.randint(0, 3, (10,)), **kwargs)


def test_reliability_bins_rejects_bad_options():
    z, y = torch.randn(10, 3), torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="class_index"):
        reliability_bins(z, y, kind="class")
    with pytest.raises(ValueError, match="class_index"):
        reliability_bins(z, y, kind="class", class_index=3)
    with pytest.raises(ValueError, match="one binary problem"):
        reliability_bins(z, y, kind="classwise")
    with pytest.raises(ValueError, match="labels must lie"):
        reliability_bins(z, y + 3)


# --------------------------------------------------------------------------- ESCE


def test_signed_calibration_error_is_accuracy_minus_confidence():
    logits, labels = random_scores(2000, 5, 3.0, seed=4)
    p = np_softmax(logits)
    expected = (p.argmax(1) == labels).mean() - p.max(1).mean()
    z, y = torch.from_numpy(logits), torch.from_numpy(labels)
    got = signed_calibration_error(z, y).item()
    assert got == pytest.approx(expected, abs=1e-14)
    bins = reliability_bins(z, y, n_bins=7, strategy="quantile")
    weighted = (bins.counts / bins.counts.sum() * (bins.frequency - bins.mean_score)).sum().item()
    assert weighted == pytest.approx(got, abs=1e-14)  # the binned form, whatever the bins


def test_signed_calibration_error_signs():
    """Over-confidence: negative top-label ESCE; the binary form cancels across the bins."""
    rs = np.random.RandomState(5)
    q1 = rs.uniform(0.05, 0.95, 20000)
    labels = torch.from_numpy((rs.uniform(size=q1.size) < q1).astype(np.int64))
    calibrated = torch.from_numpy(np.stack([np.log1p(-q1), np.log(q1)], axis=1))
    overconfident = 4 * calibrated
    assert signed_calibration_error(overconfident, labels).item() < -0.1
    assert signed_calibration_error(calibrated / 4, labels).item() > 0.1  # under-confident
    assert abs(signed_calibration_error(overconfident, labels, kind="binary").item()) < 0.01
    bins = reliability_bins(overconfident, labels, n_bins=10, kind="binary")
    gaps = bins.frequency - bins.mean_score
    assert gaps[0] > 0.05 and gaps[-1] < -0.05
    with pytest.raises(ValueError, match="kind"):
        signed_calibration_error(overconfident, labels, kind="classwise")


# --------------------------------------------------------------------------- ECD


def binary_logits(p: float) -> torch.Tensor:
    return torch.tensor([[math.log1p(-p), math.log(p)]], dtype=torch.float64)


# Reference notes C.4 (binary, natural log): (p_hat of class 1, label, ECD)
SUMLER = [
    (0.5, 0, 0.0), (0.5, 1, 0.0), (0.9, 1, -0.219722), (0.9, 0, 1.977502), (0.1, 0, -0.219722),
    (0.1, 1, 1.977502), (0.99, 1, -0.045951), (0.99, 0, 4.549169), (1e-4, 1, 9.209319),
    (0.9999, 0, 9.209319), (0.62, 1, -0.186028), (0.7868, 1, -0.278384),
]


@pytest.mark.parametrize("p, label, value", SUMLER)
def test_ecd_single_sample_values(p, label, value):
    got = entropic_calibration_difference(binary_logits(p), torch.tensor([label])).item()
    assert got == pytest.approx(value, abs=5e-7)
    assert got == pytest.approx((p - label) * math.log(p / (1 - p)), abs=1e-12)  # Sumler eq. 15


def test_ecd_minimum():
    p = torch.linspace(0.5, 0.99, 49001, dtype=torch.float64)
    logits = torch.stack([torch.log1p(-p), p.log()], dim=1)
    values = ecd_per_sample(torch.log_softmax(logits, 1), torch.ones_like(p, dtype=torch.long))
    assert values.min().item() == pytest.approx(-0.278465, abs=5e-7)
    assert p[values.argmin()].item() == pytest.approx(0.782188, abs=2e-5)


def test_ecd_is_exact_and_finite_at_saturation():
    logits = torch.tensor([[0.0, -1e4], [0.0, -1e4]], dtype=torch.float64)
    per_sample = ecd_per_sample(torch.log_softmax(logits, 1), torch.tensor([0, 1]))
    assert per_sample[0].item() == 0.0
    assert per_sample[1].item() == pytest.approx(1e4)


def test_ecd_identities():
    probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])
    assert entropic_calibration_difference(probs.log(), labels).item() == pytest.approx(-0.126973, abs=5e-7)
    three = torch.tensor([[0.3, 0.7]], dtype=torch.float64).log()
    assert entropic_calibration_difference(three, torch.tensor([1])).item() == pytest.approx(-0.254189, abs=5e-7)


@pytest.mark.parametrize("n, k, scale", SHAPES)
def test_ecd_matches_numpy(n, k, scale):
    logits, labels = random_scores(n, k, scale, seed=k + 1)
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    expected = np.mean(-log_p[np.arange(n), labels] + (np.exp(log_p) * log_p).sum(axis=1))
    got = entropic_calibration_difference(torch.from_numpy(logits), torch.from_numpy(labels)).item()
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)



@pytest.mark.parametrize("k, scale", [(2, 3.0), (10, 2.0), (4, 1e4)])
def test_ecd_expectation_under_own_posteriors_is_zero(k, scale):
    """sum_y q_y ECD(q, y) = H(q) - H(q) = 0 for every prediction q (reference notes C.4)."""
    lp = torch.log_softmax(scale * torch.randn(50, k, dtype=torch.float64), 1)
    by_label = torch.stack([ecd_per_sample(lp, torch.full((50,), c)) for c in range(k)], dim=1)
    assert (lp.exp() * by_label).sum(1).abs().max().item() < 1e-12


def test_ecd_per_bin():
    """Sumler Table II, ResNet18 bins 7 and 8: single positive samples at 0.62 and 0.7868."""
    p = torch.tensor([0.62, 0.7868, 0.05, 0.02, 0.95, 0.97], dtype=torch.float64)
    labels = torch.tensor([1, 1, 0, 1, 1, 1])
    logits = torch.stack([torch.log1p(-p), p.log()], dim=1)
    per_bin = entropic_calibration_difference(logits, labels, n_bins=10, kind="binary")
    assert per_bin[6].item() == pytest.approx(-0.186028, abs=5e-7)
    assert per_bin[7].item() == pytest.approx(-0.278384, abs=5e-7)
    assert per_bin[1:6].tolist() == [0.0] * 5  # empty bins
    counts = reliability_bins(logits, labels, n_bins=10, kind="binary").counts
    total = entropic_calibration_difference(logits, labels).item()
    assert (counts * per_bin).sum().item() / 6 == pytest.approx(total, abs=1e-14)
    top = entropic_calibration_difference(logits, labels, n_bins=4, strategy="quantile")
    assert top.shape == (4,)
    with pytest.raises(ValueError, match="kind"):
        entropic_calibration_difference(logits, labels, n_bins=4, kind="classwise")


# --------------------------------------------------------------------------- real data


def test_resnet110_published_values(real):
    data = real("cifar10_resnet110_kangsepp")
    z, y = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    assert expected_calibration_error(z, y).item() == pytest.approx(0.0475, abs=5e-5)
    assert expected_calibration_error(z, y, kind="classwise", reduction="sum").item() == pytest.approx(0.098, abs=5e-4)
    assert cross_entropy(z, y).item() == pytest.approx(0.3583, abs=5e-5)
    assert error_rate(z, y).item() == pytest.approx(0.0644, abs=5e-5)


# ../shared/data/real/SOURCES.md, inventory: accuracy, NLL (nats), Brier (summed over classes) and
# top-label ECE (%, 15 bins) of every file as stored
SOURCES_INVENTORY = {
    "cifar10_resnet110_kangsepp": (0.9356, 0.3583, 0.1102, 4.75),
    "cifar10_lenet5_netcal": (0.5308, 1.3699, 0.6142, 10.79),
    "cifar10_wrn16-4_netcal": (0.9109, 0.3782, 0.1439, 5.37),
    "cifar100_lenet5_netcal": (0.1246, 3.8131, 0.9520, 1.49),
    "cifar10_resnet20_ferrer": (0.9260, 0.2815, 0.1187, 3.90),
    "cifar10_vgg19bn_ferrer": (0.9391, 0.3519, 0.1114, 5.00),
    "cifar10_repvgg-a2_ferrer": (0.9527, 0.2122, 0.0800, 3.17),
    "cifar100_resnet20_ferrer": (0.6883, 1.2253, 0.4453, 10.34),
    "cifar100_vgg19bn_ferrer": (0.7387, 1.8048, 0.4449, 19.68),
    "cifar100_repvgg-a2_ferrer": (0.7750, 0.9207, 0.3237, 5.58),
    "cifar10_resnet50_ferrer-old": (0.8613, 0.7897, 0.2392, 10.69),
    "sst2_gpt2-0shot_ferrer": (0.5865, 0.6357, 0.4602, 20.00),
    "sst2_gpt2-4shot_ferrer": (0.5030, 0.7440, 0.5592, 34.40),
    "adrenalmnist3d_resnet50_ferrer": (0.7852, 0.5038, 0.2996, 11.08),
    "fvcaus_xvector-plda_ferrer": (0.9326, 0.1711, 0.0996, 1.77),
}


@pytest.mark.parametrize("name", sorted(SOURCES_INVENTORY))
def test_sources_inventory_row(real, name):
    accuracy, nll, brier, ece = SOURCES_INVENTORY[name]
    data = real(name)
    z, y = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    assert 1 - error_rate(z, y).item() == pytest.approx(accuracy, abs=5e-5)
    assert cross_entropy(z, y).item() == pytest.approx(nll, abs=5e-5)
    assert brier_score(z, y).item() == pytest.approx(brier, abs=5e-5)
    assert 100 * expected_calibration_error(z, y, n_bins=15).item() == pytest.approx(ece, abs=5e-3)


# Ferrer & Ramos (TMLR 2025) Table 2, raw column: normalised cross-entropy and top-label ECE (%, 15 bins)
FERRER_TABLE2 = {
    "cifar10_resnet20_ferrer": (0.122, 3.9),
    "cifar10_vgg19bn_ferrer": (0.153, 5.0),
    "cifar10_repvgg-a2_ferrer": (0.092, 3.2),
    "cifar100_resnet20_ferrer": (0.266, 10.3),
    "cifar100_vgg19bn_ferrer": (0.392, 19.7),
    "cifar100_repvgg-a2_ferrer": (0.200, 5.6),
    "sst2_gpt2-0shot_ferrer": (0.917, 20.0),
    "sst2_gpt2-4shot_ferrer": (1.073, 34.4),
    "adrenalmnist3d_resnet50_ferrer": (0.931, 11.1),
    "fvcaus_xvector-plda_ferrer": (1.966, 1.8),
    "agnews_gpt2-0shot_ferrer": (0.814, 18.4),
}


@pytest.mark.parametrize("name", sorted(FERRER_TABLE2))
def test_ferrer_ramos_table2_raw(real, name):
    data = real(name)
    z, y = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    nce, ece = FERRER_TABLE2[name]
    assert cross_entropy(z, y, normalize=True).item() == pytest.approx(nce, abs=5e-4)
    assert 100 * expected_calibration_error(z, y).item() == pytest.approx(ece, abs=0.05)


@pytest.mark.parametrize("n_bins", [1, 2, 10, 15, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_bin_indices_equal_the_binary_search(n_bins, dtype):
    edges = uniform_edges(n_bins)
    near_edges = torch.cat([edges, edges * (1 + 1e-12), torch.nextafter(edges * (1 + 1e-12), torch.tensor(2.0, dtype=torch.float64))])
    scores = torch.cat([
        torch.rand(20_000, dtype=torch.float64, generator=torch.Generator().manual_seed(n_bins)),
        near_edges,
        torch.nextafter(near_edges, torch.tensor(-1.0, dtype=torch.float64)),
        torch.tensor([0.0, 1.0, float("nan")], dtype=torch.float64),
    ]).clamp(0, 1).to(dtype).unsqueeze(1)
    assert torch.equal(uniform_bin_indices(scores, n_bins), bin_indices(scores, edges))


@pytest.mark.parametrize(
    "name",
    ["expected_calibration_error", "debiased_calibration_error", "sweep_calibration_error", "reliability_bins",
     "posterior_quality", "murphy_decomposition"],
)
def test_binned_metrics_of_logits_that_carry_a_graph(name):
    """Model outputs computed with gradients on: the per-bin sums were written in place into a
    view of them ("A view was created in no_grad mode ..."), or with out=, which autograd refuses."""
    import torchcal.functional.debiased_ece
    import torchcal.functional.score_decomposition

    modules = (torchcal.functional, torchcal.functional.debiased_ece, torchcal.functional.score_decomposition)
    metric = next(getattr(m, name) for m in modules if hasattr(m, name))
    logits = torch.nn.Linear(8, 4)(torch.randn(300, 8, generator=torch.Generator().manual_seed(7)))
    labels = torch.arange(300) % 4
    with_graph, without = metric(logits, labels), metric(logits.detach(), labels)
    if not isinstance(without, (tuple, torch.Tensor)):  # ReliabilityBins, a dataclass
        with_graph, without = tuple(vars(with_graph).values()), tuple(vars(without).values())
    torch.testing.assert_close(with_graph, without)


def test_numpy_integer_bin_counts_and_messages_that_offer_only_accepted_kinds():
    """``n_bins=np.int64(15)`` (from np.arange, a config) was refused as not "a positive integer";
    ``kind="binary"`` with K = 3 suggested kind="class" / "classwise" to functions and metrics
    that refuse them."""
    from torchcal.functional import entropic_calibration_difference, expected_calibration_error

    logits, labels = torch.randn(60, 3, dtype=torch.float64), torch.arange(60) % 3
    for n_bins in np.arange(14, 16):
        assert float(expected_calibration_error(logits, labels, n_bins=n_bins)) == float(
            expected_calibration_error(logits, labels, n_bins=int(n_bins)))
        metric = torchcal.metrics.ExpectedCalibrationError(3, n_bins=n_bins)
        metric.update(logits, labels)
        assert float(metric.compute()) == pytest.approx(float(expected_calibration_error(logits, labels, n_bins=int(n_bins))), rel=1e-13)
    with pytest.raises(ValueError, match=r'K = 3; use kind="top-label" or kind="classwise"\.$'):
        expected_calibration_error(logits, labels, kind="binary")
    with pytest.raises(ValueError, match=r'K = 3; use kind="top-label"\.$'):
        entropic_calibration_difference(logits, labels, n_bins=5, kind="binary")
    for metric in (torchcal.metrics.SignedCalibrationError(kind="binary"), torchcal.metrics.EntropicCalibrationDifference(n_bins=5, kind="binary")):
        with pytest.raises(ValueError, match=r'K = 3; use kind="top-label"\.$'):
            metric.update(logits, labels)
    with pytest.raises(ValueError, match=r'K = 3; use kind="top-label"\.$'):
        torchcal.metrics.SignedCalibrationError(3, kind="binary")


def test_metric_constructors_and_bins_name_misused_arguments():
    """A top-label metric's ``reliability_bins(2)`` returned the top-label bins (and
    ``plot_reliability(class_index=2)`` drew them), a classwise one took ``True`` for class 1 and
    returned bins of shape (1, 3, 15); ``num_classes=None`` with ``kind="binary"`` said "use
    classwise", and the debiased error's ``norm=`` raised Python's "got multiple values"."""
    from torchcal.metrics import DebiasedCalibrationError, ExpectedCalibrationError, SmoothCalibrationError

    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(300, 3, generator=gen), torch.randint(0, 3, (300,), generator=gen)
    top = ExpectedCalibrationError(3)
    top.update(logits, labels)
    with pytest.raises(ValueError, match='class_index picks a class of kind="classwise"; this metric is kind="top-label"'):
        top.reliability_bins(2)
    assert top.reliability_bins().counts.shape == (15,)
    classwise = ExpectedCalibrationError(3, kind="classwise")
    classwise.update(logits, labels)
    with pytest.raises(ValueError, match=r"needs an integer class_index in \[0, 3\), got True"):
        classwise.reliability_bins(True)
    assert classwise.reliability_bins(np.int64(1)).counts.shape == (15,)
    torch.testing.assert_close(classwise.reliability_bins(torch.tensor(2)).counts, classwise.reliability_bins(2).counts)
    for metric in (ExpectedCalibrationError, SmoothCalibrationError):
        with pytest.raises(ValueError, match='kind="binary" scores class 1 of K = 2 classes: pass num_classes=2'):
            metric(None, kind="binary")
    with pytest.raises(ValueError, match="an l2 error.*leave norm out"):
        DebiasedCalibrationError(3, norm="l1")
