"""Expected cost, Bayes decisions and Bayes risk against NumPy references and Ferrer's tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchcal.data.synthetic import ferrer_systems, gaussian_task
from torchcal.functional import (
    balanced_error_rate,
    bayes_decisions,
    bayes_risk,
    error_rate,
    expected_cost,
    zero_one_costs,
)
from torchcal.functional.decisions import _first_maximal_decisions, _first_near_maximal, _least_cost_decisions

# --------------------------------------------------------------------------- NumPy references


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_expected_cost(decisions, labels, costs, priors=None, normalize=False) -> float:
    """Ferrer eq. 4 from the confusion counts: EC = sum_ij c_ij P_i N_ij / N_i."""
    k, m = costs.shape
    counts = np.zeros((k, m))
    np.add.at(counts, (labels, decisions), 1)
    class_sizes = counts.sum(axis=1)
    p = class_sizes / class_sizes.sum() if priors is None else np.asarray(priors, dtype=float)
    rates = counts / np.maximum(class_sizes, 1)[:, None]
    ec = float((costs * p[:, None] * rates).sum())
    return ec / float((p @ costs).min()) if normalize else ec


def random_problem(n: int, k: int, m: int, scale: float, seed: int):
    rs = np.random.RandomState(seed)
    logits = scale * rs.standard_normal((n, k))
    labels = rs.randint(0, k, size=n)
    labels[:k] = np.arange(k)  # every class present
    costs = rs.uniform(0, 1, size=(k, m))
    priors = rs.dirichlet(np.ones(k))
    return logits, labels, costs, priors


CASES = [(400, 2, 2, 3.0), (300, 3, 5, 1.0), (2000, 1000, 1000, 5.0), (300, 4, 4, 1e4)]

# --------------------------------------------------------------------------- cost matrices


def test_zero_one_costs():
    assert torch.equal(zero_one_costs(3), torch.tensor([[0.0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.float64))
    with_abstain = zero_one_costs(3, abstain=0.25)
    assert with_abstain.shape == (3, 4) and torch.all(with_abstain[:, 3] == 0.25)
    with pytest.raises(ValueError, match="num_classes"):
        zero_one_costs(1)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="abstain must be a finite, non-negative cost"):
            zero_one_costs(2, abstain=bad)


# --------------------------------------------------------------------------- Bayes decisions


@pytest.mark.parametrize("n, k, m, scale", CASES)
def test_bayes_decisions_match_numpy(n, k, m, scale):
    logits, _, costs, _ = random_problem(n, k, m, scale, seed=k + m)
    expected = (np_softmax(logits) @ costs).argmin(axis=1)
    got = bayes_decisions(torch.from_numpy(logits).float(), torch.from_numpy(costs))
    assert got.dtype == torch.int64
    # float32 input is computed in float64: compare with NumPy on the same float32 values
    expected32 = (np_softmax(logits.astype(np.float32).astype(np.float64)) @ costs).argmin(axis=1)
    np.testing.assert_array_equal(got.numpy(), expected32)
    assert (got.numpy() == expected).mean() > 0.99


def test_bayes_decisions_ties_go_to_lowest_index():
    costs = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5]])
    even = torch.zeros(1, 2)  # expected costs (0.5, 0.5, 0.5): all tied
    assert bayes_decisions(even, costs).item() == 0
    assert bayes_decisions(torch.zeros(4, 5), zero_one_costs(5)).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(("dtype", "gap", "expensive"), [(torch.float64, 5e-12, 1e4), (torch.float32, 6e-8, 1e8)])
def test_a_decision_never_worth_taking_does_not_tie_the_others(dtype, gap, expensive):
    """The tie slack was K eps times the row's largest expected cost: an extra decision costing
    1e4 whatever the class tied decisions 1 and 0 of expected costs 0.4999999999975 and
    0.5000000000025 (NumPy), and decision 0 was taken (the 2 x 2 matrix alone takes 1)."""
    two = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    three = torch.cat([two, torch.full((2, 1), expensive, dtype=torch.float64)], dim=1)
    logits = torch.tensor([[0.0, gap]], dtype=dtype)
    q = torch.softmax(logits.double(), 1).numpy()
    assert int(np.argmin(q @ three.numpy(), axis=1)[0]) == 1
    assert bayes_decisions(logits, two).item() == bayes_decisions(logits, three).item() == 1
    labels = torch.tensor([1])
    assert bayes_risk(logits, labels, three).item() == bayes_risk(logits, labels, two).item() == 0.0


EPS64 = torch.finfo(torch.float64).eps
EPS64 = torch.finfo(torch.float64).eps


def zero_one_test_logits(k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (120, K) in ``dtype`` whose maximum is in the last column: random rows of three
    spreads and two offsets, exact ties planted in column 0, rows all equal, and near ties planted
    in column 0 at c times the product's slack (c = 0.01 and 0.1: tied; 10 and 100: not), with -inf
    in column 1 of every third row (K > 2). Also returns the planted near ties' rows and their c."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(40).double().unsqueeze(1)
    z = torch.randn(120, k, generator=g, dtype=torch.float64) * spread
    z -= z.amax(dim=1, keepdim=True)
    z[torch.arange(120), z.argmax(dim=1)] = z[:, -1].clone()
    z[:, -1] = 0.0  # the maximum, in the last column
    z[:40:2] += 1000.0  # large logits: only exact ties can be near (no planted near ties here)
    z[1:40:2, 0] = z[1:40:2, -1]  # exact ties
    z[40:50] = 5.0  # rows all equal
    near = torch.arange(60, 120)
    z[near, 0] = 0.0  # the slack of each row with its near tie in place, then the gap
    e = z[near].exp()
    slack = k * EPS64 * (e.sum(dim=1) - e.amin(dim=1))
    c = torch.tensor([0.01, 0.1, 10.0, 100.0], dtype=torch.float64).repeat(15)
    z[near, 0] = -c * slack
    if k > 2:
        z[::3, 1] = -math.inf
    return z.to(dtype), near, c


@pytest.mark.parametrize("k", [2, 3, 10, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_zero_one_decisions_without_the_product_equal_the_product(k, dtype):
    """The 0-1 Bayes decisions, from the logits, are those of softmax @ zero_one_costs(K) with its
    round-off slack: exact ties, near ties inside and outside the slack, -inf, low precision."""
    logits, near, c = zero_one_test_logits(k, dtype, seed=k)
    by_product = _least_cost_decisions(logits, zero_one_costs(k))
    assert torch.equal(_first_maximal_decisions(logits), by_product)
    finite = torch.isfinite(logits).all(dim=1)
    assert torch.equal(bayes_decisions(logits[finite], zero_one_costs(k)), by_product[finite])
    assert (by_product[1:40:2] == 0).all() and (by_product[40:50] == 0).all()  # the ties were ties
    if dtype == torch.float64:  # the near ties were (not) tied, as planted
        assert torch.equal(by_product[near] == 0, c < 1)


def test_zero_one_decisions_form_no_product(monkeypatch):
    """The error rates and the 0-1 Bayes risk, functional and streaming, decide by the logits."""
    import torchcal.functional.decisions as decisions
    from torchcal.functional.decisions import balanced_error_rate_terms, error_rate_terms
    from torchcal.metrics import BalancedErrorRate, BayesRisk, ErrorRate

    def product(*args):
        raise AssertionError("the 0-1 decisions formed the softmax @ costs product")

    monkeypatch.setattr(decisions, "_least_cost_decisions", product)
    logits, labels = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 1.0], [3.0, 3.0, 0.0]]), torch.tensor([0, 2, 1])
    priors = torch.tensor([0.2, 0.3, 0.5])
    assert error_rate(logits, labels).item() == pytest.approx(2 / 3)
    assert error_rate_terms(logits, labels).per_sample.tolist() == [0.0, 1.0, 1.0]
    assert balanced_error_rate(logits, labels).item() == pytest.approx(2 / 3)
    assert balanced_error_rate_terms(logits, labels).evaluate().item() == pytest.approx(2 / 3)
    assert bayes_risk(logits, labels, zero_one_costs(3), priors).item() == pytest.approx(0.8)
    for metric, expected in ((ErrorRate(3), 2 / 3), (BalancedErrorRate(3), 2 / 3), (BayesRisk(zero_one_costs(3), priors), 0.8)):
        metric.update(logits, labels)
        assert metric.compute().item() == pytest.approx(expected)
    with pytest.raises(AssertionError, match="product"):  # other costs still do
        bayes_decisions(logits, zero_one_costs(3, abstain=0.5))


def test_error_rates_need_no_class_by_class_matrix():
    """The error rates' state and work are O(K), not O(K^2): ErrorRate was BayesRisk with a (K, K)
    0-1 cost matrix, whose (K, K) counts, per-batch checks of the costs and options digest took
    0.3-0.5 s per batch of 16 rows and 1.8 GB at K = 4,000 (a review's measurement). Values equal a
    NumPy reference, with priors too, and the functional with priors equals the 0-1 Bayes risk."""
    from torchcal.metrics import BalancedErrorRate, ErrorRate

    k, n = 3000, 6000
    gen = torch.Generator().manual_seed(3)
    labels = torch.cat([torch.arange(k), torch.randint(0, k, (n - k,), generator=gen)])  # every class present
    logits = torch.randn(n, k, generator=gen)
    logits[torch.arange(0, n, 2), labels[::2]] += 4.0  # about half of them right
    priors = torch.rand(k, generator=gen, dtype=torch.float64) + 0.1
    priors /= priors.sum()
    errors = (logits.argmax(1) != labels).double().numpy()
    y = labels.numpy()
    class_rates = np.array([errors[y == c].mean() for c in range(k)])
    for metric, expected in ((ErrorRate(k), errors.mean()), (ErrorRate(k, priors=priors), float(priors.numpy() @ class_rates)),
                             (BalancedErrorRate(k), class_rates.mean())):
        assert sum(state.numel() for state in metric.metric_state.values()) <= 2 * k + 16
        for part in torch.arange(n).chunk(5):
            metric.update(logits[part], labels[part])
        assert metric.compute().item() == pytest.approx(expected, rel=1e-12)
    assert error_rate(logits, labels).item() == pytest.approx(errors.mean(), rel=1e-12)
    assert error_rate(logits, labels, priors).item() == pytest.approx(float(priors.numpy() @ class_rates), rel=1e-12)
    assert error_rate(logits, labels, priors).item() == pytest.approx(bayes_risk(logits, labels, zero_one_costs(k), priors).item(), rel=1e-12)
    with pytest.raises(ValueError, match="no sample"):  # a positive prior without samples, as the Bayes risk says
        error_rate(logits[:100], labels[:100], priors)


def test_priors_off_one_by_round_off_are_renormalised():
    """Priors within 1e-6 of summing to one are divided by their sum: every decision wrong costs
    exactly 1 under 0-1 costs whatever the priors (it had come out 1.0000009, above the largest
    cost, for priors summing to 1.0000009), and float32 priors of 1/10 (summing to 1 + 1.5e-8)
    give float64's result."""
    from torchcal.metrics import ExpectedCost

    labels = torch.tensor([0, 1, 2, 0])
    wrong = (labels + 1) % 3
    priors = torch.tensor([0.3, 0.3, 0.4000009], dtype=torch.float64)
    assert expected_cost(wrong, labels, zero_one_costs(3), priors).item() == 1.0
    metric = ExpectedCost(zero_one_costs(3), priors)
    metric.update(wrong, labels)
    assert metric.compute().item() == 1.0
    labels = torch.arange(10)
    right = labels.clone()
    right[0] = 1
    assert expected_cost(right, labels, zero_one_costs(10), torch.full((10,), 0.1)).item() == pytest.approx(0.1, abs=1e-17)


def test_bayes_risk_without_validation_refuses_scores_of_another_width():
    """BayesRisk(validate_args=False) checks the scores' K against the costs' once per batch (it
    had done so through the costs' own checks, which now run once, at construction)."""
    from torchcal.metrics import BayesRisk

    metric = BayesRisk(zero_one_costs(3, abstain=0.3), validate_args=False)
    with pytest.raises(ValueError, match="costs for 3 classes"):
        metric.update(torch.randn(5, 4), torch.zeros(5, dtype=torch.long))


def test_balanced_error_rate_leaves_out_an_ignored_class():
    """BalancedErrorRate(K, ignore_index=c) for a class c in [0, K) (a segmentation's void class):
    the mean error of the other classes, as NumPy gives it; it had raised at every compute() that
    class c had a positive prior and no sample."""
    from torchcal.metrics import BalancedErrorRate

    gen = torch.Generator().manual_seed(6)
    logits, labels = torch.randn(400, 5, generator=gen), torch.randint(0, 5, (400,), generator=gen)
    metric = BalancedErrorRate(5, ignore_index=0)
    metric.update(logits[:150], labels[:150])
    metric.update(logits[150:], labels[150:])
    predicted, y = logits.argmax(1).numpy(), labels.numpy()
    expected = np.mean([np.mean(predicted[y == k] != k) for k in range(1, 5)])
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)
    assert BalancedErrorRate(5, ignore_index=255)(logits, labels).item() == pytest.approx(balanced_error_rate(logits, labels).item(), rel=1e-12)


