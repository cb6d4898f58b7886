"""Detection metrics on the real binary sets against NumPy/scikit-learn computations."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from sklearn.isotonic import IsotonicRegression
from sklearn.metrics import det_curve as sklearn_det_curve
from sklearn.metrics import roc_curve

from torchcal.functional import cross_entropy
from torchcal.functional.detection import (
    cllr,
    det_curve,
    detection_cost,
    equal_error_rate,
    log_likelihood_ratios,
    min_cllr,
    min_detection_cost,
)
from torchcal.metrics import Cllr, DetectionCost
from torchcal.plots import bayes_risk_sweep

NAMES = ["fvcaus_xvector-plda_ferrer", "adrenalmnist3d_resnet50_ferrer", "sst2_gpt2-0shot_ferrer"]


def _load(real, name):
    data = real(name)
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    log_probs = torch.log_softmax(logits.double(), 1).numpy()
    prior = labels.double().mean().item()
    llr = log_probs[:, 1] - log_probs[:, 0] - math.log(prior / (1 - prior))
    return logits, labels, llr, data["labels"] == 1


def _cllr_numpy(llr: np.ndarray, target: np.ndarray) -> float:
    return (np.mean(np.logaddexp(0, -llr[target])) + np.mean(np.logaddexp(0, llr[~target]))) / (2 * np.log(2))


def _rocch_eer_numpy(scores: np.ndarray, target: np.ndarray) -> float:
    """Lower convex hull of sklearn's ROC points in (Pfa, Pmiss), crossed with Pfa = Pmiss."""
    fpr, tpr, _ = roc_curve(target, scores, drop_intermediate=False)
    points = sorted(set(zip(fpr, 1 - tpr)))
    hull: list[tuple[float, float]] = []
    for p in points:  # monotone chain, lower hull
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1]) - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0]) <= 0:
            hull.pop()
        hull.append(p)
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if (x1 - y1) * (x2 - y2) <= 0:  # the segment meets the diagonal
            if (x2 - y2) == (x1 - y1):
                return x1
            u = (x1 - y1) / ((x1 - y1) - (x2 - y2))
            return x1 + u * (x2 - x1)
    raise AssertionError("the hull always crosses the diagonal")


@pytest.mark.parametrize("name", NAMES)
def test_cllr_and_min_cllr(real, name):
    logits, labels, llr, target = _load(real, name)
    assert float(cllr(logits, labels)) == pytest.approx(_cllr_numpy(llr, target), rel=1e-9)
    # Cllr is the cross-entropy at flat priors of the LLRs, in bits
    flat = torch.stack([torch.zeros(len(llr), dtype=torch.float64), torch.from_numpy(llr)], 1)
    assert float(cllr(logits, labels)) == pytest.approx(float(cross_entropy(flat, labels, priors=torch.tensor([0.5, 0.5]))) / math.log(2), rel=1e-9)
    fitted = IsotonicRegression(y_min=0, y_max=1).fit(llr, target.astype(float)).predict(llr)
    prior = target.mean()
    with np.errstate(divide="ignore"):
        optimal = np.log(fitted) - np.log1p(-fitted) - np.log(prior / (1 - prior))
    assert float(min_cllr(logits, labels)) == pytest.approx(_cllr_numpy(optimal, target), rel=1e-9)
    assert 0 <= float(min_cllr(logits, labels)) <= float(cllr(logits, labels))


