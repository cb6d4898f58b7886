"""Degenerate fits and data: perfectly separable data, a constant classifier, a binary task given
as one column, a single sample per class, one sample in all, and the iteration cap. Each has a
defined result or a clear error, never a hang; an optimiser that stops at its cap says so with a
ConvergenceWarning and in the fitted module's ``fit_record_``.

(tests/test_calibrators.py already covers separable and anti-informative data for temperature
scaling, and a single class present, for every calibrator.)
"""

from __future__ import annotations

import math
import time
import warnings
from functools import partial

import numpy as np
import pytest
import torch

import torchcal
import torchcal.functional as F
from torchcal.data import PROBABILITY_FLOOR, binary_scores_to_logits

#: No fit of a few hundred samples may take longer than this, even on a loaded CI machine.
NO_HANG_SECONDS = 60.0

MULTICLASS = {
    "temperature": torchcal.TemperatureScaling,
    "affine": torchcal.AffineCalibration,
    "affine-no-bias": partial(torchcal.AffineCalibration, bias=False),
    "vector": torchcal.VectorScaling,
    "matrix": torchcal.MatrixScaling,
    "matrix-odir": partial(torchcal.MatrixScaling, reg="odir", reg_lambda=0.1),
    "dirichlet": torchcal.DirichletCalibration,
    "dirichlet-l2": partial(torchcal.DirichletCalibration, reg="l2", reg_lambda=0.1),
    "histogram": torchcal.HistogramBinning,
    "isotonic": torchcal.IsotonicCalibration,
}
BINARY = {"platt": torchcal.PlattScaling, "beta": torchcal.BetaCalibration}
ORDER_PRESERVING = ("temperature", "affine", "affine-no-bias", "platt")


def timed_fit(make, logits, labels, **options):
    """Fit, recording the warnings; fails if the fit takes longer than NO_HANG_SECONDS."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = make().fit(logits, labels, **options)
    assert time.perf_counter() - start < NO_HANG_SECONDS
    return cal, [w for w in caught]


def ce(logits, labels):
    with torch.no_grad():
        return float(F.cross_entropy(logits, labels))


# --------------------------------------------------------------------------- perfectly separable
def separable(k=3, per_class=40, margin=3.0):
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(k).repeat(per_class)
    logits = torch.randn(k * per_class, k, generator=gen, dtype=torch.float64).clamp(-1, 1)
    logits[torch.arange(labels.shape[0]), labels] += margin  # the true class always wins by >= 1
    return logits, labels


@pytest.mark.parametrize("name", sorted(MULTICLASS) + sorted(BINARY))
def test_perfectly_separable_data(name):
    """Defined result: the fit drives the loss towards its infimum 0 (finite parameters, finite
    outputs that keep every sample's class the most probable), and reports what happened."""
    make = {**MULTICLASS, **BINARY}[name]
    logits, labels = separable(k=2 if name in BINARY else 3)
    cal, caught = timed_fit(make, logits, labels)
    with torch.no_grad():
        out = cal(logits)
    assert torch.isfinite(out).all()
    if name not in ("histogram", "isotonic"):  # their step maps have +-inf outer edges by design
        assert all(torch.isfinite(t).all() for t in cal.state_dict().values() if torch.is_tensor(t))
    assert cal.fit_record_ is not None
    if name != "histogram":  # a bin can hold samples of two classes
        assert torch.equal(out.argmax(dim=1), labels)
    if name in ("histogram", "isotonic", "matrix-odir", "dirichlet-l2"):  # smoothed, clipped or regularised
        assert ce(out, labels) < ce(logits, labels)
    elif name in ("matrix", "dirichlet"):  # Newton-CG stops once the loss proves every sample correctly classified
        assert ce(out, labels) < math.log(2) / len(labels)
    else:
        assert ce(out, labels) < 1e-3 * ce(logits, labels)
    if name not in ("histogram", "isotonic", "dirichlet-l2"):  # an unpenalised direction: the optimum is at infinity
        assert not cal.fit_record_.converged
        assert any(issubclass(w.category, torchcal.ConvergenceWarning) and "separa" in str(w.message) for w in caught)


# --------------------------------------------------------------------------- a constant classifier
@pytest.mark.parametrize("name", sorted(MULTICLASS))
def test_constant_classifier(name):
    """Every sample gets the same scores: the best any calibrator can do is output the class
    frequencies, and those with free biases do, exactly. Temperature scaling can only sharpen or
    flatten the one score vector: it stops where the expected score under the output equals the
    mean score of the true classes (its first-order condition)."""
    labels = torch.tensor([0] * 30 + [1] * 60 + [2] * 10)
    logits = torch.tensor([[2.0, 0.5, -1.0]], dtype=torch.float64).expand(100, 3).contiguous()
    cal, caught = timed_fit(MULTICLASS[name], logits, labels)
    with torch.no_grad():
        probs = cal(logits).exp()
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs, probs[:1].expand_as(probs))  # still constant
    frequencies = torch.tensor([0.3, 0.6, 0.1], dtype=torch.float64)
    if name in ("affine", "vector", "matrix", "dirichlet"):
        torch.testing.assert_close(probs[0], frequencies, atol=1e-6, rtol=0)
    elif name in ("temperature", "affine-no-bias"):
        features = logits[0] if name == "temperature" else logits[0].log_softmax(dim=0)
        assert (probs[0] @ features).item() == pytest.approx((frequencies @ features).item(), abs=1e-8)
        assert cal.fit_record_.converged
    else:  # regularised maps, histogram and isotonic move towards the frequencies
        assert ce(cal(logits).detach(), labels) < ce(logits, labels)