def test_binary_threshold_rule():
    """Decide class 1 iff q_1 > c_01 / (c_01 + c_10) (Ferrer eq. 44); ties go to class 0."""
    costs = torch.tensor([[0.0, 1.0], [4.0, 0.0]])  # threshold 1 / 5
    q1 = torch.tensor([0.1, 0.19, 0.21, 0.9], dtype=torch.float64)
    logits = torch.stack([(1 - q1).log(), q1.log()], dim=1)
    assert bayes_decisions(logits, costs).tolist() == [0, 0, 1, 1]


def test_abstain_rule_is_max_posterior_below_one_minus_alpha():
    rs = np.random.RandomState(3)
    logits = torch.from_numpy(2 * rs.standard_normal((2000, 6)))
    alpha = 0.3
    decisions = bayes_decisions(logits, zero_one_costs(6, abstain=alpha))
    confidence, predicted = torch.softmax(logits, 1).max(1)
    expected = torch.where(confidence < 1 - alpha, torch.tensor(6), predicted)
    assert torch.equal(decisions, expected)


# --------------------------------------------------------------------------- expected cost


def test_expected_cost_micro_example():
    """Reference notes A.1.1: EC = 1/6, EC_naive = 1/3, NEC = 0.5."""
    labels = torch.tensor([0, 1, 0, 0, 1, 0])
    decisions = torch.tensor([0, 1, 0, 0, 2, 2])
    costs = torch.tensor([[0, 1, 0.5], [1, 0, 0.5]])
    assert expected_cost(decisions, labels, costs).item() == pytest.approx(1 / 6, abs=1e-15)
    assert expected_cost(decisions, labels, costs, normalize=True).item() == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize("n, k, m, scale", CASES)
