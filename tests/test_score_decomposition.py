"""CORP and Murphy decompositions against scikit-learn's isotonic regression and NumPy loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.isotonic import IsotonicRegression, isotonic_regression

from torchcal.functional import brier_score, cross_entropy
from torchcal.functional.score_decomposition import (
    corp_decomposition,
    corp_recalibration,
    corp_reliability_curve,
    murphy_decomposition,
)
from torchcal.metrics.score_decomposition import MurphyDecomposition


def _score(name: str, p: np.ndarray, y: np.ndarray) -> float:
    if name == "brier":
        return float(np.mean((p - y) ** 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(y == 1, -np.log(p), -np.log(1 - p))
    return float(np.mean(np.where(((y == 1) & (p == 1)) | ((y == 0) & (p == 0)), 0.0, terms)))


def _corp_numpy(p: np.ndarray, y: np.ndarray, name: str) -> tuple[float, float, float, float]:
    recalibrated = IsotonicRegression(y_min=0, y_max=1).fit(p, y).predict(p)
    s, s_hat, unc = _score(name, p, y), _score(name, recalibrated, y), _score(name, np.full_like(p, y.mean()), y)
    return s, s - s_hat, unc - s_hat, unc


@pytest.mark.parametrize("score", ["brier", "log"])
@pytest.mark.parametrize("name", ["adrenalmnist3d_resnet50_ferrer", "sst2_gpt2-4shot_ferrer", "cifar10_resnet110_kangsepp"])
def test_corp_matches_sklearn_isotonic(real, name, score):
    data = real(name)
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    probs = torch.softmax(logits.double(), 1).numpy()
    if probs.shape[1] == 2:
        kind, p, y = "binary", probs[:, 1], (data["labels"] == 1).astype(float)
    else:
        kind, p, y = "top-label", probs.max(1), (probs.argmax(1) == data["labels"]).astype(float)
    result = corp_decomposition(logits, labels, score=score, kind=kind)
    np.testing.assert_allclose([float(v) for v in result], _corp_numpy(p, y, score), rtol=1e-9, atol=1e-12)
    assert float(result.miscalibration) >= 0 and float(result.discrimination) >= 0
    assert float(result.score) == pytest.approx(float(result.miscalibration - result.discrimination + result.uncertainty), abs=1e-12)


def test_corp_takes_any_proper_score_and_ignores_row_order(synthetic):
    scores, y = synthetic(2, 700, seed=3)
    logits, labels = torch.from_numpy(scores) / 3, torch.from_numpy(y)
    spherical = lambda p, t: -(t * p + (1 - t) * (1 - p)) / torch.sqrt(p**2 + (1 - p) ** 2)
    result = corp_decomposition(logits, labels, score=spherical, kind="binary")
    assert float(result.score) == pytest.approx(float(result.miscalibration - result.discrimination + result.uncertainty), abs=1e-12)
    permutation = torch.randperm(700)
    other = corp_decomposition(logits[permutation], labels[permutation], score=spherical, kind="binary")
    torch.testing.assert_close(torch.stack(list(result)), torch.stack(list(other)), rtol=1e-12, atol=1e-12)
    assert float(corp_decomposition(logits.float(), labels, kind="binary").miscalibration) == pytest.approx(
        float(corp_decomposition(logits, labels, kind="binary").miscalibration), rel=1e-5)


@pytest.mark.parametrize("kind", ["binary", "top-label"])
def test_corp_log_score_is_exact_where_a_wrong_forecast_rounds_to_one(kind):
    # log-odds of 40 against the truth: the probability rounds to 1 in float64, and 1 - p to 0
    logits = torch.tensor([[0.0, 40.0], [0.0, -2.0], [0.0, 1.0], [0.0, -1.0], [0.0, 30.0], [30.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    result = corp_decomposition(logits, labels, score="log", kind=kind)
    # every forecast's log score from its exact log-odds t: log(1 + e^-t) where it came true, else log(1 + e^t)
    t = logits[:, 1] - logits[:, 0] if kind == "binary" else (logits[:, 1] - logits[:, 0]).abs()
    happened = labels == 1 if kind == "binary" else logits.argmax(1) == labels
    expected = np.logaddexp(0.0, np.where(happened.numpy(), -t.numpy(), t.numpy())).mean()
    assert float(result.score) == pytest.approx(expected, rel=1e-14)
    if kind == "binary":
        assert float(result.score) == pytest.approx(float(cross_entropy(logits, labels)), rel=1e-14)
    assert float(result.score) == pytest.approx(float(result.miscalibration - result.discrimination + result.uncertainty), rel=1e-14)
    assert float(corp_decomposition(logits.float(), labels, score="log", kind=kind).score) == pytest.approx(expected, rel=1e-7)


def test_murphy_matches_numpy_and_equals_brier_for_binned_forecasts(real):
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits"]) / 2.395, torch.from_numpy(data["labels"])
    probs, y = torch.softmax(logits.double(), 1).numpy(), data["labels"]
    rel = res = unc = 0.0
    for k in range(10):
        p, t = probs[:, k], (y == k).astype(float)
        index = np.clip(np.ceil(p * 15 * (1 - 1e-13)).astype(int) - 1, 0, 14)
        for m in range(15):
            inside = index == m
            if inside.any():
                rel += inside.mean() * (p[inside].mean() - t[inside].mean()) ** 2
                res += inside.mean() * (t[inside].mean() - t.mean()) ** 2
        unc += t.mean() * (1 - t.mean())
    result = murphy_decomposition(logits, labels)
    np.testing.assert_allclose([float(v) for v in result], [rel, res, unc], rtol=1e-9)
    # forecasts constant within bins: REL - RES + UNC is exactly the Brier score
    generator = torch.Generator().manual_seed(0)
    q = (torch.randint(0, 10, (3000,), generator=generator).double() + 0.5) / 10
    binary = torch.stack([(1 - q).log(), q.log()], 1)
    targets = torch.bernoulli(q, generator=generator).long()
    rel, res, unc = murphy_decomposition(binary, targets, n_bins=10)
    assert float(rel - res + unc) == pytest.approx(float(brier_score(binary, targets)), abs=1e-12)


def test_streaming_murphy_equals_functional(synthetic):
    scores, y = synthetic(4, 1000, seed=5)
    logits, labels = torch.from_numpy(scores) / 3, torch.from_numpy(y)
    metric = MurphyDecomposition(4, n_bins=10)
    for chunk in torch.arange(1000).split(300):
        metric.update(logits[chunk], labels[chunk])
    torch.testing.assert_close(metric.compute(), torch.stack(list(murphy_decomposition(logits, labels, n_bins=10))))


def test_bad_input():
    logits, labels = torch.randn(10, 3), torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="score"):
        corp_decomposition(logits, labels, score="spherical")
    with pytest.raises(ValueError, match="kind"):
        corp_decomposition(logits, labels, kind="classwise")
    with pytest.raises(ValueError, match="kind"):
        murphy_decomposition(logits, labels, kind="class")


def test_pav_steps_between_close_scores_fall_between_them():
    """Two scores just beyond the tie tolerance (17 ulps of 1) in different blocks: the boundary lies
    between them. (Scores one ulp apart had no midpoint, and the boundary rounded onto the lower
    score and gave it the upper block's value, CORP then had negative MCB and DSC; they are now
    one tie.)"""
    from torchcal.functional.isotonic import pool_adjacent_violators

    rs = np.random.RandomState(0)
    for _ in range(100):
        base = rs.uniform(0.05, 0.95, 12)
        x = np.concatenate([base, base + 17 * np.finfo(np.float64).eps])  # every score just past a tie with its neighbour
        y = (rs.uniform(size=x.size) < x).astype(np.float64)
        boundaries, values = pool_adjacent_violators(x, y, np.ones_like(x))
        fitted = values[np.searchsorted(boundaries, x, side="right") - 1]
        order = np.argsort(x)  # distinct scores: sklearn's PAV on the sorted targets is the reference
        np.testing.assert_allclose(fitted[order], isotonic_regression(y[order]), rtol=0, atol=1e-12)
        # one ulp apart: tied, as sklearn pools equal scores
        x = np.concatenate([base, np.nextafter(base, 1.0)])
        boundaries, values = pool_adjacent_violators(x, y, np.ones_like(x))
        fitted = values[np.searchsorted(boundaries, x, side="right") - 1]
        reference = IsotonicRegression().fit(np.concatenate([base, base]), y).predict(np.concatenate([base, base]))
        np.testing.assert_allclose(fitted, reference, rtol=0, atol=1e-12)


def test_corp_pools_confidences_equal_up_to_round_off():
    """K = 3 posteriors (0.6, 0.3, 0.1) and (0.6, 0.2, 0.2) have one confidence, 0.6, which the
    log-probabilities give as 0.6 and one ulp below: PAV fitted them apart (their accuracies differ,
    0.7 and 0.5), MCB 0.0088 and DSC 0.0082 against 0.00053 and 0 (a review's reproducer)."""
    from conftest import one_confidence_two_accuracies

    p, y = one_confidence_two_accuracies()
    confidence, correct = p.max(1), (y == 0).astype(np.float64)
    expected = _corp_numpy(confidence, correct, "brier")
    got = corp_decomposition(torch.from_numpy(np.log(p)), torch.from_numpy(y))
    np.testing.assert_allclose([float(v) for v in got], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("score", ["brier", "log"])
def test_corp_keeps_the_order_of_confident_scores_that_round_to_one(real, score):
    """A sharpened ResNet-110 (logits x 3): 6,289 of 10,000 confidences round to 1 in float64, and
    PAV on the probabilities pooled their right and wrong rows (log DSC 0.0873 against 0.0920).
    CORP is invariant under a monotone map of the scores, so the reference runs scikit-learn's
    isotonic regression on the exact top-label log-odds."""
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = 3 * torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"])
    probs = torch.softmax(logits, 1)
    assert int((probs.max(1).values == 1).sum()) > 1000
    log_odds = (logits.max(1).values - torch.logsumexp(logits.scatter(1, logits.argmax(1, keepdim=True), -np.inf), 1)).numpy()
    p, y = probs.max(1).values.numpy(), (logits.argmax(1) == labels).double().numpy()
    recalibrated = IsotonicRegression(y_min=0, y_max=1).fit(log_odds, y).predict(log_odds)
    if score == "brier":
        s = float(np.mean((p - y) ** 2))
    else:
        s = float(np.mean(np.logaddexp(0.0, np.where(y == 1, -log_odds, log_odds))))
    s_hat, unc = _score(score, recalibrated, y), _score(score, np.full_like(p, y.mean()), y)
    got = corp_decomposition(logits, labels, score=score)
    np.testing.assert_allclose([float(v) for v in got], [s, s - s_hat, unc - s_hat, unc], rtol=1e-9, atol=1e-12)
    curve_x, curve_y = corp_reliability_curve(logits, labels)
    order = np.argsort(log_odds, kind="stable")
    np.testing.assert_allclose(curve_y.numpy(), recalibrated[order], rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve_x.numpy(), np.sort(p), rtol=0, atol=1e-15)  # p is the log-odds' order to round-off


def test_corp_finds_the_perfect_ranking_of_distinct_log_odds():
    # log-odds 60, -60, 50: the probabilities 1 - 9e-27 and 1 - 2e-22 both round to 1
    logits = torch.tensor([[0.0, 60.0], [0.0, -60.0], [0.0, 50.0]], dtype=torch.float64)
    result = corp_decomposition(logits, torch.tensor([1, 0, 0]), "log", kind="binary")
    uncertainty = -(np.log(1 / 3) / 3 + 2 * np.log(2 / 3) / 3)
    np.testing.assert_allclose([float(v) for v in result], [50 / 3, 50 / 3, uncertainty, uncertainty], rtol=1e-14)


@pytest.mark.parametrize(
    "scores, targets, message",
    [
        ([0.1, float("nan"), 0.3], [0.0, 1.0, 1.0], "NaN or infinite"),  # silently [0, 1, 1]
        ([0.1, 0.2, 0.3], [0.0, 1.0], "same length"),  # NumPy's IndexError
        ([[0.1, 0.2]], [[0.0, 1.0]], "1-D"),
        ([0.1, 0.2], [0.0, 2.0], "0 or 1"),
    ],
)
def test_corp_recalibration_names_bad_input(scores, targets, message):
    with pytest.raises(ValueError, match=message):
        corp_recalibration(torch.tensor(scores), torch.tensor(targets))