def test_all_scores_equal_and_zero():
    """Exactly equal scores (e.g. a network that outputs zeros): uniform posteriors, T = inf."""
    logits, labels = torch.zeros(12, 4, dtype=torch.float64), torch.arange(12) % 4
    with pytest.warns(torchcal.ConvergenceWarning, match="not positively related"):
        ts = torchcal.TemperatureScaling().fit(logits, labels)
    assert ts.temperature == float("inf")
    torch.testing.assert_close(ts(logits).exp(), torch.full((12, 4), 0.25, dtype=torch.float64))
    assert F.expected_calibration_error(logits, labels).item() == pytest.approx(0.0, abs=1e-15)  # 25 % right at 0.25
    assert F.error_rate(logits, labels).item() == pytest.approx(0.75)  # ties go to class 0


# --------------------------------------------------------------------------- K = 2 given as one column
def test_binary_task_given_as_one_column():
    gen = torch.Generator().manual_seed(2)
    p = torch.rand(200, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    labels = torch.bernoulli(p**2, generator=gen).long()
    for column in (p, p.unsqueeze(1)):
        for call in (
            lambda: torchcal.PlattScaling().fit(column, labels),
            lambda: F.cross_entropy(column, labels),
            lambda: F.expected_calibration_error(column, labels, kind="binary"),
        ):
            with pytest.raises(ValueError, match="binary_scores_to_logits"):
                call()
    logits = binary_scores_to_logits(p)
    assert torch.allclose(logits.softmax(dim=1)[:, 1], p)
    platt = torchcal.PlattScaling().fit(logits, labels)
    assert ce(platt(logits).detach(), labels) < ce(logits, labels)
    llr = binary_scores_to_logits(torch.logit(p), kind="llr")
    assert torch.allclose(llr.softmax(dim=1), logits.softmax(dim=1))
    with pytest.raises(ValueError, match="probabilities must lie in \\[0, 1\\].*LLRs"):
        binary_scores_to_logits(torch.logit(p))


def test_metrics_on_probabilities_of_zero_and_one_are_the_same_in_every_dtype():
    """A probability of 0 (or a log-probability of 0 for the complement) is floored at
    PROBABILITY_FLOOR, as the data loader does, whatever the dtype."""
    from torchcal.metrics import CrossEntropy

    probs, labels = torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([1, 0])
    expected = (-math.log(PROBABILITY_FLOOR) + math.log(2)) / 2
    for dtype in (torch.float32, torch.float64):
        assert CrossEntropy(2, input="probs")(probs.to(dtype), labels).item() == pytest.approx(expected, rel=1e-6)
        log_p1 = torch.tensor([0.0, math.log(0.5)], dtype=dtype)  # class 1 given as one column
        assert CrossEntropy(2, input="log_probs")(log_p1, torch.tensor([0, 1])).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="log-probabilities of class 1 must be <= 0, got a maximum of 0.2"):
        CrossEntropy(2, input="log_probs")(torch.tensor([0.2, -1.5]), torch.tensor([0, 1]))