@pytest.mark.parametrize("use_priors", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_expected_cost_matches_numpy(n, k, m, scale, use_priors, normalize):
    logits, labels, costs, priors = random_problem(n, k, m, scale, seed=n + k)
    decisions = np.random.RandomState(k).randint(0, m, size=n)
    p = priors if use_priors else None
    expected = np_expected_cost(decisions, labels, costs, p, normalize)
    got = expected_cost(
        torch.from_numpy(decisions), torch.from_numpy(labels), torch.from_numpy(costs),
        priors=None if p is None else torch.from_numpy(p), normalize=normalize,
    )
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def _confusion_data(n11: int, n12: int, n21: int, n22: int):
    """Labels and decisions of a binary confusion matrix (class 1 = positive = index 1)."""
    labels = torch.tensor([0] * (n11 + n12) + [1] * (n21 + n22))
    decisions = torch.tensor([0] * n11 + [1] * n12 + [0] * n21 + [1] * n22)
    return decisions, labels


BETA2_COSTS = {1: torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 2: torch.tensor([[0.0, 1.0], [2.0, 0.0]])}
UNIFORM = torch.tensor([0.5, 0.5])


def _three_necs(n1: int, n2: int, n21: int, n12: int) -> tuple[float, float, float]:
    decisions, labels = _confusion_data(n1 - n12, n12, n21, n2 - n21)
    nec_b = expected_cost(decisions, labels, BETA2_COSTS[1], priors=UNIFORM, normalize=True)
    nec_1 = expected_cost(decisions, labels, BETA2_COSTS[1], normalize=True)
    nec_2 = expected_cost(decisions, labels, BETA2_COSTS[2], normalize=True)
    return nec_b.item(), nec_1.item(), nec_2.item()


# Ferrer Tables 1 and 2: (N21, N12, NEC_b, NEC_beta2=1, NEC_beta2=2), printed to two decimals;
# the unrounded values of the reference notes where the rounding is ambiguous.
TABLE1 = [
    (0, 50, 0.10, 0.10, 0.10), (25, 25, 0.10, 0.10, 0.15), (50, 0, 0.10, 0.10, 0.20),
    (0, 250, 0.50, 0.50, 0.50), (125, 125, 0.50, 0.50, 0.75), (250, 0, 0.50, 0.50, 1.00),
    (0, 450, 0.90, 0.90, 0.90), (225, 225, 0.90, 0.90, 1.35), (450, 0, 0.90, 0.90, 1.80),
]
TABLE2 = [
    (0, 90, 0.10, 0.90, 0.45), (5, 45, 0.10, 0.50, 0.275), (10, 0, 0.10, 0.10, 0.10),
    (0, 450, 0.50, 4.50, 2.25), (25, 225, 0.50, 2.50, 1.375), (50, 0, 0.50, 0.50, 0.50),
    (0, 810, 0.90, 8.10, 4.05), (40, 450, 0.90, 4.90, 2.65), (90, 0, 0.90, 0.90, 0.90),
    (45, 45, 0.50, 0.90, 0.675),
]


@pytest.mark.parametrize("n1, n2, table", [(500, 500, TABLE1), (900, 100, TABLE2)])
def test_ferrer_tables_1_and_2(n1, n2, table):
    for n21, n12, *printed in table:
        assert _three_necs(n1, n2, n21, n12) == pytest.approx(printed, abs=1e-12)


@pytest.mark.parametrize("n1, n2", [(500, 500), (900, 100)])
def test_ferrer_nec_closed_form_on_the_whole_grid(n1, n2):
    """NEC_beta2 = (beta2 R21 P2 + R12 P1) / min(beta2 P2, P1) on the 21 x 21 grid of Fig. 2."""
    p1, p2 = n1 / (n1 + n2), n2 / (n1 + n2)
    for n21 in range(0, n2 + 1, n2 // 20):
        for n12 in range(0, n1 + 1, n1 // 20):
            r21, r12 = n21 / n2, n12 / n1
            closed = [r12 + r21] + [(b * r21 * p2 + r12 * p1) / min(b * p2, p1) for b in (1, 2)]
            assert _three_necs(n1, n2, n21, n12) == pytest.approx(closed, rel=1e-12, abs=1e-15)


def test_nec_undefined_when_the_naive_system_is_free():
    labels, decisions = torch.tensor([0, 1]), torch.tensor([2, 2])
    costs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # deciding 2 costs nothing
    assert expected_cost(decisions, labels, costs).item() == 0
    with pytest.raises(ValueError, match="naive"):
        expected_cost(decisions, labels, costs, normalize=True)


def test_expected_cost_with_prior_zero_class():
    labels, decisions = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    ec = expected_cost(decisions, labels, zero_one_costs(2), priors=torch.tensor([1.0, 0.0]))
    assert ec.item() == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalised_cost_metrics_with_priors_after_set_dtype(dtype):
    """torchmetrics' ``set_dtype`` casts the metric's cost and prior buffers too; the naive
    system's cost is still formed (review finding: float64 priors times float32 costs raised)."""
    from torchcal.metrics import BayesRisk, ExpectedCost

    costs, priors = zero_one_costs(2, abstain=0.2), torch.tensor([0.3, 0.7], dtype=torch.float64)
    decisions, labels = torch.tensor([0, 1, 2, 1]), torch.tensor([0, 1, 1, 0])
    metric = ExpectedCost(costs, priors=priors, normalize=True).set_dtype(dtype)
    metric.update(decisions, labels)
    expected = expected_cost(decisions, labels, costs, priors, normalize=True)
    torch.testing.assert_close(metric.compute().double(), expected.double(), rtol=1e-6, atol=0.0)
    logits = torch.tensor([[2.0, -1.0], [0.1, 0.3], [-1.0, 1.5], [0.4, 0.2]])
    risk = BayesRisk(costs, priors=priors, normalize=True).set_dtype(dtype)
    risk.update(logits, labels)
    expected = bayes_risk(logits, labels, costs, priors, normalize=True)
    torch.testing.assert_close(risk.compute().double(), expected.double(), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    "decisions, labels, costs, priors, match",
    [
        ([0, 1], [0, 2], zero_one_costs(2), None, r"labels must lie in \[0, 2\)"),
        ([0, 3], [0, 1], zero_one_costs(2, 0.1), None, r"decisions must lie in \[0, 3\)"),
        ([0.0, 1.0], [0, 1], zero_one_costs(2), None, "decisions must be an integer"),
        ([0, 1, 1], [0, 1], zero_one_costs(2), None, "decisions has 3 entries"),
        ([0, 1], [0, 1], torch.ones(2), None, r"costs must have shape \(K, M\)"),
        ([0, 1], [0, 1], -zero_one_costs(2), None, "non-negative"),
        ([0, 1], [0, 1], zero_one_costs(2), [0.2, 0.2], "sum to one"),
        ([0, 0], [0, 0], zero_one_costs(2), [0.5, 0.5], "no sample"),
        ([], [], zero_one_costs(2), None, "empty"),
    ],
)
def test_expected_cost_rejects_bad_input(decisions, labels, costs, priors, match):
    with pytest.raises(ValueError, match=match):
        expected_cost(
            torch.tensor(decisions), torch.tensor(labels, dtype=torch.long), costs,
            priors=None if priors is None else torch.tensor(priors),
        )


# --------------------------------------------------------------------------- Bayes risk


@pytest.mark.parametrize("n, k, m, scale", CASES)
def test_bayes_risk_is_expected_cost_of_bayes_decisions(n, k, m, scale):
    logits, labels, costs, priors = random_problem(n, k, m, scale, seed=7)
    z, y, c, p = map(torch.from_numpy, (logits, labels, costs, priors))
    expected = np_expected_cost((np_softmax(logits) @ costs).argmin(axis=1), labels, costs, priors, True)
    assert bayes_risk(z, y, c, priors=p, normalize=True).item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("k, scale", [(2, 3.0), (10, 1.0), (1000, 5.0), (3, 1e4)])
def test_error_rates_match_numpy(k, scale):
    logits, labels, _, _ = random_problem(3000, k, k, scale, seed=k)
    wrong = logits.argmax(axis=1) != labels
    balanced = np.mean([wrong[labels == c].mean() for c in range(k) if (labels == c).any()])
    z, y = torch.from_numpy(logits), torch.from_numpy(labels)
    assert error_rate(z, y).item() == pytest.approx(wrong.mean(), abs=1e-14)
    assert balanced_error_rate(z, y).item() == pytest.approx(balanced, rel=1e-10)


def test_balanced_error_rate_needs_every_class():
    with pytest.raises(ValueError, match="no sample"):
        balanced_error_rate(torch.zeros(3, 3), torch.tensor([0, 1, 1]))


# --------------------------------------------------------------------------- Ferrer §4.8 synthetic data


@pytest.fixture(scope="module")
def binary_systems():
    task = gaussian_task(num_classes=2)
    return task.labels, ferrer_systems(task)


# Table 3: alpha, then (EC, NEC, % abstained) for LR-mc1 and LR-cal, as printed.
TABLE3 = [
    (0.01, (0.006, 0.638, 61.5), (0.005, 0.534, 41.1)),
    (0.1, (0.030, 0.299, 12.3), (0.025, 0.249, 14.1)),
    (0.2, (0.052, 0.521, 6.7), (0.0355, 0.355, 8.2)),
    (0.4, (0.076, 0.756, 2.0), (0.046, 0.4565, 2.3)),
    (0.6, (0.079, 0.786, 0.0), (0.047, 0.467, 0.0)),
    (1.0, (0.079, 0.786, 0.0), (0.047, 0.467, 0.0)),
]


@pytest.mark.parametrize("alpha, miscalibrated, calibrated", TABLE3)
def test_ferrer_table3_abstention(binary_systems, alpha, miscalibrated, calibrated):
    labels, systems = binary_systems
    costs = zero_one_costs(2, abstain=alpha)
    for name, (ec, nec, abstained) in (("Datap-mc1", miscalibrated), ("Datap-cal", calibrated)):
        logits = systems[name]
        assert bayes_risk(logits, labels, costs).item() == pytest.approx(ec, abs=5e-4)
        assert bayes_risk(logits, labels, costs, normalize=True).item() == pytest.approx(nec, abs=5e-4)
        share = 100 * (bayes_decisions(logits, costs) == 2).double().mean().item()
        assert share == pytest.approx(abstained, abs=0.05)


def test_ferrer_threshold_sweep_section_4_8_1(binary_systems):
    """Ferrer §4.8.1 (metrics-decisions-ecd.md): LR-mc1's LLR thresholded over the grid -1:0.01:3;
    NEC with data priors and c21 = 2 (NEC_beta^2=2) is 0.366 at its best threshold (0.22) and 0.604
    at the grid point 1.50 next to the Bayes threshold log(4.5) = 1.504."""
    labels, systems = binary_systems
    logits = systems["Datap-mc1"].double()
    llr = logits[:, 1] - logits[:, 0] - math.log(0.1 / 0.9)  # the posteriors hold the 0.1 prior
    costs = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)

    def nec(threshold: float) -> float:
        return expected_cost((llr > threshold).long(), labels, costs, normalize=True).item()

    grid = [round(-1 + 0.01 * i, 2) for i in range(401)]
    necs = [nec(t) for t in grid]
    best = min(range(len(grid)), key=necs.__getitem__)
    assert necs[best] == pytest.approx(0.366, abs=5e-4) and grid[best] == 0.22
    assert necs[grid.index(1.5)] == pytest.approx(0.604, abs=5e-4)


def test_ferrer_table4_decision_columns():
    """K = 10: NEC of argmax decisions and NEC with an abstain cost of 0.1, uncalibrated rows."""
    task = gaussian_task(num_classes=10)
    systems = ferrer_systems(task)
    printed = {  # system: (NEC cal, mc1, mc2), (NEC-abs cal, mc1, mc2)
        "Datap": ((0.25, 0.29, 0.25), (0.14, 0.17, 0.93)),
        "Mismp": ((1.11, 0.70, 1.11), (0.52, 0.61, 1.00)),
    }
    for block, (nec, nec_abstain) in printed.items():
        for variant, a, b in zip(("cal", "mc1", "mc2"), nec, nec_abstain):
            logits = systems[f"{block}-{variant}"]
            got = bayes_risk(logits, task.labels, zero_one_costs(10), normalize=True).item()
            got_abstain = bayes_risk(logits, task.labels, zero_one_costs(10, 0.1), normalize=True).item()
            assert (got, got_abstain) == pytest.approx((a, b), abs=5e-3)


def test_balanced_error_rate_names_a_class_without_samples():
    """It said "classes [2] have a positive prior ...; give them prior 0", though neither the
    function nor the metric takes priors."""
    from torchcal.metrics import BalancedErrorRate

    logits, labels = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 0, 1, 0, 1])
    metric = BalancedErrorRate(3)
    metric.update(logits, labels)
    for call in (lambda: balanced_error_rate(logits, labels), metric.compute):
        with pytest.raises(ValueError, match=r"but class 2 has no sample: add samples, or leave its column out") as error:
            call()
        assert "prior" not in str(error.value)
    ignored = BalancedErrorRate(3, ignore_index=2)  # (the class it leaves out needs none)
    ignored.update(logits, labels)
    decisions = logits.argmax(1)
    per_class = [float((decisions[labels == k] != k).double().mean()) for k in (0, 1)]
    assert float(ignored.compute()) == pytest.approx(sum(per_class) / 2)