@pytest.mark.parametrize("name", NAMES)
def test_equal_error_rate_is_that_of_the_roc_convex_hull(real, name):
    logits, labels, llr, target = _load(real, name)
    assert float(equal_error_rate(logits, labels)) == pytest.approx(_rocch_eer_numpy(llr, target), abs=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_dcf_actual_minimum_and_the_bayes_risk_curve(real, name):
    logits, labels, llr, target = _load(real, name)
    fpr, tpr, _ = roc_curve(target, llr, drop_intermediate=False)
    for p_target, c_miss, c_fa in ((0.5, 1, 1), (0.01, 1, 1), (0.2, 10, 1)):
        accept = llr > math.log(c_fa * (1 - p_target) / (c_miss * p_target))
        actual = c_miss * p_target * np.mean(~accept[target]) + c_fa * (1 - p_target) * np.mean(accept[~target])
        norm = min(c_miss * p_target, c_fa * (1 - p_target))
        assert float(detection_cost(logits, labels, p_target, c_miss, c_fa)) == pytest.approx(actual / norm, rel=1e-12)
        assert float(detection_cost(logits, labels, p_target, c_miss, c_fa, normalize=False)) == pytest.approx(actual, rel=1e-12)
        minimum = np.min(c_miss * p_target * (1 - tpr) + c_fa * (1 - p_target) * fpr) / norm
        assert float(min_detection_cost(logits, labels, p_target, c_miss, c_fa)) == pytest.approx(minimum, rel=1e-12)
    # the normalised actual DCF at effective prior P is the Bayes-risk curve at logit(P)
    t = torch.tensor([-3.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    _, nec = bayes_risk_sweep(logits, labels, class_index=1, log_odds=t)
    dcf = [float(detection_cost(logits, labels, float(torch.sigmoid(x)))) for x in t]
    np.testing.assert_allclose(dcf, nec.numpy(), rtol=1e-9)


def test_det_curve_contains_sklearns_points(real):
    logits, labels, llr, target = _load(real, "adrenalmnist3d_resnet50_ferrer")
    curve = det_curve(logits, labels)
    ours = set(zip(np.round(curve.false_alarm.numpy(), 12), np.round(curve.miss.numpy(), 12)))
    fpr, fnr, _ = sklearn_det_curve(target, llr)
    assert set(zip(np.round(fpr, 12), np.round(fnr, 12))) <= ours
    assert (curve.false_alarm[0], curve.miss[0], curve.false_alarm[-1], curve.miss[-1]) == (1, 0, 0, 1)


def test_priors_shift_the_llrs_and_order_and_dtype_do_not_matter(real):
    logits, labels, llr, _ = _load(real, "sst2_gpt2-0shot_ferrer")
    shifted = log_likelihood_ratios(logits, labels, priors=torch.tensor([0.5, 0.5]))
    np.testing.assert_allclose(shifted.numpy() - llr, math.log(labels.double().mean().item() / (1 - labels.double().mean().item())), atol=1e-9)
    permutation = torch.randperm(labels.shape[0])
    for fn in (cllr, min_cllr, equal_error_rate, detection_cost, min_detection_cost):
        reference = float(fn(logits, labels))
        assert float(fn(logits[permutation], labels[permutation])) == pytest.approx(reference, rel=1e-12)
        assert float(fn(logits.double(), labels)) == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_streaming_cllr_and_dcf_equal_numpy_and_the_functional(real, name):
    """Given the priors the posteriors assume, the classes keep per-class sums; without, the data's
    class frequencies, as the functional form. Batches, row order and float32 change nothing."""
    logits, labels, _, target = _load(real, name)
    log_probs = torch.log_softmax(logits.double(), 1).numpy()
    priors = torch.tensor([0.3, 0.7], dtype=torch.float64)
    llr = log_probs[:, 1] - log_probs[:, 0] - math.log(0.7 / 0.3)
    accept = llr > math.log(1 * 0.8 / (10 * 0.2))  # target prior 0.2, C_miss 10, C_fa 1
    actual_dcf = (10 * 0.2 * np.mean(~accept[target]) + 0.8 * np.mean(accept[~target])) / min(10 * 0.2, 0.8)
    cases = [
        (lambda: Cllr(priors=priors), _cllr_numpy(llr, target), cllr(logits.double(), labels, priors)),
        (lambda: DetectionCost(0.2, 10.0, priors=priors), actual_dcf, detection_cost(logits.double(), labels, 0.2, 10.0, priors=priors)),
        (Cllr, None, cllr(logits.double(), labels)),
        (lambda: DetectionCost(0.2, 10.0), None, detection_cost(logits.double(), labels, 0.2, 10.0)),
    ]
    permutation = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(1))
    for make, reference, functional in cases:
        if reference is not None:
            assert float(functional) == pytest.approx(reference, rel=1e-12)
        for x, y, rel in ((logits.double(), labels, 1e-12), (logits.double()[permutation], labels[permutation], 1e-12),
                          (logits.float(), labels, 1e-6)):
            metric = make()
            for part in torch.arange(labels.shape[0]).tensor_split(3):
                metric.update(x[part], y[part])
            value = metric.compute()
            assert value.dtype == torch.float64 and float(value) == pytest.approx(float(functional), rel=rel), name
    one_class = Cllr(priors=priors)
    one_class.update(logits[labels == 1], labels[labels == 1])
    with pytest.raises(ValueError, match="both target"):
        one_class.compute()
    with pytest.raises(ValueError, match="target_prior"):
        DetectionCost(target_prior=0.0)


def test_bad_input():
    with pytest.raises(ValueError, match="K = 2"):
        cllr(torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1]))
    with pytest.raises(ValueError, match="both target"):
        equal_error_rate(torch.randn(4, 2), torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="target_prior"):
        detection_cost(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), target_prior=1.0)
    with pytest.raises(ValueError, match="positive"):
        min_detection_cost(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), cost_miss=0)