def test_metrics_take_one_binary_column_with_num_classes_2_or_a_binary_kind():
    """One score of class 1 per sample: a metric reads it with num_classes=2, and a kind="binary"
    one (of two classes by definition) without it, as the module docs promise; the other metrics
    without num_classes name the option instead of pointing at binary_scores_to_logits."""
    from torchcal.metrics import CrossEntropy, SignedCalibrationError

    gen = torch.Generator().manual_seed(5)
    p1 = torch.rand(300, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(p1, generator=gen).long()
    two_columns = torch.stack([1 - p1, p1], dim=1)
    expected = SignedCalibrationError(kind="binary", input="probs")(two_columns, labels)
    assert SignedCalibrationError(kind="binary", input="probs")(p1, labels) == expected
    assert SignedCalibrationError(2, kind="binary", input="probs")(p1, labels) == expected
    with pytest.raises(ValueError, match=r"SignedCalibrationError got one score per sample \(shape \(300,\)\).*need num_classes=2"):
        SignedCalibrationError(input="probs")(p1, labels)  # (top-label)
    assert CrossEntropy(2, input="probs")(p1, labels) == CrossEntropy(2, input="probs")(two_columns, labels)


# --------------------------------------------------------------------------- one sample per class
@pytest.mark.parametrize("name", sorted(MULTICLASS))
def test_single_sample_per_class(name):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    labels = torch.arange(4)
    cal, caught = timed_fit(MULTICLASS[name], logits, labels)
    with torch.no_grad():
        out = cal(torch.cat([logits, 50 * torch.randn(20, 4, generator=gen, dtype=torch.float64)]))
    assert torch.isfinite(out).all()
    assert torch.allclose(out.logsumexp(dim=1), torch.zeros(24, dtype=torch.float64), atol=1e-9)
    if name in ("matrix", "dirichlet"):
        assert any("over-fit" in str(w.message) for w in caught)  # 4 samples, 20 parameters


def test_single_sample_per_class_in_cross_validation():
    logits = torch.randn(3, 3, dtype=torch.float64)
    labels = torch.arange(3)
    with pytest.warns(UserWarning, match="have a single sample: the training part of its fold will miss it") as caught:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchcal.ConvergenceWarning)
            warnings.filterwarnings("ignore", "classes .* have no sample")  # each training fold misses one
            out = torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels, folds=3)
    assert torch.isfinite(out).all()
    # it points at the caller's line, not into torchcal (it named torchcal/fit.py, or matrix.py under a CV'd fit)
    assert all(w.filename == __file__ for w in caught if "single sample" in str(w.message))


@pytest.mark.parametrize("name", sorted(MULTICLASS))
def test_one_sample(name):
    logits, labels = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64), torch.tensor([1])
    cal, caught = timed_fit(MULTICLASS[name], logits, labels)
    assert torch.isfinite(cal(logits)).all()
    assert any("have no sample in the calibration data" in str(w.message) for w in caught)


def test_metrics_of_one_sample_and_more_bins_than_samples():
    logits, labels = torch.tensor([[0.0, 1.5]], dtype=torch.float64), torch.tensor([1])
    confidence = torch.sigmoid(torch.tensor(1.5, dtype=torch.float64)).item()
    for strategy in ("uniform", "quantile"):
        assert F.expected_calibration_error(logits, labels, 1000, strategy).item() == pytest.approx(1 - confidence)
    assert F.signed_calibration_error(logits, labels).item() == pytest.approx(1 - confidence)
    with pytest.raises(ValueError, match="normalised score is undefined"):
        F.cross_entropy(logits, labels, normalize=True)
    # Quantile bins of identical scores: all in one bin, the others empty (not NaN).
    tied = torch.zeros(10, 3, dtype=torch.float64)
    bins = F.reliability_bins(tied, torch.arange(10) % 3, n_bins=4, strategy="quantile")
    assert bins.counts.sum().item() == 10 and torch.isfinite(bins.mean_score).all()


# --------------------------------------------------------------------------- the iteration cap
def hard_problem(k=4, n=400):
    gen = torch.Generator().manual_seed(4)
    latent = torch.randn(n, k, generator=gen, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=latent).sample()
    return 5 * latent + torch.linspace(-2, 2, k, dtype=torch.float64), labels