def test_the_zero_one_fast_path_ties_as_the_product_does():
    """The fast path kept the slack of before (``K eps (sum(e) - min(e))``) when the product's
    became that of the two costs compared: logits 3 eps apart were tied (decision 0) under
    2 x 0-1 costs and not under 0-1 costs (decision 1)."""
    logits = torch.tensor([[-3 * EPS64, 0.0]], dtype=torch.float64)
    assert bayes_decisions(logits, zero_one_costs(2)).item() == bayes_decisions(logits, 2 * zero_one_costs(2)).item() == 0
    assert _first_near_maximal(logits).item() == 0


def test_zero_one_costs_are_recognised_without_a_second_matrix():
    """is_zero_one_costs compared with a second K x K matrix (3.2 GB at K = 20,000); now it reads
    the given one only, and still tells 0-1 costs from anything else exactly."""
    from torchcal.functional.decisions import is_zero_one_costs

    costs = zero_one_costs(4)
    assert is_zero_one_costs(costs) and is_zero_one_costs(costs.float())
    for changed in [(0, 0, 1e-300), (1, 2, 1 - 2**-52), (3, 0, 2.0), (2, 2, -0.0)]:
        other = costs.clone()
        other[changed[0], changed[1]] = changed[2]
        assert is_zero_one_costs(other) == (changed[2] == 0), changed
    assert not is_zero_one_costs(zero_one_costs(4, abstain=1.0)) and not is_zero_one_costs(torch.ones(3, 3))