@pytest.mark.parametrize(
    "as_given",
    [list, np.array, lambda y: torch.tensor(y, dtype=torch.bool), lambda y: torch.tensor(y, dtype=torch.uint8),
     lambda y: torch.tensor(y, dtype=torch.int16)],
    ids=["list", "numpy", "bool", "uint8", "int16"],
)
def test_detection_metrics_take_labels_of_any_integer_kind(as_given):
    """The labels were validated for the LLRs, then used as given: lists and NumPy arrays had no
    ``.to``, and bool or uint8 tensors failed in ``index_add_``."""
    logits = torch.tensor([[0.0, 1.0], [0.0, -1.0], [0.0, 0.5], [0.0, -2.0], [0.0, 0.3]], dtype=torch.float64)
    labels = [1, 0, 0, 0, 1]
    for metric in (cllr, min_cllr, detection_cost, min_detection_cost, equal_error_rate):
        assert float(metric(logits, as_given(labels))) == float(metric(logits, torch.tensor(labels)))


@pytest.mark.parametrize("priors", [[1.0, 0.0], [0.0, 1.0]])
def test_priors_with_a_zero_are_refused(priors):
    """log(P1 / P0) is undefined: cllr and Cllr returned inf, detection_cost a plausible 1.0."""
    z, y = torch.randn(100, 2), torch.arange(100) % 2
    for call in (lambda: cllr(z, y, priors=torch.tensor(priors)), lambda: detection_cost(z, y, priors=torch.tensor(priors)),
                 lambda: Cllr(priors=torch.tensor(priors)), lambda: DetectionCost(priors=torch.tensor(priors))):
        with pytest.raises(ValueError, match="priors must both be positive"):
            call()


@pytest.mark.parametrize("given_priors", [False, True])
def test_an_llr_on_the_bayes_threshold_is_a_miss_however_it_rounds(given_priors):
    """Posteriors of 1/2 at a target prior equal to the priors' P1: the LLR -log(P1 / P0) is the
    threshold log((1 - P1) / P1), but the two formulas round apart, and round-off decided (for
    27 of the 39 values P1 = n / 40 a miss, as documented, for the other 12 a hit)."""
    for targets in range(1, 40):
        labels = (torch.arange(40) < targets).long()
        logits = torch.zeros(40, 2, dtype=torch.float64)
        p1 = targets / 40
        priors = torch.tensor([1 - p1, p1], dtype=torch.float64) if given_priors else None
        # every target missed, no false alarm: Pmiss = 1, normalised by min(P1, 1 - P1)
        expected = p1 / min(p1, 1 - p1)
        assert float(detection_cost(logits, labels, target_prior=p1, priors=priors)) == pytest.approx(expected, rel=1e-12)
        if given_priors:
            metric = DetectionCost(target_prior=p1, priors=priors)
            metric.update(logits, labels)
            assert float(metric.compute()) == pytest.approx(expected, rel=1e-12)
        assert float(bayes_risk_sweep(logits, labels, log_odds=math.log(p1 / (1 - p1)), priors=priors)[1][0]) == pytest.approx(
            expected, rel=1e-12)