@pytest.mark.parametrize(
    "name, make, options",
    [
        ("temperature (Newton on 1/T)", torchcal.TemperatureScaling, {}),
        ("temperature (L-BFGS, Brier)", torchcal.TemperatureScaling, {"loss": "brier"}),
        ("affine (Newton)", torchcal.AffineCalibration, {}),
        ("vector (Newton)", torchcal.VectorScaling, {}),
        ("dirichlet (Newton)", torchcal.DirichletCalibration, {}),
        ("matrix (L-BFGS, Brier)", torchcal.MatrixScaling, {"loss": "brier"}),
        ("beta (L-BFGS)", torchcal.BetaCalibration, {}),
    ],
)
def test_iteration_cap_is_reported(name, make, options):
    logits, labels = hard_problem()
    if make is torchcal.BetaCalibration:
        logits, labels = logits[:, :2], (labels > 1).long()
    with pytest.warns(torchcal.ConvergenceWarning, match="did not converge"):
        cal = make().fit(logits, labels, max_iter=1, **options)
    record = cal.fit_record_
    assert not record.converged
    assert record.iterations <= 1
    assert "iteration cap" in record.message
    assert torch.isfinite(cal(logits)).all()
    # Given room, the same fit converges and says so.
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchcal.ConvergenceWarning)
        assert make().fit(logits, labels, **options).fit_record_.converged


# --------------------------------------------------------------- probabilities saturated near 1
def saturated_binary(n=600, seed=0):
    """Binary logits whose P(class 1) sits within 1e-7..1e-11 of 1 for a third of the rows: in
    float32 those probabilities all round to 1.0, in float64 they stay distinct."""
    rs = np.random.RandomState(seed)
    z = np.r_[rs.uniform(-4, 4, 2 * n // 3), rs.uniform(16, 25, n - 2 * n // 3)]
    y = (rs.uniform(size=n) < 1 / (1 + np.exp(-(z - 20)))).astype(np.int64)  # miscalibrated above z=16
    logits = np.stack([np.zeros(n), z], axis=1).astype(np.float32).astype(np.float64)
    return logits, y


@pytest.mark.parametrize("make", [torchcal.IsotonicCalibration, partial(torchcal.HistogramBinning, 10, "quantile")])
def test_step_maps_are_the_same_for_float32_and_float64(make):
    logits, y = saturated_binary()
    labels = torch.from_numpy(y)
    out = {}
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(logits, dtype=dtype)
        cal = make().fit(x, labels)
        lp = cal(x)
        assert lp.dtype == dtype
        out[dtype] = lp.double()
    torch.testing.assert_close(out[torch.float32], out[torch.float64], rtol=1e-5, atol=1e-6)


def test_isotonic_on_saturated_float32_matches_scikit_learn():
    from sklearn.isotonic import IsotonicRegression

    logits, y = saturated_binary()
    cal = torchcal.IsotonicCalibration().fit(torch.tensor(logits, dtype=torch.float32), torch.from_numpy(y))
    ours = ce(cal(torch.tensor(logits, dtype=torch.float32)).double(), torch.from_numpy(y))
    p = 1 / (1 + np.exp(-logits[:, 1]))
    q = IsotonicRegression(y_min=1e-7, y_max=1 - 1e-7, out_of_bounds="clip").fit(p, y).predict(p)
    reference = -np.mean(np.log(np.where(y == 1, q, 1 - q)))
    assert ours == pytest.approx(reference, rel=1e-6)


# --------------------------------------------------------------------------- a fit that fails
@pytest.mark.parametrize("name", sorted(MULTICLASS) + sorted(BINARY))
def test_failed_fit_leaves_the_calibrator_as_it_was(name, monkeypatch):
    """The fit runs to completion (changing every fitted tensor and attribute), then raises as an
    interrupted or failing solver would: the module must be exactly as before the call."""
    make = {**MULTICLASS, **BINARY}[name]
    k = 2 if name in BINARY else 3
    logits, labels = separable(k=k, margin=0.5)
    other_logits = 3 * logits.flip(0)
    cal = make()
    real_fit = type(cal)._fit

    def fit_then_fail(self, *args, **kwargs):
        real_fit(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(cal), "_fit", fit_then_fail)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(logits, labels)
    assert not cal.is_fitted and cal.fit_record_ is None and not list(cal.parameters())
    with pytest.raises(RuntimeError, match="not fitted"):
        cal(logits)

    monkeypatch.setattr(type(cal), "_fit", real_fit)
    cal.fit(logits, labels)
    before = {key: value.clone() for key, value in cal.state_dict().items() if isinstance(value, torch.Tensor)}
    tensors, record, output = list(cal._tensors()), cal.fit_record_, cal(logits)
    monkeypatch.setattr(type(cal), "_fit", fit_then_fail)
    with pytest.raises(KeyboardInterrupt):
        cal.fit(other_logits.float(), labels.flip(0), loss="brier")
    after = cal.state_dict()
    assert all(torch.equal(after[key], value) and after[key].dtype == value.dtype for key, value in before.items())
    assert all(a is b for a, b in zip(cal._tensors(), tensors)) and cal.fit_record_ is record
    assert torch.equal(cal(logits), output)


@pytest.mark.parametrize("make, unbounded", [
    (lambda: torchcal.MatrixScaling(), True),
    (lambda: torchcal.DirichletCalibration(), True),
    (lambda: torchcal.VectorScaling(), True),
    (lambda: torchcal.AffineCalibration(), True),
    (lambda: torchcal.AffineCalibration(bias=False), False),
    (lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2), False),
    (lambda: torchcal.TemperatureScaling(), False),
    (lambda: torchcal.StructuredVectorScaling(reg_lambda=1.0), False),
    # penalised, but not the bias (or, on log-posteriors, not W's row either)
    (lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=1e-2, reg_mu=0.0), True),
    (lambda: torchcal.MatrixScaling(reg="odir", reg_grid=[(1e-2, 0.0)]), True),
    (lambda: torchcal.MatrixScaling(reg="l2", reg_lambda=0.0), True),
    (lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=0.0, reg_mu=1e-2), True),
    (lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=0.0, reg_mu=1e-2), False),
    (lambda: torchcal.StructuredVectorScaling(reg_lambda=0.0), True),
    (lambda: torchcal.StructuredMatrixScaling(reg_lambda=0.0), True),
], ids=["matrix", "dirichlet", "vector", "affine", "affine-no-bias", "dirichlet-odir", "temperature", "svs",
        "matrix-odir-mu-0", "matrix-odir-cv-mu-0", "matrix-l2-0", "dirichlet-odir-lambda-0", "matrix-odir-lambda-0",
        "svs-0", "sms-0"])
