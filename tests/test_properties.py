"""Property-based tests (hypothesis) over shapes, class counts K = 2..1000, dtypes (float16,
bfloat16, float32, float64) and |logit| up to 1e4:

- every metric equals a float64 NumPy reference written here, independently of torchcal's code,
  evaluated on the same (already rounded) low-precision values cast to float64;
- the scoring rules are proper: the expected score under p is minimised at q = p (and the excess
  is exactly KL(p || q) for cross-entropy and ||p - q||^2 for Brier);
- adding a constant to a row of logits, permuting the classes consistently, shuffling the samples
  and splitting the batch anywhere leave every metric unchanged;
- calibrators never return NaN/inf for finite input and never end above the identity map's loss
  on their own calibration data; temperature and affine fits do not depend on the sample order.

Data are drawn as (shape, dtype, scale, structure, seed) and built by NumPy from the seed, so
hypothesis explores the parameters (and shrinks them) while each example stays cheap even at
K = 1000. Every test is derandomised: CI runs the same examples every time.
"""

from __future__ import annotations

import itertools
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchcal
import torchcal.functional as F
from torchcal import metrics

#: Parent settings of every test here: deterministic, no deadline (the first call of a torch op
#: can be slow), no example database (CI sees exactly the derandomised examples).
PROPERTY = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SCALES = [0.0, 1e-3, 0.1, 1.0, 4.0, 30.0, 300.0, 1e4]
STRUCTURES = ["gaussian", "saturated", "ties", "uniform"]
EDGE = 1e-12  # the relative bin-edge tolerance documented in torchcal.functional.diagnostics


@dataclass
class Problem:
    logits: torch.Tensor  # (N, K) in the drawn dtype
    labels: torch.Tensor  # (N,) int64
    z: np.ndarray  # the same scores as float64 (after the dtype's rounding)
    y: np.ndarray
    seed: int

    @property
    def n(self) -> int:
        return self.z.shape[0]

    @property
    def k(self) -> int:
        return self.z.shape[1]


def make_scores(rs: np.random.RandomState, n: int, k: int, scale: float, structure: str) -> np.ndarray:
    if structure == "gaussian":
        z = scale * rs.standard_normal((n, k))
    elif structure == "saturated":  # one class far ahead: softmax is one-hot in float64 at scale 1e4
        z = -scale * rs.uniform(0.5, 1.0, (n, k))
        z[np.arange(n), rs.randint(k, size=n)] = scale
    elif structure == "ties":  # three levels: many exact ties, also at the top
        z = scale * rs.randint(-1, 2, (n, k)).astype(np.float64)
    else:
        z = rs.uniform(-scale, scale, (n, k))
    return np.clip(z, -1e4, 1e4)


@st.composite
def problems(draw, max_n: int = 40, max_k: int = 1000, dtypes=tuple(DTYPES), min_n: int = 1) -> Problem:
    k = draw(st.one_of(st.integers(2, 5), st.integers(2, max_k), st.just(max_k)))
    n = draw(st.integers(min_n, max_n))
    dtype = draw(st.sampled_from(dtypes))
    scale = draw(st.sampled_from(SCALES))
    structure = draw(st.sampled_from(STRUCTURES))
    informative = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rs = np.random.RandomState(seed)
    raw = make_scores(rs, n, k, scale, structure)
    if informative:  # labels drawn from softmax(raw / scale): the scores carry information
        y = np.argmax(raw / max(scale, 1e-9) + rs.gumbel(size=(n, k)), axis=1)
    else:
        y = rs.randint(k, size=n)
    logits = torch.from_numpy(raw).to(dtype)
    labels = torch.from_numpy(y.astype(np.int64))
    return Problem(logits, labels, logits.double().numpy(), y.astype(np.int64), seed)


# --------------------------------------------------------------------------- NumPy references
def np_log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def np_prior_weighted(per_sample: np.ndarray, y: np.ndarray, k: int, priors: np.ndarray | None) -> float:
    """The plain mean, or sum_c P_c * (mean over class c) (Ferrer & Ramos App. A)."""
    if priors is None:
        return float(per_sample.mean())
    return float(sum(priors[c] * per_sample[y == c].mean() for c in range(k) if priors[c] > 0))