def test_detection_metrics_take_num_classes_2_as_the_others_do():
    """``Cllr(num_classes=2)`` raised TypeError: multiple values for argument 'num_classes'."""
    logits, labels = torch.tensor([[0.0, 1.0], [0.0, -1.0], [0.0, 0.5]]), torch.tensor([1, 0, 0])
    for cls in (Cllr, DetectionCost):
        metric = cls(num_classes=2)
        metric.update(logits, labels)
        reference = cls()
        reference.update(logits, labels)
        assert float(metric.compute()) == float(reference.compute())
        with pytest.raises(ValueError, match="binary metric.*num_classes must be 2, got 3"):
            cls(num_classes=3)


def test_llrs_equal_up_to_round_off_are_one_score():
    """Ten LLRs from rows of logits offset by 3 randn come out as 43 distinct values: PAV and the
    DET curve took them apart (minCllr 0.89888 against 0.90134, 44 DET points for 10 LLRs, EER
    0.34828 against 0.34839; a review's reproducer). scikit-learn's PAV of the exact LLRs is the
    reference."""
    rs = np.random.default_rng(0)
    n = 2000
    llr = rs.integers(-5, 5, size=n) * 0.5
    y = (rs.random(n) < 1 / (1 + np.exp(-llr / 2))).astype(np.int64)
    exact = torch.from_numpy(np.stack([np.zeros(n), llr], 1))
    offset = exact + torch.from_numpy(3 * rs.normal(size=(n, 1)))
    labels = torch.from_numpy(y)
    p = IsotonicRegression(y_min=0, y_max=1).fit(llr, y).predict(llr)
    prior = y.mean()
    with np.errstate(divide="ignore"):
        pav_llr = np.log(p) - np.log1p(-p) - np.log(prior / (1 - prior))
    expected = (np.mean(np.logaddexp(0, -pav_llr[y == 1])) + np.mean(np.logaddexp(0, pav_llr[y == 0]))) / (2 * np.log(2))
    assert float(min_cllr(offset, labels)) == pytest.approx(expected, rel=1e-12)
    curve = det_curve(offset, labels)
    assert len(curve.miss) == len(np.unique(llr)) + 1
    for got, want in zip(curve, det_curve(exact, labels)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert float(equal_error_rate(offset, labels)) == pytest.approx(float(equal_error_rate(exact, labels)), rel=1e-12)


def test_an_llr_tied_with_the_bayes_threshold_is_a_miss():
    """LLRs tied (within 16 ulps of 1) with the Bayes threshold 0 are misses, so two LLRs that the
    minimum ties (0 and 3e-15) are not split by it: the actual DCF had come out 0 beside a minimum
    DCF of 1 (a review's reproducer), which no threshold can beat. (A chain of ties, 0, 3e-15,
    6e-15, 9e-15, which the minimum groups into one, can still be split: the streaming metric
    decides each score alone.)"""
    labels = torch.tensor([0, 1])
    for gap in (1e-16, 1e-15, 3e-15, 3.5e-15):
        logits = torch.tensor([[0.0, 0.0], [0.0, gap]], dtype=torch.float64)
        actual, minimum = float(detection_cost(logits, labels)), float(min_detection_cost(logits, labels))
        assert (actual, minimum) == (1.0, 1.0)
        metric = DetectionCost()
        metric.update(logits, labels)
        assert float(metric.compute()) == 1.0
    logits = torch.tensor([[0.0, 0.0], [0.0, 1e-14]], dtype=torch.float64)  # beyond the tie: separated by both
    assert float(detection_cost(logits, labels)) == float(min_detection_cost(logits, labels)) == 0.0


def test_llrs_with_given_priors_need_no_second_class():
    """With priors the LLRs do not read the labels, yet a batch of targets only was refused
    ("need both target and non-target samples"); without priors the class frequencies still need both."""
    logits = torch.tensor([[0.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    for labels in (torch.tensor([1, 1]), torch.tensor([0, 0])):
        llr = log_likelihood_ratios(logits, labels, priors=torch.tensor([0.25, 0.75]))
        torch.testing.assert_close(llr, torch.tensor([1.0, 2.0], dtype=torch.float64) - math.log(3), rtol=0, atol=1e-15)
        with pytest.raises(ValueError, match="both target"):
            log_likelihood_ratios(logits, labels)
        with pytest.raises(ValueError, match="both target"):
            cllr(logits, labels, priors=torch.tensor([0.25, 0.75]))