def test_a_class_without_samples_and_a_free_bias_has_no_finite_optimum(make, unbounded):
    """A class absent from the calibration data, fitted with a free, unpenalised bias: the loss
    falls without bound as that class's scores do, and the solvers stopped where its gradient fell
    below their tolerance, reporting convergence with the class's probability near 0 (1e-9 after
    matrix scaling, 1e-16 after vector scaling). Such fits now say there is no finite optimum and
    name a regularised calibrator; penalised ones, and those without a per-class bias, converge.
    A penalty that leaves the bias free (ODIR's mu = 0, L2's lambda = 0, SVS / SMS at lambda = 0,
    also when cross-validation chose it) or, for Dirichlet calibration, W's row (ODIR's lambda = 0:
    log-posteriors are all negative) is no penalty for this; matrix scaling's W at lambda = 0 alone
    leaves no such direction on logits of every sign."""
    gen = torch.Generator().manual_seed(8)
    latent = 2 * torch.randn(1000, 4, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    keep = labels != 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = make().fit(2.5 * latent[keep], labels[keep])
    messages = [str(w.message) for w in caught]
    assert any("classes [3] have no sample in the calibration data" in m for m in messages)
    assert any("unpenalised: the fit drives them towards 0 (no finite optimum). Use " in m for m in messages) == unbounded
    assert cal.fit_record_.converged != unbounded
    assert cal.fit_record_.message.startswith("no finite optimum: classes [3] have no calibration sample") == unbounded
    # structured scaling's remedy is its own penalty, not itself (review finding: it named SVS)
    if unbounded and isinstance(cal, torchcal.calibrators.structured._StructuredScaling):
        assert any("Use reg_lambda > 0, or None (cross-validated from reg_grid)." in m for m in messages)


@pytest.mark.parametrize("make", [torchcal.BetaCalibration, torchcal.QuadraticScaling])
def test_binary_maps_with_a_free_intercept_say_a_class_is_missing(make):
    """Beta and quadratic scaling called a missing class "perfectly separated" and advised a
    penalty (the second diff review); their unpenalised intercept has no finite optimum there."""
    gen = torch.Generator().manual_seed(0)
    llr = torch.randn(200, generator=gen, dtype=torch.float64)
    logits, labels = torch.stack([torch.zeros_like(llr), llr], 1), torch.zeros(200, dtype=torch.long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = make().fit(logits, labels)
    assert cal.fit_record_.message.startswith("no finite optimum: classes [1] have no calibration sample")
    assert not any("perfectly separated" in str(w.message) for w in caught)


@pytest.mark.parametrize("make", [torchcal.AffineCalibration, lambda: torchcal.StructuredVectorScaling(reg_lambda=0.0)],
                         ids=["affine", "svs-0"])
def test_a_class_of_prior_0_and_a_free_bias_has_no_finite_optimum_either(make):
    """Priors that weigh a present class 0 leave its samples out of the fit, as if absent: its free
    bias falls without bound (-10.6, -15.0, -19.4 at weaker and weaker penalties), and the fit
    reported convergence with no warning, where the same data without that class's rows warned
    (two review findings)."""
    gen = torch.Generator().manual_seed(8)
    latent = 2 * torch.randn(1000, 3, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    with pytest.warns(torchcal.ConvergenceWarning, match=r"classes \[2\], which have no calibration sample or prior 0, unpenalised"):
        cal = make().fit(2.5 * latent, labels, priors=torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    assert not cal.fit_record_.converged
    assert cal.fit_record_.message.startswith("no finite optimum: classes [2] have no calibration sample or prior 0")


def test_a_free_row_of_w_that_lowers_a_missing_class_everywhere_has_no_finite_optimum(real):
    """MatrixScaling with ODIR at lambda = 0 leaves the rows of W free. On the logits above they
    surround the origin and a missing class's row has a finite optimum; on the CIFAR-10 ResNet-110
    logits (3,000 rows, class 3 left out) a direction d with d . x < 0 on every sample exists (a
    linear program finds it), the row ran off along it (norm 9,570, class 3's probability 1.5e-9 on
    its own samples) and the fit had reported convergence."""
    from scipy.optimize import linprog

    d = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(d["logits"][:3000]).double(), torch.from_numpy(d["labels"][:3000]).long()
    keep = labels != 3
    escape = linprog(np.zeros(10), A_ub=logits[keep].numpy(), b_ub=-np.ones(int(keep.sum())), bounds=[(None, None)] * 10)
    assert escape.status == 0  # (the independent check that this row has no finite optimum)
    with pytest.warns(torchcal.ConvergenceWarning, match="no finite optimum"):
        cal = torchcal.MatrixScaling(reg="odir", reg_lambda=0.0, reg_mu=1e-2).fit(logits[keep], labels[keep])
    assert not cal.fit_record_.converged and cal.fit_record_.message.startswith("no finite optimum: classes [3]")


@pytest.mark.parametrize(("name", "rows", "left_out"), [("cifar10_resnet20_ferrer", 500, 3), ("cifar10_vgg19bn_ferrer", 1000, 9)])
def test_a_row_that_ran_off_another_way_than_its_departure_shows_is_found(real, name, rows, left_out):
    """The row ran off (norm 1e5 to 2e6, the class's largest posterior 4e-8 on its calibration
    rows) along a direction that the signs of its fitted departure did not show: 19 of 30
    leave-one-class-out fits reported convergence (a review). An escape direction exists (a linear
    program), and Gilbert's algorithm finds one."""
    from scipy.optimize import linprog

    d = real(name)
    keep = np.random.default_rng(8).choice(len(d["labels"]), rows, replace=False)
    logits, labels = torch.from_numpy(d["logits"][keep]).double(), torch.from_numpy(d["labels"][keep]).long()
    present = labels != left_out
    escape = linprog(np.zeros(10), A_ub=logits[present].numpy(), b_ub=-np.ones(int(present.sum())), bounds=[(None, None)] * 10)
    assert escape.status == 0
    with pytest.warns(torchcal.ConvergenceWarning, match="no finite optimum"):
        cal = torchcal.MatrixScaling(reg="odir", reg_lambda=0.0, reg_mu=1.0).fit(logits[present], labels[present])
    assert cal.fit_record_.message.startswith(f"no finite optimum: classes [{left_out}]")


def test_a_missing_class_held_low_by_the_others_has_a_finite_optimum():
    """Logits that surround the origin, class 3 without samples: its largest posterior is 6e-9
    because the other classes' scores dominate, with a row of norm 0.31. A test on the posterior
    level took that for a runaway (a review of this session's change); no escape direction exists
    (a linear program), and the fit converges."""
    from scipy.optimize import linprog

    rng = np.random.default_rng(0)
    theta = rng.uniform(0, 2 * np.pi, 900)
    y = np.floor(((theta + rng.normal(0, 0.03, 900)) % (2 * np.pi)) / (2 * np.pi / 3)).astype(int)
    x = np.c_[10 * np.cos(theta), 10 * np.sin(theta), rng.normal(0, 1, 900), rng.normal(0, 1, 900)]
    assert linprog(np.zeros(4), A_ub=x, b_ub=-np.ones(900), bounds=[(None, None)] * 4).status == 2  # infeasible
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "classes .* have no sample")
        warnings.simplefilter("error", torchcal.ConvergenceWarning)
        cal = torchcal.MatrixScaling(reg="odir", reg_lambda=0.0, reg_mu=1.0).fit(torch.from_numpy(x), torch.from_numpy(y))
    assert cal.fit_record_.converged and float(cal.weight[3].norm()) < 1


def test_samples_that_priors_weigh_zero_do_not_hold_a_free_row():
    """The samples of a class that the priors weigh zero count for nothing in the fit: here they
    surround the origin, the others have positive logits, so a missing class's free row runs off
    along -1 (without the priors it has a finite optimum). The check had counted them too."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(600, 4)), rng.integers(0, 3, 600)
    x[y != 0] = np.abs(x[y != 0]) + 0.1
    logits, labels = torch.from_numpy(x), torch.from_numpy(y).long()
    make = partial(torchcal.MatrixScaling, reg="odir", reg_lambda=0.0, reg_mu=1e-2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "classes .* have no sample")
        warnings.simplefilter("error", torchcal.ConvergenceWarning)
        assert make().fit(logits, labels).fit_record_.converged
    with pytest.warns(torchcal.ConvergenceWarning, match="no finite optimum"):
        cal = make().fit(logits, labels, priors=torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64))
    assert not cal.fit_record_.converged


def test_affine_calibration_of_scores_that_are_the_same_on_every_row():
    """All-zero logits (a zero-initialised head) leave alpha unidentified: Newton had moved it on
    round-off to 6.99 (4.0 or 8.86 for other labels), reported converged, and the head then turned
    [2, 0, -1] into [1, 0, 0] (a fuzz review). The fit is now the class frequencies alone, alpha = 0,
    with a warning; log-loss and Brier score are those of the frequencies (NumPy)."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (80,), generator=gen)
    frequency = np.bincount(labels.numpy(), minlength=3) / 80
    for logits in (torch.zeros(80, 3), torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64).repeat(80, 1)):
        for loss, expected in (("log", -(frequency * np.log(frequency)).sum()), ("brier", 1 - (frequency**2).sum())):
            with pytest.warns(UserWarning, match="the same on every calibration row, so they carry no information"):
                fitted = torchcal.AffineCalibration().fit(logits, labels, loss=loss)
            assert fitted.alpha == 0.0 and fitted.fit_record_.converged
            assert fitted.fit_record_.loss == pytest.approx(expected, rel=1e-12)
            np.testing.assert_allclose(fitted(torch.tensor([[2.0, 0.0, -1.0]])).exp().detach().numpy()[0], frequency, rtol=1e-6)
    # a class without samples: the same fit of the biases (that class driven down), alpha = 0 (it had been 16.4)
    with pytest.warns(UserWarning) as caught:
        fitted = torchcal.AffineCalibration().fit(torch.zeros(80, 3, dtype=torch.float64), torch.arange(80) % 2)
    assert fitted.alpha == 0.0 and sum("the same on every calibration row" in str(w.message) for w in caught) == 1
    np.testing.assert_allclose(fitted(torch.tensor([[2.0, 0.0, -1.0]])).exp().detach().numpy()[0, :2], [0.5, 0.5], rtol=1e-9)


def test_beta_calibration_of_scores_of_at_most_two_distinct_values_is_platt_scaling():
    """[1, log q1, -log q0] has rank 1 on constant scores and 2 on two distinct ones: a line of
    (a, b, c) fits equally well, and the fit had stopped anywhere on it, "converged" without a word
    (constant scores: a = 0.685, b = 1.315, sloped on unseen scores; two values: the exact optima
    a = 0 and a = 3 give 0.24 and 0.00 at llr -4; a review finding). Now it warns and fits a = b,
    Platt scaling, for either loss; three distinct values identify all three (no warning)."""
    llr = torch.tensor([0.5] * 60 + [2.0] * 60, dtype=torch.float64)
    labels = torch.tensor([1] * 30 + [0] * 30 + [1] * 48 + [0] * 12)
    unseen = torch.tensor([[0.0, -4.0], [0.0, 0.5], [0.0, 2.0], [0.0, 6.0]], dtype=torch.float64)
    for loss in ("log", "brier"):
        for logits in (torch.stack([torch.zeros_like(llr), llr], dim=1), torch.zeros(120, 2, dtype=torch.float64)):
            with pytest.warns(UserWarning, match=r"at most two distinct values \(or differ by round-off only\), which do not determine a and b apart"):
                beta = torchcal.BetaCalibration().fit(logits, labels, loss=loss)  # (constant ones: also "the same on every row")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (Platt's own warning of constant scores)
                platt = torchcal.PlattScaling().fit(logits, labels, loss=loss)
            assert beta.a.item() == beta.b.item() == pytest.approx(platt.slope, abs=1e-12)
            torch.testing.assert_close(beta(unseen), platt(unseen), rtol=0, atol=1e-9)
    # two values: the frequencies 0.5 and 0.8 exactly (NumPy: the logistic fit through both points)
    beta = torchcal.BetaCalibration()
    with pytest.warns(UserWarning, match="two distinct values"):
        beta.fit(torch.stack([torch.zeros_like(llr), llr], dim=1), labels)
    slope = (np.log(0.8 / 0.2) - np.log(0.5 / 0.5)) / 1.5
    np.testing.assert_allclose(beta.predict_proba(unseen)[:, 1].detach().numpy(),
                               1 / (1 + np.exp(-(slope * (np.array([-4.0, 0.5, 2.0, 6.0]) - 0.5)))), rtol=1e-8)
    # constant scores: the base rate everywhere, said under Beta's name
    with pytest.warns(UserWarning) as caught:
        beta = torchcal.BetaCalibration().fit(torch.zeros(120, 2), labels)
    assert [str(w.message).split(":")[0] for w in caught] == ["BetaCalibration"] * 2
    assert "the same on every calibration row" in str(caught[1].message)
    assert beta.a.item() == beta.b.item() == 0.0
    np.testing.assert_allclose(beta.predict_proba(unseen)[:, 1].detach().numpy(), 78 / 120, rtol=1e-9)
    three = torch.cat([llr, torch.tensor([1.0] * 10, dtype=torch.float64)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*distinct values")
        torchcal.BetaCalibration().fit(torch.stack([torch.zeros_like(three), three], dim=1), torch.cat([labels, torch.arange(10) % 2]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_brier_temperature_fit_of_rows_whose_two_largest_scores_tie(dtype):
    """Every row's two largest scores tied (a constant classifier): the margin is 0 and the largest
    inverse temperature searched was 1e304, inf in float32, and inf * 0 made every Brier value of
    the grid NaN: `max() arg is an empty sequence` (a review finding). Constant rows give uniform
    posteriors at every temperature, a Brier score of 1 - 1/K; rows like [10, 10, 3] are best at
    T -> 0, [0.5, 0.5, 0] (a first fix searched betas up to half of float32's largest number, whose
    product with 10 overflowed: T = 6e-39 and uniform posteriors; the diff review)."""
    labels = torch.arange(300) % 10
    constant = torch.zeros(300, 10, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("not positively related": T = inf)
        assert torchcal.TemperatureScaling().fit(constant, labels, loss="brier").temperature == math.inf
        assert float(F.refinement_loss(constant, labels, loss="brier")) == pytest.approx(0.9, rel=1e-12)
    tied = torch.tensor([[10.0, 10.0, 3.0]], dtype=dtype).repeat(60, 1)
    two = torch.arange(60) % 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = torchcal.TemperatureScaling().fit(tied, two, loss="brier")
    assert 0 < fitted.temperature < 1
    np.testing.assert_allclose(fitted(tied.double()).exp()[0].detach().numpy(), [0.5, 0.5, 0.0], atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = torchcal.TemperatureScaling().fit(tied, two)  # (the log-loss fit of float32 rows ended uniform too)
    np.testing.assert_allclose(fitted(tied.double()).exp()[0].detach().numpy(), [0.5, 0.5, 0.0], atol=1e-6)