def np_entropy(p: np.ndarray) -> float:
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def np_scoring(z, y, priors, normalize, rule):
    """(score, naive score or None); the naive system always outputs the priors."""
    k = z.shape[1]
    log_q = np_log_softmax(z)
    if rule == "log":
        per_sample = -log_q[np.arange(len(y)), y]
    else:
        q = np.exp(log_q)
        onehot = np.eye(k)[y]
        per_sample = ((q - onehot) ** 2).sum(axis=1)
    score = np_prior_weighted(per_sample, y, k, priors)
    if not normalize:
        return score, None
    ref = np.bincount(y, minlength=k) / len(y) if priors is None else priors
    naive = np_entropy(ref) if rule == "log" else float((ref * (1 - ref)).sum())
    return score, naive


def np_expected_cost(decisions, y, costs, priors, normalize):
    k = costs.shape[0]
    ec = np_prior_weighted(costs[y, decisions], y, k, priors)
    if not normalize:
        return ec, None
    ref = np.bincount(y, minlength=k) / len(y) if priors is None else priors
    return ec, float((ref @ costs).min())


def np_bins(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Right-closed bins, the first closed at 0; a score within a relative 1e-12 above an interior
    edge counts as on it (the documented rule)."""
    return np.searchsorted(edges[1:-1] * (1 + EDGE), scores, side="left")


def np_edges(scores: np.ndarray, n_bins: int, strategy: str) -> np.ndarray:
    if strategy == "uniform":
        return np.arange(n_bins + 1) / n_bins
    edges = np.quantile(scores, np.arange(n_bins + 1) / n_bins)
    edges[0], edges[-1] = 0.0, 1.0
    return edges


def np_binary_problems(z, y, kind):
    """Scores (N, C) and 0/1 targets (N, C) of the binary problems of a diagnostic."""
    q = np.exp(np_log_softmax(z))
    if kind == "top-label":
        top = q.argmax(axis=1)  # the first maximal class
        return q.max(axis=1, keepdims=True), (top == y)[:, None].astype(float)
    if kind == "binary":
        return q[:, 1:2], (y == 1)[:, None].astype(float)
    return q, np.eye(z.shape[1])[y]


def np_calibration_error(z, y, n_bins, strategy, kind, norm, reduction):
    scores, targets = np_binary_problems(z, y, kind)
    n = len(y)
    per_column = []
    for c in range(scores.shape[1]):
        s, t = scores[:, c], targets[:, c]
        index = np_bins(s, np_edges(s, n_bins, strategy))
        count = np.bincount(index, minlength=n_bins)
        gap_sum = np.abs(np.bincount(index, t, n_bins) - np.bincount(index, s, n_bins))
        gap = gap_sum / np.maximum(count, 1)
        if norm == "l1":
            per_column.append(gap_sum.sum() / n)
        elif norm == "l2":
            per_column.append(math.sqrt(((count / n) * gap**2).sum()))
        else:
            per_column.append(gap[count > 0].max())
    return float({"mean": np.mean, "sum": np.sum, "max": np.max}[reduction](per_column))


def np_ecd_per_sample(z, y):
    log_q = np_log_softmax(z)
    entropy = -(np.exp(log_q) * log_q).sum(axis=1)
    return -log_q[np.arange(len(y)), y] - entropy


def close(got, expected, rtol=1e-9, atol=1e-12):
    got = float(got)
    assert math.isfinite(got)
    assert abs(got - expected) <= atol + rtol * abs(expected), (got, expected)


def priors_strategy(rs: np.random.RandomState, k: int, y: np.ndarray, mode: str) -> np.ndarray | None:
    if mode == "none":
        return None
    if mode == "all":  # positive on every class, present or not
        p = rs.dirichlet(np.ones(k))
    else:  # positive only on the classes present in the data
        present = np.bincount(y, minlength=k) > 0
        p = np.where(present, rs.uniform(0.1, 1.0, k), 0.0)
    p = p / p.sum()
    return p


@contextmanager
def _quiet():
    """Fits on random data warn (missing classes, separable data, ...); that is tested elsewhere."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- metrics = NumPy
@settings(PROPERTY, max_examples=120)
@given(problems(), st.sampled_from(["none", "all", "present"]), st.booleans())
def test_scoring_rules_match_numpy(problem, prior_mode, normalize):
    z, y, k = problem.z, problem.y, problem.k
    priors = priors_strategy(np.random.RandomState(problem.seed), k, y, prior_mode)
    torch_priors = None if priors is None else torch.from_numpy(priors)
    missing = priors is not None and bool(((np.bincount(y, minlength=k) == 0) & (priors > 0)).any())
    for rule, fn, streaming in (("log", F.cross_entropy, metrics.CrossEntropy), ("brier", F.brier_score, metrics.BrierScore)):
        metric = streaming(num_classes=k, priors=torch_priors, normalize=normalize)
        metric.update(problem.logits, problem.labels)
        if missing:
            with pytest.raises(ValueError, match="positive prior but no sample"):
                fn(problem.logits, problem.labels, priors=torch_priors, normalize=normalize)
            with pytest.raises(ValueError, match="positive prior but no sample"):
                metric.compute()
            continue
        score, naive = np_scoring(z, y, priors, normalize, rule)
        if normalize and naive <= 0:  # one class carries all the prior mass: undefined
            with pytest.raises(ValueError, match="normalised score is undefined"):
                fn(problem.logits, problem.labels, priors=torch_priors, normalize=normalize)
            with pytest.raises(ValueError, match="normalised score is undefined"):
                metric.compute()
            continue
        expected = score / naive if normalize else score
        got = fn(problem.logits, problem.labels, priors=torch_priors, normalize=normalize)
        assert got.dtype == torch.float64
        close(got, expected)
        close(metric.compute(), expected)
        if normalize:
            continue
        # Calibration loss against scores "calibrated" by halving the logits (in float64).
        halved = problem.logits.double() / 2
        calibrated, _ = np_scoring(z / 2, y, priors, False, rule)
        if score > 1e-9:
            result = F.calibration_loss(problem.logits, halved, problem.labels, score=fn, priors=torch_priors)
            close(result.absolute, score - calibrated, atol=1e-9)
            close(result.relative, 100 * (score - calibrated) / score, rtol=1e-6, atol=1e-6)
        elif score == 0:  # a perfect raw system: the relative loss is 0 / 0
            result = F.calibration_loss(problem.logits, halved, problem.labels, score=fn, priors=torch_priors)
            close(result.absolute, -calibrated, atol=1e-9)
            assert math.isnan(float(result.relative))
        # In between, a raw score within round-off of 0 (a perfect classifier) has no meaningful
        # relative calibration loss: computed as 0 it is NaN, otherwise it is noise.


@settings(PROPERTY, max_examples=100)
@given(problems(), st.sampled_from(["zero-one", "random", "abstain"]), st.sampled_from(["none", "present"]), st.booleans())
def test_decision_metrics_match_numpy(problem, cost_kind, prior_mode, normalize):
    z, y, k = problem.z, problem.y, problem.k
    rs = np.random.RandomState(problem.seed + 1)
    if cost_kind == "zero-one":
        costs = 1 - np.eye(k)
    elif cost_kind == "random":
        costs = rs.uniform(0, 1, (k, k)) * (rs.uniform(size=(k, k)) < 0.8)
    else:
        costs = np.concatenate([1 - np.eye(k), np.full((k, 1), rs.uniform(0.05, 0.5))], axis=1)
    priors = priors_strategy(rs, k, y, prior_mode)
    torch_costs, torch_priors = torch.from_numpy(costs), None if priors is None else torch.from_numpy(priors)

    # The decisions minimise the expected cost (ties within round-off may go either way: the
    # first maximal posterior is checked for 0-1 costs below).
    risk = np.exp(np_log_softmax(z)) @ costs
    decisions = F.bayes_decisions(problem.logits, torch_costs).numpy()
    tol = 1e-12 * max(1.0, np.abs(risk).max())
    assert (risk[np.arange(len(y)), decisions] <= risk.min(axis=1) + tol).all()
    if cost_kind == "zero-one":
        first_max = np.exp(np_log_softmax(z)).argmax(axis=1)
        np.testing.assert_array_equal(decisions, first_max)  # the documented tie rule

    ec, naive = np_expected_cost(decisions, y, costs, priors, normalize)
    for fn, inputs in ((F.bayes_risk, problem.logits), (F.expected_cost, torch.from_numpy(decisions))):
        if normalize and naive <= 0:
            with pytest.raises(ValueError, match="zero expected cost"):
                fn(inputs, problem.labels, torch_costs, priors=torch_priors, normalize=True)
            continue
        got = fn(inputs, problem.labels, torch_costs, priors=torch_priors, normalize=normalize)
        close(got, ec / naive if normalize else ec)
    for streaming, inputs in ((metrics.BayesRisk, problem.logits), (metrics.ExpectedCost, torch.from_numpy(decisions))):
        metric = streaming(torch_costs, priors=torch_priors, normalize=normalize)
        metric.update(inputs, problem.labels)
        if not (normalize and naive <= 0):
            close(metric.compute(), ec / naive if normalize else ec)

    wrong = np.exp(np_log_softmax(z)).argmax(axis=1) != y
    close(F.error_rate(problem.logits, problem.labels), wrong.mean(), atol=1e-15)
    if (np.bincount(y, minlength=k) > 0).all():
        balanced = np.mean([wrong[y == c].mean() for c in range(k)])
        close(F.balanced_error_rate(problem.logits, problem.labels), balanced)
    else:
        with pytest.raises(ValueError, match="averages the error rate of every class, but class(es)? .* no sample"):
            F.balanced_error_rate(problem.logits, problem.labels)


@settings(PROPERTY, max_examples=120)
@given(
    problems(),
    st.integers(1, 25),
    st.sampled_from(["uniform", "quantile"]),
    st.sampled_from(["top-label", "classwise", "binary"]),
    st.sampled_from(["l1", "l2", "max"]),
    st.sampled_from(["mean", "sum", "max"]),
)
def test_diagnostics_match_numpy(problem, n_bins, strategy, kind, norm, reduction):
    z, y = problem.z, problem.y
    if kind == "binary" and problem.k != 2:
        kind = "classwise"
    expected = np_calibration_error(z, y, n_bins, strategy, kind, norm, reduction)
    close(F.expected_calibration_error(problem.logits, problem.labels, n_bins, strategy, kind, norm, reduction), expected)
    metric = metrics.CalibrationError(problem.k, n_bins, strategy, kind, norm, reduction)
    metric.update(problem.logits, problem.labels)
    close(metric.compute(), expected)

    # Reliability bins, ESCE and ECD of the same kind (top-label or binary).
    single = "binary" if kind == "binary" else "top-label"
    scores, targets = (a[:, 0] for a in np_binary_problems(z, y, single))
    edges = np_edges(scores, n_bins, strategy)
    index = np_bins(scores, edges)
    counts = np.bincount(index, minlength=n_bins)
    bins = F.reliability_bins(problem.logits, problem.labels, n_bins, strategy, kind=single)
    np.testing.assert_array_equal(bins.counts.numpy(), counts)
    np.testing.assert_allclose(bins.mean_score.numpy(), np.bincount(index, scores, n_bins) / np.maximum(counts, 1), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(bins.frequency.numpy(), np.bincount(index, targets, n_bins) / np.maximum(counts, 1), rtol=1e-12, atol=1e-15)
    close(F.signed_calibration_error(problem.logits, problem.labels, kind=single), targets.mean() - scores.mean())

    ecd = np_ecd_per_sample(z, y)
    close(F.entropic_calibration_difference(problem.logits, problem.labels), ecd.mean(), rtol=1e-9, atol=1e-9)
    per_bin = np.bincount(index, ecd, n_bins) / np.maximum(counts, 1)
    binned = F.entropic_calibration_difference(problem.logits, problem.labels, n_bins, strategy, kind=single)
    np.testing.assert_allclose(binned.numpy(), per_bin, rtol=1e-9, atol=1e-9)
    metric = metrics.ECD()
    metric.update(problem.logits, problem.labels)
    close(metric.compute(), ecd.mean(), rtol=1e-9, atol=1e-9)


def test_tied_low_precision_logits_follow_the_first_maximal_posterior():
    """bfloat16 logits of 1000 classes often tie at the top. The 0-1 Bayes decision is then the
    first maximal posterior (the documented rule, also used by the top-label ECE), whatever the
    round-off of the matrix product ``softmax(logits) @ costs``: error_rate = 1 - accuracy."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2000, 1000, generator=gen)).bfloat16()
    labels = logits.float().argmax(dim=1)  # the first maximal class
    top2 = logits.float().topk(2, dim=1).values
    assert (top2[:, 0] == top2[:, 1]).sum() > 20  # many rows tie at the top
    assert torch.equal(F.bayes_decisions(logits, F.zero_one_costs(1000)), labels)
    assert F.error_rate(logits, labels).item() == 0.0
    ties = torch.zeros(4, 300, dtype=torch.float64)
    ties[:, 7] = ties[:, 250] = 1.0
    assert F.bayes_decisions(ties, F.zero_one_costs(300)).tolist() == [7, 7, 7, 7]


# --------------------------------------------------------------------------- propriety
@settings(PROPERTY, max_examples=60)
@given(
    st.one_of(st.integers(2, 6), st.integers(2, 300)),
    st.sampled_from([0.1, 1.0, 3.0, 10.0, 30.0]),
    st.sampled_from(["random", "nearby", "temperature", "prior-shift", "one-hot"]),
    st.integers(0, 2**31 - 1),
)
def test_scoring_rules_are_proper(k, scale, perturbation, seed):
    """E_{y~p}[S(q, y)] >= E_{y~p}[S(p, y)] for every q, computed by torchcal as the prior-weighted
    score of one sample per class (priors = p). The excess is KL(p || q) for cross-entropy and
    ||p - q||^2 for Brier; for the Bayes risk under any cost matrix it is >= 0 (not strict)."""
    rs = np.random.RandomState(seed)
    z_p = scale * rs.standard_normal(k)
    if perturbation == "random":
        z_q = scale * rs.standard_normal(k)
    elif perturbation == "nearby":
        z_q = z_p + 10.0 ** rs.uniform(-6, 0) * rs.standard_normal(k)
    elif perturbation == "temperature":
        z_q = z_p * rs.choice([0.1, 0.5, 0.9, 1.1, 2.0, 10.0])
    elif perturbation == "prior-shift":
        z_q = z_p + rs.standard_normal(k)
    else:
        z_q = np.full(k, -30.0)
        z_q[rs.randint(k)] = 30.0
    p = np.exp(np_log_softmax(z_p[None]))[0]
    q = np.exp(np_log_softmax(z_q[None]))[0]
    classes = torch.arange(k)
    priors = torch.from_numpy(p)

    def expected_score(fn, z, **kwargs):
        rows = torch.from_numpy(np.repeat(z[None], k, axis=0))
        return fn(rows, classes, priors=priors, **kwargs).item()

    log_p, log_q = np_log_softmax(z_p[None])[0], np_log_softmax(z_q[None])[0]
    kl = float((p * (log_p - log_q)).sum())
    excess = expected_score(F.cross_entropy, z_q) - expected_score(F.cross_entropy, z_p)
    assert excess >= -1e-12
    assert excess == pytest.approx(kl, rel=1e-6, abs=1e-12)
    excess = expected_score(F.brier_score, z_q) - expected_score(F.brier_score, z_p)
    assert excess >= -1e-12
    assert excess == pytest.approx(float(((p - q) ** 2).sum()), rel=1e-6, abs=1e-12)
    m = k + rs.randint(2)
    costs = torch.from_numpy(rs.uniform(0, 1, (k, m)))
    at_p = expected_score(F.bayes_risk, z_p, costs=costs)
    at_q = expected_score(F.bayes_risk, z_q, costs=costs)
    assert at_q >= at_p - 1e-12
    assert at_p == pytest.approx(float((p @ costs.numpy()).min()), rel=1e-9, abs=1e-12)  # the Bayes risk


# --------------------------------------------------------------------------- invariances
def all_metrics(logits, labels, k, priors=None, costs=None, top_unique=True):
    """Every metric of (logits, labels), by name. Metrics that depend on which class is first
    among tied maxima are left out when some row's maximum is not unique. Normalised scores need
    two classes with a positive prior (else they are undefined, see test_bad_input.py)."""
    normalize = int((priors > 0).sum()) >= 2
    out = {
        "ce": F.cross_entropy(logits, labels),
        "ce-priors-normalised": F.cross_entropy(logits, labels, priors=priors, normalize=normalize),
        "brier": F.brier_score(logits, labels, priors=priors),
        "ecd": F.entropic_calibration_difference(logits, labels),
        "classwise-ece": F.expected_calibration_error(logits, labels, 7, kind="classwise"),
        "classwise-mce-quantile": F.expected_calibration_error(logits, labels, 5, "quantile", "classwise", "max", "max"),
    }
    if top_unique:
        out.update(
            {
                "ece": F.expected_calibration_error(logits, labels, 10),
                "ece-quantile-l2": F.expected_calibration_error(logits, labels, 6, "quantile", norm="l2"),
                "esce": F.signed_calibration_error(logits, labels),
                "error-rate": F.error_rate(logits, labels),
                "bayes-risk": F.bayes_risk(logits, labels, costs, priors=priors, normalize=normalize),
            }
        )
    return {name: float(v) for name, v in out.items()}


def _unique_top(z: np.ndarray) -> bool:
    top2 = np.sort(z, axis=1)[:, -2:]
    return bool((top2[:, 1] > top2[:, 0]).all())


def _present_priors(y, k, rs):
    return torch.from_numpy(priors_strategy(rs, k, y, "present"))


def _costs(k, rs):
    return torch.from_numpy(rs.uniform(0.1, 1.0, (k, k)) + np.diag(-0.1 * np.ones(k)))


def assert_same(a: dict, b: dict, rtol=1e-9, atol=1e-12):
    assert a.keys() == b.keys()
    for name in a:
        assert abs(a[name] - b[name]) <= atol + rtol * abs(a[name]), (name, a[name], b[name])


@settings(PROPERTY, max_examples=40)
@given(st.integers(1, 40), st.integers(2, 300), st.integers(0, 30), st.integers(0, 2**31 - 1))
def test_adding_a_constant_to_a_row_changes_nothing(n, k, exponent, seed):
    """Logits on a dyadic grid and shifts by large dyadic constants: the shifted logits are exact,
    and every metric and every calibrated output is bit for bit the same."""
    rs = np.random.RandomState(seed)
    step = 2.0**-exponent
    z = rs.randint(-(2**20), 2**20, (n, k)) * step
    shift = rs.randint(-(2**30), 2**30, (n, 1)) * step
    y = rs.randint(k, size=n)
    logits, shifted, labels = torch.from_numpy(z), torch.from_numpy(z + shift), torch.from_numpy(y)
    assert torch.equal((shifted - torch.from_numpy(shift)), logits)  # exact arithmetic
    priors, costs = _present_priors(y, k, rs), _costs(k, rs)
    top_unique = _unique_top(z)
    assert all_metrics(logits, labels, k, priors, costs, top_unique) == all_metrics(shifted, labels, k, priors, costs, top_unique)
    if n >= 2:
        # Fitted on the logits scaled (exactly) into |z| <= 64, the range of real networks: the
        # property is about applying the fitted map.
        fit_on = logits * 2.0 ** -max(0, math.ceil(math.log2(max(1.0, float(logits.abs().max()) / 64))))
        with _quiet(), torch.no_grad():
            for cal in (torchcal.AffineCalibration(), torchcal.IsotonicCalibration()):
                cal.fit(fit_on, labels)
                assert torch.equal(cal(logits), cal(shifted)), type(cal).__name__
            # Temperature scaling multiplies before normalising: (z + c) / T rounds differently
            # from z / T, by about eps |z + c| / T.
            ts = torchcal.TemperatureScaling().fit(fit_on, labels)
            slack = 8 * np.finfo(np.float64).eps * float((logits.abs() + float(np.abs(shift).max())).max()) / ts.temperature
            torch.testing.assert_close(ts(logits), ts(shifted), rtol=0, atol=slack + 1e-12)


@settings(PROPERTY, max_examples=60)
@given(problems(max_k=300), st.integers(0, 2**31 - 1))
def test_permuting_the_classes_consistently_changes_nothing(problem, seed):
    rs = np.random.RandomState(seed)
    k, y = problem.k, problem.y
    perm = rs.permutation(k)  # new class j is old class perm[j]
    inverse = np.argsort(perm)
    priors, costs = _present_priors(y, k, rs), _costs(k, rs)
    top_unique = _unique_top(problem.z)
    before = all_metrics(problem.logits, problem.labels, k, priors, costs, top_unique)
    after = all_metrics(
        problem.logits[:, torch.from_numpy(perm)],
        torch.from_numpy(inverse[y]),
        k,
        priors[torch.from_numpy(perm)],
        costs[torch.from_numpy(perm)][:, torch.from_numpy(perm)],
        top_unique,
    )
    assert_same(before, after)


@settings(PROPERTY, max_examples=60)
@given(problems(max_n=60, max_k=300), st.integers(0, 2**31 - 1), st.lists(st.integers(0, 60), max_size=4))
def test_shuffling_and_splitting_the_samples_changes_nothing(problem, seed, cuts):
    """Functional metrics of shuffled samples, and streaming metrics fed the shuffled samples in
    batches split anywhere (empty batches skipped), equal the metric of the original batch."""
    rs = np.random.RandomState(seed)
    k, n = problem.k, problem.n
    order = torch.from_numpy(rs.permutation(n))
    priors, costs = _present_priors(problem.y, k, rs), _costs(k, rs)
    before = all_metrics(problem.logits, problem.labels, k, priors, costs)
    after = all_metrics(problem.logits[order], problem.labels[order], k, priors, costs)
    assert_same(before, after)

    logits, labels = problem.logits[order], problem.labels[order]
    bounds = [0, *sorted(c % (n + 1) for c in cuts), n]
    normalize = int((priors > 0).sum()) >= 2
    streaming = {
        "ce": metrics.CrossEntropy(k),
        "ce-priors-normalised": metrics.CrossEntropy(k, priors=priors, normalize=normalize),
        "brier": metrics.BrierScore(k, priors=priors),
        "ecd": metrics.ECD(),
        "classwise-ece": metrics.CalibrationError(k, 7, kind="classwise"),
        "classwise-mce-quantile": metrics.CalibrationError(k, 5, "quantile", "classwise", "max", "max"),
        "ece": metrics.CalibrationError(k, 10),
        "ece-quantile-l2": metrics.CalibrationError(k, 6, "quantile", norm="l2"),
        "bayes-risk": metrics.BayesRisk(costs, priors=priors, normalize=normalize),
    }
    for start, stop in itertools.pairwise(bounds):
        if stop > start:
            for metric in streaming.values():
                metric.update(logits[start:stop], labels[start:stop])
    got = {name: float(metric.compute()) for name, metric in streaming.items()}
    assert_same({name: before[name] for name in got}, got)


# --------------------------------------------------------------------------- calibrators
PARAMETRIC = {
    "temperature": torchcal.TemperatureScaling,
    "temperature-brier": lambda: _WithLoss(torchcal.TemperatureScaling(), "brier"),
    "affine": torchcal.AffineCalibration,
    "affine-no-bias": lambda: torchcal.AffineCalibration(bias=False),
    "vector": torchcal.VectorScaling,
    "dirichlet-odir": lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2),
    "matrix-odir": lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=1e-2),
    "platt": torchcal.PlattScaling,
    "beta": torchcal.BetaCalibration,
}
NONPARAMETRIC = {"histogram": torchcal.HistogramBinning, "isotonic": torchcal.IsotonicCalibration}


class _WithLoss:
    """A calibrator whose ``fit`` uses another proper loss."""

    def __init__(self, calibrator, loss):
        self.calibrator, self.loss = calibrator, loss

    def fit(self, logits, labels):
        self.calibrator.fit(logits, labels, loss=self.loss)
        return self.calibrator


def _fit_loss(cal, logits, labels, rule):
    with torch.no_grad():
        calibrated = cal(logits.double())
    return float(F.cross_entropy(calibrated, labels) if rule == "log" else F.brier_score(calibrated, labels))


@settings(PROPERTY, max_examples=100)
@given(problems(max_n=50, min_n=2), st.sampled_from(sorted(PARAMETRIC) + sorted(NONPARAMETRIC)))
def test_calibrators_are_finite_and_never_worse_than_the_identity(problem, name):
    k = problem.k
    if name in ("platt", "beta"):
        k = 2
        problem = Problem(problem.logits[:, :2], problem.labels % 2, problem.z[:, :2], problem.y % 2, problem.seed)
    # Maps with O(K) or O(K^2) parameters are solved by dense Newton steps: keep the test fast.
    max_k = {"dirichlet-odir": 12, "matrix-odir": 12, "vector": 100}.get(name)
    if max_k is not None and k > max_k:
        k = max_k
        problem = Problem(problem.logits[:, :k], problem.labels % k, problem.z[:, :k], problem.y % k, problem.seed)
    make = PARAMETRIC.get(name) or NONPARAMETRIC[name]
    with _quiet():
        cal = make().fit(problem.logits, problem.labels)
    extreme = torch.tensor([[1e4] + [-1e4] * (k - 1), [0.0] * k, [-1e4] * (k - 1) + [1e4]], dtype=problem.logits.dtype)
    with torch.no_grad():
        for inputs in (problem.logits, extreme, problem.logits.double()):
            out = cal(inputs)
            assert torch.isfinite(out).all(), name
            assert torch.allclose(out.double().logsumexp(dim=1), torch.zeros(out.shape[0], dtype=torch.float64), atol=1e-4)
    if name in PARAMETRIC:
        rule = "brier" if name.endswith("brier") else "log"
        identity = _fit_loss(lambda x: x, problem.logits, problem.labels, rule)
        fitted = _fit_loss(cal, problem.logits, problem.labels, rule)
        # ODIR is 0 at the identity map: the fitted objective, loss plus penalty, is below it.
        penalty = float(cal._penalty().detach()) if name.endswith("odir") else 0.0
        assert fitted + penalty <= identity * (1 + 1e-9) + 1e-9, (name, fitted, identity)


@settings(PROPERTY, max_examples=40)
@given(problems(max_n=50, max_k=200, min_n=2, dtypes=(torch.float32, torch.float64)), st.integers(0, 2**31 - 1))
def test_temperature_and_affine_fits_do_not_depend_on_sample_order(problem, seed):
    order = torch.from_numpy(np.random.RandomState(seed).permutation(problem.n))
    with _quiet():
        for make in (torchcal.TemperatureScaling, torchcal.AffineCalibration):
            logits = problem.logits
            a = make().fit(logits, problem.labels)
            b = make().fit(logits[order], problem.labels[order])
            with torch.no_grad():
                pa, pb = a(logits.double()).exp(), b(logits.double()).exp()
            # Without a finite optimum (absent classes, separable data) a fit may stop at its cap,
            # warned and recorded, where the path taken shows a little more.
            both_converged = a.fit_record_.converged and b.fit_record_.converged
            assert torch.allclose(pa, pb, atol=1e-6 if both_converged else 1e-4, rtol=0), make.__name__
            if make is torchcal.TemperatureScaling and math.isfinite(a.temperature):
                assert b.temperature == pytest.approx(a.temperature, rel=1e-6)
