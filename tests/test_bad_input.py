"""Bad input: every public entry point stops with a clear error (type and a message naming the
problem), or warns and does something documented. Nothing returns a plausible wrong number.

The first block is a matrix: each kind of bad scores or labels is fed to every entry point that
takes ``(logits, labels)``: the functional metrics, the streaming metrics, the calibrators'
``fit`` and ``forward``, cross-validation, the bootstrap and the calibration loss.
"""

from __future__ import annotations

import warnings
from functools import partial

import numpy as np
import pytest
import torch

import torchcal
import torchcal.functional as F
from torchcal import metrics
from torchcal._validation import check_costs, check_labels, check_logits, check_priors, check_probs
from torchcal.data import load_scores
from torchcal.functional.reliability_intervals import binomial_interval

K = 3
N = 12


def good_data():
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(N) % K  # every class present
    logits = 2 * torch.randn(N, K, generator=gen) + 2 * torch.eye(K)[labels]
    return logits, labels


def _fitted_temperature():
    logits, labels = good_data()
    return torchcal.TemperatureScaling().fit(logits, labels)


def _metric_update(make):
    def call(logits, labels):
        make().update(logits, labels)

    return call


# Every entry point that takes (logits, labels). Each is called once per bad input below.
ENTRY_POINTS = {
    "cross_entropy": F.cross_entropy,
    "cross_entropy(priors)": lambda z, y: F.cross_entropy(z, y, priors=torch.full((K,), 1 / K)),
    "brier_score": F.brier_score,
    "error_rate": F.error_rate,
    "balanced_error_rate": F.balanced_error_rate,
    "bayes_risk": lambda z, y: F.bayes_risk(z, y, F.zero_one_costs(K)),
    "expected_calibration_error": F.expected_calibration_error,
    "ece(quantile, classwise)": lambda z, y: F.expected_calibration_error(z, y, strategy="quantile", kind="classwise"),
    "reliability_bins": F.reliability_bins,
    "signed_calibration_error": F.signed_calibration_error,
    "entropic_calibration_difference": F.entropic_calibration_difference,
    "ecd(binned)": lambda z, y: F.entropic_calibration_difference(z, y, n_bins=5),
    "calibration_loss": lambda z, y: F.calibration_loss(z, z / 2 if torch.is_tensor(z) and z.is_floating_point() else z, y),
    "bootstrap(fast path)": lambda z, y: F.bootstrap(F.cross_entropy, z, y, num_replicates=5),
    "bootstrap(general path)": lambda z, y: F.bootstrap(F.smooth_calibration_error, z, y, num_replicates=5),  # no sum decomposition
    "cross_validate": lambda z, y: torchcal.cross_validate(torchcal.TemperatureScaling(), z, y, folds=2),
    "cross_validated_calibration_loss": lambda z, y: F.cross_validated_calibration_loss(z, y, torchcal.TemperatureScaling(), folds=2),
    "CrossEntropy.update": _metric_update(lambda: metrics.CrossEntropy(num_classes=K)),
    "BrierScore.update": _metric_update(lambda: metrics.BrierScore(num_classes=K)),
    "BayesRisk.update": _metric_update(lambda: metrics.BayesRisk(F.zero_one_costs(K))),
    "CalibrationError.update": _metric_update(lambda: metrics.CalibrationError(num_classes=K)),
    "CalibrationError(quantile).update": _metric_update(lambda: metrics.CalibrationError(num_classes=K, strategy="quantile")),
    "ECD.update": _metric_update(lambda: metrics.ECD()),
    "CalibrationLoss(fitted).update": _metric_update(lambda: metrics.CalibrationLoss(_fitted_temperature(), num_classes=K)),
    "CalibrationLoss(unfitted).update": _metric_update(lambda: metrics.CalibrationLoss(torchcal.TemperatureScaling(), num_classes=K)),
    "TemperatureScaling.fit": lambda z, y: torchcal.TemperatureScaling().fit(z, y),
    "TemperatureScaling.fit(brier)": lambda z, y: torchcal.TemperatureScaling().fit(z, y, loss="brier"),
    "AffineCalibration.fit": lambda z, y: torchcal.AffineCalibration().fit(z, y),
    "VectorScaling.fit": lambda z, y: torchcal.VectorScaling().fit(z, y),
    "DirichletCalibration.fit": lambda z, y: torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0).fit(z, y),
    "HistogramBinning.fit": lambda z, y: torchcal.HistogramBinning().fit(z, y),
    "IsotonicCalibration.fit": lambda z, y: torchcal.IsotonicCalibration().fit(z, y),
}

# Only the scores: the fitted calibrator's forward.
FORWARD_ENTRY_POINTS = {
    "TemperatureScaling.forward": lambda z, y: _fitted_temperature()(z),
    "bayes_decisions": lambda z, y: F.bayes_decisions(z, F.zero_one_costs(K)),
}


def _nan_logits():
    z, _ = good_data()
    z[4, 1] = float("nan")
    return z


def _inf_logits(value):
    z, _ = good_data()
    z[7, 0] = value
    return z


# (name, make logits, make labels, error type, message pattern). Labels-only problems do not
# apply to FORWARD_ENTRY_POINTS.
BAD_SCORES = [
    ("NaN logits", _nan_logits, None, ValueError, r"1 NaN and 0 infinite values \(first in row 4\)"),
    ("+inf logits", lambda: _inf_logits(float("inf")), None, ValueError, r"0 NaN and 1 infinite values \(first in row 7\)"),
    ("-inf logits (log of a zero probability)", lambda: _inf_logits(float("-inf")), None, ValueError, r"infinite values.*log\(0\)"),
    ("+inf and -inf logits", lambda: _inf_logits(float("-inf")).index_fill_(0, torch.tensor([9]), float("inf")), None, ValueError, r"0 NaN and 4 infinite values \(first in row 7\)"),
    ("integer logits", lambda: torch.ones(N, K, dtype=torch.long), None, ValueError, "must be a floating-point tensor"),
    ("1-D logits", lambda: torch.randn(N), None, ValueError,
     # (a metric that takes any K names the option that reads one column as binary scores)
     r"shape \(N, K\), got shape \(12,\).*binary_scores_to_logits|got one score per sample \(shape \(12,\)\).*num_classes=2"),
    ("3-D logits", lambda: torch.randn(N, K, 1), None, ValueError, r"shape \(N, K\), got shape \(12, 3, 1\)"),
    ("one column (K = 1)", lambda: torch.randn(N, 1), lambda: torch.zeros(N, dtype=torch.long), ValueError, "K >= 2 class columns, got K = 1"),
    ("empty input (N = 0)", lambda: torch.randn(0, K), lambda: torch.zeros(0, dtype=torch.long), ValueError, r"empty \(N = 0\)"),
    ("a Python string", lambda: "logits.npy", None, TypeError, "must be a torch.Tensor or a NumPy array, got str"),
]
BAD_LABELS = [
    ("label = K", lambda: torch.tensor([0, 1, 2, 3] * 3), ValueError, r"must lie in \[0, 3\).*3 out-of-range value\(s\), e.g. 3"),
    ("negative label", lambda: torch.tensor([0, 1, 2, -1] * 3), ValueError, r"must lie in \[0, 3\).*e.g. -1"),
    ("whole-number float labels", lambda: (torch.arange(N) % K).float(), ValueError, r"integer tensor of class indices.*\.long\(\)"),
    ("fractional labels", lambda: torch.full((N,), 0.5), ValueError, "integer tensor of class indices"),
    ("one-hot labels (2-D)", lambda: torch.eye(K)[torch.arange(N) % K].long(), ValueError, r"labels must have shape \(N,\)"),
    ("column labels (N, 1)", lambda: (torch.arange(N) % K).reshape(N, 1), ValueError, r"shape \(N,\).*reshape\(-1\)"),
    ("more labels than rows", lambda: torch.arange(N + 1) % K, ValueError, "labels has 13 entries but the scores have N = 12 rows"),
    ("fewer labels than rows", lambda: torch.arange(N - 1) % K, ValueError, "labels has 11 entries but the scores have N = 12 rows"),
]

# The bootstrap checks that it can resample before anything else: its own message names N.
_BOOTSTRAP_N = r"same number N of rows to resample"


def _cases():
    for name, make_logits, make_labels, error, pattern in BAD_SCORES:
        for entry, fn in {**ENTRY_POINTS, **FORWARD_ENTRY_POINTS}.items():
            if name.startswith("empty") and entry.endswith((".update", ".forward")):
                # an empty batch is a no-op for a metric (test_metric_update_ignores_an_empty_batch), and a
                # fitted calibrator maps it to an empty batch (test_heads: test_an_empty_batch_gives_an_empty_batch)
                continue
            yield pytest.param(fn, make_logits, make_labels, error, pattern, id=f"{name}-{entry}")
    for name, make_labels, error, pattern in BAD_LABELS:
        for entry, fn in ENTRY_POINTS.items():
            expected = _BOOTSTRAP_N if entry.startswith("bootstrap") and "entries" in pattern else pattern
            yield pytest.param(fn, lambda: good_data()[0], make_labels, error, expected, id=f"{name}-{entry}")


@pytest.mark.parametrize("fn, make_logits, make_labels, error, pattern", list(_cases()))
def test_every_entry_point_rejects_bad_scores_and_labels(fn, make_logits, make_labels, error, pattern):
    logits = make_logits()
    labels = good_data()[1] if make_labels is None else make_labels()
    if isinstance(logits, torch.Tensor) and logits.ndim == 2 and make_labels is None:
        labels = labels[: logits.shape[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. a missing class: the error must still come
        with pytest.raises(error, match=pattern):
            fn(logits, labels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_finite_scores_whose_sum_overflows_pass(dtype):
    """The cheap finiteness test is the sum; when it overflows, the entry-wise check decides."""
    from torchcal._validation import check_logits, check_logits_and_labels

    big = torch.finfo(dtype).max
    logits = torch.tensor([[big, big], [big, 0.0], [-big, -big]], dtype=dtype)
    assert check_logits(logits) is logits
    check_logits_and_labels(logits, torch.tensor([0, 1, 1]))
    logits[2, 1] = float("nan")
    with pytest.raises(ValueError, match="1 NaN"):
        check_logits(logits)


def test_numpy_input_is_validated_like_tensors():
    logits, labels = good_data()
    bad = logits.numpy().copy()
    bad[2, 2] = np.nan
    with pytest.raises(ValueError, match="1 NaN"):
        F.cross_entropy(bad, labels.numpy())
    with pytest.raises(ValueError, match="integer tensor of class indices"):
        F.cross_entropy(logits.numpy(), labels.numpy().astype(np.float32))


@pytest.mark.parametrize(
    "make",
    [torchcal.TemperatureScaling, torchcal.DirichletCalibration, torchcal.StructuredVectorScaling, torchcal.IsotonicCalibration,
     torchcal.VennAbersCalibration],
)
def test_a_calibrator_fitted_on_numpy_arrays_applies_to_them(make):
    """``fit`` takes NumPy arrays; ``forward`` and ``predict_proba`` did not (a TypeError from
    torch.promote_types, or an AttributeError)."""
    logits, labels = good_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 12 samples: the fits' small-sample warnings
        cal = make().fit(logits.numpy(), labels.numpy())
    torch.testing.assert_close(cal(logits.numpy()), cal(logits))
    torch.testing.assert_close(cal.predict_proba(logits.numpy()), cal.predict_proba(logits))
    bad = logits.numpy().copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinite"):
        cal(bad)


# --------------------------------------------------------------------------- labels of any integer dtype
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool])
def test_labels_of_any_integer_dtype_give_the_int64_answer(dtype):
    """Labels stored compactly (uint8 from an image data set, int16, int32 from NumPy on Windows)
    used to crash deep inside gather/index_add, and uint8 decisions were read as a boolean mask by
    ``expected_cost``, which then returned 0.0 instead of the true cost."""
    gen = torch.Generator().manual_seed(3)
    k = 2 if dtype == torch.bool else 4
    labels = torch.arange(40) % k
    logits = torch.randn(40, k, generator=gen) + torch.eye(k)[labels]
    compact = labels.to(dtype)
    for fn in (F.cross_entropy, F.brier_score, F.error_rate, F.balanced_error_rate,
               F.expected_calibration_error, F.signed_calibration_error, F.entropic_calibration_difference):
        assert fn(logits, compact).item() == fn(logits, labels).item(), fn.__name__
    costs = F.zero_one_costs(k)
    assert F.bayes_risk(logits, compact, costs).item() == F.bayes_risk(logits, labels, costs).item()
    decisions = (labels + 1) % k  # every decision wrong: expected cost 1
    assert F.expected_cost(decisions.to(dtype), compact, costs).item() == 1.0
    metric = metrics.CrossEntropy(num_classes=k)
    metric.update(logits, compact)
    assert metric.compute().item() == F.cross_entropy(logits, labels).item()
    a = torchcal.AffineCalibration().fit(logits, compact)
    b = torchcal.AffineCalibration().fit(logits, labels)
    assert torch.equal(a(logits), b(logits))


def test_uint8_decisions_with_as_many_samples_as_decisions():
    # N == M made the uint8 decisions a valid boolean mask over the cost columns: a wrong answer
    # (0.0) instead of an error.
    costs = F.zero_one_costs(3)
    labels = torch.tensor([0, 1, 2])
    decisions = torch.tensor([1, 1, 1], dtype=torch.uint8)
    assert F.expected_cost(decisions, labels, costs).item() == pytest.approx(2 / 3)
    metric = metrics.ExpectedCost(costs)
    metric.update(decisions, labels)
    assert metric.compute().item() == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- K mismatch
def test_calibrator_applied_to_another_number_of_classes():
    logits, labels = good_data()
    for cal in (torchcal.TemperatureScaling(), torchcal.AffineCalibration(), torchcal.IsotonicCalibration()):
        cal.fit(logits, labels)
        with pytest.raises(ValueError, match=rf"K = 4 classes but 3 were expected \(the number of classes {type(cal).__name__} was fitted on\)"):
            cal(torch.randn(5, 4))
        with pytest.raises(ValueError, match="K = 2 classes but 3 were expected"):
            cal(torch.randn(5, 2))


def test_state_dict_of_another_number_of_classes_replaces_the_shapes():
    logits, labels = good_data()
    cal = torchcal.VectorScaling().fit(logits, labels)
    other = torchcal.VectorScaling().fit(torch.randn(20, 5), torch.arange(20) % 5)
    other.load_state_dict(cal.state_dict())  # K follows the loaded state
    assert other.num_classes == K and torch.equal(other(logits), cal(logits))
    with pytest.raises(ValueError, match="K = 5 classes but 3 were expected"):
        other(torch.randn(4, 5))


@pytest.mark.parametrize(
    "make, name, cut",
    [
        (partial(torchcal.DirichletCalibration, reg="odir", reg_lambda=1.0), "weight", lambda t: t[:2]),
        (partial(torchcal.DirichletCalibration, reg="odir", reg_lambda=1.0), "bias", lambda t: t[:2]),
        (torchcal.VectorScaling, "weight", lambda t: t[:2]),
        (torchcal.AffineCalibration, "beta", lambda t: t[:2]),
        (torchcal.IsotonicCalibration, "thresholds", lambda t: t[:2]),
        (torchcal.HistogramBinning, "edges", lambda t: t[0]),
    ],
    ids=["matrix-weight", "matrix-bias", "vector-weight", "affine-beta", "isotonic-thresholds", "histogram-edges"],
)
def test_state_dict_whose_tensors_do_not_fit_its_number_of_classes(make, name, cut):
    logits, labels = good_data()
    state = make().fit(logits, labels).state_dict()
    given = tuple(cut(state[name]).shape)
    state[name] = cut(state[name])
    with pytest.raises(ValueError, match=rf"'{name}' has shape \({given[0]},.*num_classes = 3.*needs shape"):
        make().load_state_dict(state)
    with pytest.raises(ValueError, match=rf"'{name}' has shape"):
        make().fit(logits, labels).load_state_dict(state)


def test_state_dict_whose_step_maps_have_other_lengths_loads():
    logits, labels = good_data()
    for make in (lambda: torchcal.HistogramBinning(n_bins=4), torchcal.IsotonicCalibration, torchcal.VennAbersCalibration):
        cal = make().fit(logits, labels)
        other = make().fit(torch.randn(40, K), torch.arange(40) % K)
        other.load_state_dict(cal.state_dict())
        assert torch.equal(other(logits), cal(logits))
    fewer = torchcal.HistogramBinning(n_bins=3)
    fewer.load_state_dict(torchcal.HistogramBinning(n_bins=5).fit(logits, labels).state_dict())
    assert fewer.edges.shape == (K, 6)


def test_metric_updated_with_another_number_of_classes():
    logits, labels = good_data()
    wider = torch.randn(N, K + 1)
    for metric in (
        metrics.CrossEntropy(num_classes=K),
        metrics.BrierScore(num_classes=K),
        metrics.BayesRisk(F.zero_one_costs(K)),
        metrics.CalibrationError(num_classes=K),
        metrics.CalibrationLoss(_fitted_temperature(), num_classes=K),
    ):
        metric.update(logits, labels)
        with pytest.raises(ValueError, match=rf"K = 4 classes but 3 were expected \(the number of classes {type(metric).__name__} was built for\)"):
            metric.update(wider, labels)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e.endswith(".update")])
def test_metric_update_ignores_an_empty_batch(entry):
    """An empty batch (the last of a loader, or every label ignored) changes nothing."""
    make = {
        "CrossEntropy.update": lambda: metrics.CrossEntropy(num_classes=K),
        "BrierScore.update": lambda: metrics.BrierScore(num_classes=K),
        "BayesRisk.update": lambda: metrics.BayesRisk(F.zero_one_costs(K)),
        "CalibrationError.update": lambda: metrics.CalibrationError(num_classes=K),
        "CalibrationError(quantile).update": lambda: metrics.CalibrationError(num_classes=K, strategy="quantile"),
        "ECD.update": lambda: metrics.ECD(),
        "CalibrationLoss(fitted).update": lambda: metrics.CalibrationLoss(_fitted_temperature(), num_classes=K),
        "CalibrationLoss(unfitted).update": lambda: metrics.CalibrationLoss(torchcal.TemperatureScaling(), num_classes=K, folds=2),
    }[entry]
    logits, labels = good_data()
    with_empty, without = make(), make()
    for metric in (with_empty, without):
        metric.update(logits, labels)
    with_empty.update(torch.randn(0, K), torch.zeros(0, dtype=torch.long))
    assert with_empty.compute().item() == pytest.approx(without.compute().item(), rel=1e-12)


def test_metric_constructor_arguments():
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2, got 1"):
        metrics.CrossEntropy(num_classes=1)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2, got 2.0"):
        metrics.CalibrationError(num_classes=2.0)
    with pytest.raises(ValueError, match="n_bins must be a positive integer, got 0"):
        metrics.CalibrationError(num_classes=2, n_bins=0)
    with pytest.raises(ValueError, match='kind="binary" needs K = 2'):
        metrics.CalibrationError(num_classes=3, kind="binary")


def test_calibrator_for_two_classes_given_three():
    logits, labels = good_data()
    for make in (torchcal.PlattScaling, torchcal.BetaCalibration):
        with pytest.raises(ValueError, match="is for K = 2 classes, got K = 3"):
            make().fit(logits, labels)


def test_unfitted_calibrator():
    with pytest.raises(RuntimeError, match="not fitted yet"):
        torchcal.AffineCalibration()(torch.randn(4, 3))


# --------------------------------------------------------------------------- a class missing from the calibration data
@pytest.mark.parametrize(
    "make",
    [torchcal.AffineCalibration, torchcal.VectorScaling, partial(torchcal.DirichletCalibration, reg="odir", reg_lambda=1.0)],
    ids=["affine", "vector", "dirichlet-odir"],
)
def test_missing_class_warns_and_is_pushed_down(make):
    """Documented behaviour: a warning naming the class, finite normalised output, and the absent
    class's posterior lowered below the raw one (the fit cannot learn anything else about it)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 4, generator=gen)
    labels = torch.argmax(logits[:, :3] + torch.randn(300, 3, generator=gen), dim=1)  # never class 3
    with pytest.warns(UserWarning, match=r"classes \[3\] have no sample in the calibration data"):
        cal = make().fit(logits, labels)
    out = cal(logits)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.logsumexp(dim=1), torch.zeros(300), atol=1e-5)
    raw = torch.softmax(logits, dim=1)[:, 3]
    assert (out.exp()[:, 3] < raw).all()


def test_missing_class_with_a_positive_prior_is_an_error():
    logits, _ = good_data()
    labels = torch.arange(N) % 2  # class 2 absent
    priors = torch.tensor([0.3, 0.3, 0.4])
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        F.cross_entropy(logits, labels, priors=priors)
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        F.bayes_risk(logits, labels, F.zero_one_costs(K), priors=priors)
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        with pytest.warns(UserWarning, match="no sample"):
            torchcal.AffineCalibration().fit(logits, labels, priors=priors)
    metric = metrics.CrossEntropy(num_classes=K, priors=priors)
    metric.update(logits, labels)
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        metric.compute()
    # With prior 0 the class is simply left out.
    assert torch.isfinite(F.cross_entropy(logits, labels, priors=torch.tensor([0.5, 0.5, 0.0])))


# --------------------------------------------------------------------------- normalising by a naive system that is perfect
@pytest.mark.parametrize("fn", [F.cross_entropy, F.brier_score], ids=["NCE", "NBS"])
def test_normalised_score_of_a_single_class_is_an_error(fn):
    """With one class (empirical priors) or a one-hot prior, the naive system is perfect and the
    normalised score is undefined: it used to come back as -inf (NCE) or inf (NBS)."""
    logits, _ = good_data()
    labels = torch.zeros(N, dtype=torch.long)
    with pytest.raises(ValueError, match="naive system.*score of 0.*normalised score is undefined"):
        fn(logits, labels, normalize=True)
    with pytest.raises(ValueError, match="naive system.*score of 0.*normalised score is undefined"):
        fn(logits, labels, priors=torch.tensor([1.0, 0.0, 0.0]), normalize=True)
    metric = (metrics.CrossEntropy if fn is F.cross_entropy else metrics.BrierScore)(num_classes=K, normalize=True)
    metric.update(logits, labels)
    with pytest.raises(ValueError, match="normalised score is undefined"):
        metric.compute()
    with pytest.raises(ValueError, match="normalised score is undefined"):
        F.bootstrap(fn, logits, labels, num_replicates=5, normalize=True)
    assert torch.isfinite(fn(logits, labels))  # the plain score is fine


def test_normalised_expected_cost_of_a_free_naive_decision_is_an_error():
    logits, _ = good_data()
    labels = torch.zeros(N, dtype=torch.long)
    with pytest.raises(ValueError, match="best naive decision has zero expected cost"):
        F.bayes_risk(logits, labels, F.zero_one_costs(K), normalize=True)


# --------------------------------------------------------------------------- probabilities
@pytest.mark.parametrize(
    "probs, pattern",
    [
        (torch.tensor([[0.5, 0.4], [0.5, 0.5]]), r"rows of probs must sum to one \(within 0.0001\); row 0 sums to 0.9"),
        (torch.tensor([[0.7, 0.7], [0.5, 0.5]]), "row 0 sums to 1.4"),
        (torch.tensor([[1.5, -0.5], [0.5, 0.5]]), r"must lie in \[0, 1\].*Did you pass logits"),
        (torch.tensor([[0.5, 0.5], [0.5, 0.498]], dtype=torch.float16), r"within 0.001.*row 1"),
        (torch.tensor([[0.5, float("nan")]]), "1 NaN"),
        (torch.tensor([0.2, 0.8]), r"shape \(N, K\)"),
    ],
)
def test_probabilities_that_are_not_probabilities(probs, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_probs(probs)


def test_probabilities_within_tolerance_pass():
    probs = torch.tensor([[0.5, 0.50005], [0.25, 0.75]])
    assert check_probs(probs) is probs


def test_probability_file_whose_rows_do_not_sum_to_one(tmp_path):
    path = tmp_path / "scores.npz"
    np.savez(path, probs=np.array([[0.5, 0.4], [0.2, 0.8]]), labels=np.array([0, 1]))
    with pytest.raises(ValueError, match="rows of probabilities must sum to one; row 0 sums to 0.9"):
        load_scores(path)


# --------------------------------------------------------------------------- priors
BAD_PRIORS = [
    (torch.tensor([0.5, 0.3, 0.1]), r"priors must sum to one \(within 0.0001\), got sum 0.9"),
    (torch.tensor([0.6, 0.6, -0.2]), "priors must be finite and non-negative"),
    (torch.tensor([0.5, float("nan"), 0.5]), "priors must be finite and non-negative"),
    (torch.tensor([0.5, 0.5]), r"priors must have shape \(3,\) for K = 3 classes, got \(2,\)"),
    (torch.full((1, 3), 1 / 3), r"priors must have shape \(3,\)"),
    (torch.tensor([1, 2, 1]) / 4 * 100, r"priors must sum to one \(within 0.0001\), got sum 100; divide them by their sum"),
]
PRIOR_ENTRY_POINTS = {
    "cross_entropy": lambda p: F.cross_entropy(*good_data(), priors=p),
    "brier_score": lambda p: F.brier_score(*good_data(), priors=p),
    "bayes_risk": lambda p: F.bayes_risk(*good_data(), F.zero_one_costs(K), priors=p),
    "expected_cost": lambda p: F.expected_cost(good_data()[1], good_data()[1], F.zero_one_costs(K), priors=p),
    "calibration_loss": lambda p: F.calibration_loss(good_data()[0], good_data()[0] / 2, good_data()[1], priors=p),
    "CrossEntropy()": lambda p: metrics.CrossEntropy(num_classes=K, priors=p),
    "BayesRisk()": lambda p: metrics.BayesRisk(F.zero_one_costs(K), priors=p),
    "CalibrationLoss()": lambda p: metrics.CalibrationLoss(torchcal.TemperatureScaling(), num_classes=K, priors=p),
    "AffineCalibration.fit": lambda p: torchcal.AffineCalibration().fit(*good_data(), priors=p),
    "TemperatureScaling.fit": lambda p: torchcal.TemperatureScaling().fit(*good_data(), priors=p),
}


@pytest.mark.parametrize("entry", PRIOR_ENTRY_POINTS)
@pytest.mark.parametrize("priors, pattern", BAD_PRIORS)
def test_bad_priors(entry, priors, pattern):
    with pytest.raises(ValueError, match=pattern):
        PRIOR_ENTRY_POINTS[entry](priors)


def test_priors_rounded_to_six_decimals_are_accepted_and_divided_by_their_sum():
    """0.333333 three times sums to 0.999999: round-off of how priors are written, not a mistake
    (it was refused at a tolerance of 1e-6); the values used are divided by the sum."""
    logits, labels = good_data()
    rounded = torch.full((K,), round(1 / K, 6), dtype=torch.float64)
    assert abs(float(rounded.sum()) - 1) > 1e-7
    exact = torch.full((K,), 1 / K, dtype=torch.float64)
    torch.testing.assert_close(check_priors(rounded, K), exact, rtol=1e-15, atol=0)
    torch.testing.assert_close(F.cross_entropy(logits, labels, priors=rounded), F.cross_entropy(logits, labels, priors=exact))


# --------------------------------------------------------------------------- costs
BAD_COSTS = [
    (torch.tensor([[0.0, 1.0, -0.1], [1.0, 0.0, 0.5], [1.0, 1.0, 0.0]]), "costs must be non-negative; subtract each row's minimum"),
    (torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, float("inf")]]), "costs must be finite"),
    (torch.tensor([[0.0, float("nan")], [1.0, 0.0], [1.0, 1.0]]), "costs must be finite"),
    (F.zero_one_costs(2), r"costs must have shape \(K, M\) = \(3, M\).*got \(2, 2\)"),
    (F.zero_one_costs(4), r"costs must have shape \(K, M\) = \(3, M\).*got \(4, 4\)"),
    (torch.ones(3), r"costs must have shape \(K, M\) = \(3, M\).*got \(3,\)"),
    (torch.ones(3, 0), r"got \(3, 0\)"),
    (torch.ones(3, 3, 1), r"got \(3, 3, 1\)"),
]
COST_ENTRY_POINTS = {
    "bayes_decisions": lambda c: F.bayes_decisions(good_data()[0], c),
    "bayes_risk": lambda c: F.bayes_risk(*good_data(), c),
    "expected_cost": lambda c: F.expected_cost(torch.zeros(N, dtype=torch.long), good_data()[1], c),
    "BayesRisk().update": lambda c: metrics.BayesRisk(c).update(*good_data()),
}


def _cost_cases():
    for costs, pattern in BAD_COSTS:
        for entry in COST_ENTRY_POINTS:
            # Without scores K is read off the cost matrix: see test_cost_matrix_for_another_k.
            if not ("= \\(3, M\\)" in pattern and entry in ("expected_cost", "BayesRisk().update")):
                yield pytest.param(entry, costs, pattern, id=f"{entry}-{tuple(costs.shape)}-{pattern[:20]}")


@pytest.mark.parametrize("entry, costs, pattern", list(_cost_cases()))
def test_bad_costs(entry, costs, pattern):
    with pytest.raises(ValueError, match=pattern):
        COST_ENTRY_POINTS[entry](costs)


def test_cost_matrix_for_another_k():
    """Where K is read off the cost matrix, a matrix for another K shows up as labels or scores
    that do not fit it."""
    logits, labels = good_data()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\) for K = 2 classes"):
        F.expected_cost(torch.zeros(N, dtype=torch.long), labels, F.zero_one_costs(2))
    for k in (2, 4):
        with pytest.raises(ValueError, match=rf"logits has K = 3 classes but {k} were expected \(the number of classes BayesRisk was built for\)"):
            metrics.BayesRisk(F.zero_one_costs(k)).update(logits, labels)


def test_decisions_outside_the_cost_matrix():
    labels = good_data()[1]
    with pytest.raises(ValueError, match=r"decisions must lie in \[0, 3\) for M = 3 decisions"):
        F.expected_cost(torch.full((N,), 3), labels, F.zero_one_costs(K))
    with pytest.raises(ValueError, match="decisions must be an integer"):
        F.expected_cost(torch.zeros(N), labels, F.zero_one_costs(K))
    with pytest.raises(ValueError, match="abstain must be a finite, non-negative cost"):
        F.zero_one_costs(3, abstain=-0.5)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2, got 1"):
        F.zero_one_costs(1)


# --------------------------------------------------------------------------- cross-validation folds
@pytest.mark.parametrize(
    "call",
    [
        lambda z, y: torchcal.cross_validate(torchcal.AffineCalibration(), z, y, folds=5),
        lambda z, y: F.cross_validated_calibration_loss(z, y, torchcal.AffineCalibration(), folds=5),
        lambda z, y: torchcal.DirichletCalibration(reg="odir", cv_folds=5).fit(z, y),
        lambda z, y: torchcal.MatrixScaling(reg="l2", cv_folds=5).fit(z, y),
    ],
    ids=["cross_validate", "cross_validated_calibration_loss", "dirichlet-cv", "matrix-cv"],
)
def test_fewer_samples_than_folds(call):
    logits, labels = good_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="with 5 folds needs at least 5 samples, got N = 4"):
            call(logits[:4], labels[:4])


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda folds, seed: torchcal.MatrixScaling(reg="odir", cv_folds=folds, cv_seed=seed), "cv_"),
        (lambda folds, seed: torchcal.DirichletCalibration(reg="odir", cv_folds=folds, cv_seed=seed), "cv_"),
        (lambda folds, seed: torchcal.StructuredVectorScaling(cv_folds=folds, cv_seed=seed), "cv_"),
        (lambda folds, seed: torchcal.StructuredMatrixScaling(cv_folds=folds, cv_seed=seed), "cv_"),
        (lambda folds, seed: metrics.CalibrationLoss(torchcal.TemperatureScaling(), num_classes=K, folds=folds, seed=seed), ""),
    ],
    ids=["matrix", "dirichlet", "svs", "sms", "CalibrationLoss"],
)
@pytest.mark.parametrize(("folds", "seed", "name"), [(2.5, 0, "folds"), (True, 0, "folds"), (5, None, "seed"), (5, 0.5, "seed")])
def test_fold_count_and_seed_are_checked_when_constructed(make, argument, folds, seed, name):
    """A float or bool fold count, or a seed that is not an int, used to fail inside the fit's
    cross-validation (after a pre-fit) with a torch indexing or manual_seed error."""
    with pytest.raises(ValueError, match=f"^{argument}{name} must be an integer"):
        make(folds, seed)


@pytest.mark.parametrize(("folds", "seed", "name"), [(2.5, 0, "folds"), (5, None, "seed")])
def test_fold_count_and_seed_of_cross_validate_are_checked(folds, seed, name):
    logits, labels = good_data()
    with pytest.raises(ValueError, match=f"^{name} must be an integer"):
        torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels, folds=folds, seed=seed)
    with pytest.raises(ValueError, match=f"^{name} must be an integer"):
        F.cross_validated_calibration_loss(logits, labels, torchcal.AffineCalibration(), folds=folds, seed=seed)
    with pytest.raises(ValueError, match=f"^{name} must be an integer"):
        torchcal.fit.fold_indices(labels, folds, seed)


def test_fewer_samples_than_folds_in_the_streaming_calibration_loss():
    logits, labels = good_data()
    metric = metrics.CalibrationLoss(torchcal.TemperatureScaling(), num_classes=K, folds=5)
    metric.update(logits[:2], labels[:2])
    metric.update(logits[2:4], labels[2:4])
    with pytest.raises(ValueError, match="with 5 folds needs at least 5 samples, got N = 4"):
        metric.compute()


def test_fold_counts_and_groups():
    logits, labels = good_data()
    with pytest.raises(ValueError, match="folds must be an integer >= 2, got 1"):
        torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, folds=1)
    with pytest.raises(ValueError, match="2 groups cannot fill 3 folds"):
        torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, folds=3, groups=torch.arange(N) % 2)
    with pytest.raises(ValueError, match=r"groups must have shape \(12,\)"):
        torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, folds=3, groups=torch.arange(5))
    with pytest.warns(UserWarning, match=r"class\(es\) \[0\] have a single sample: the training part of its fold will miss it"):
        torchcal.fit.fold_indices(torch.tensor([0, 1, 1, 1, 1, 1, 1]), folds=3)
    with warnings.catch_warnings():  # two samples in different folds: every training part has one
        warnings.simplefilter("error")
        folds = torchcal.fit.fold_indices(torch.tensor([0, 0, 1, 1, 1, 1, 1]), folds=5)
    assert all(bool((torch.tensor([0, 0, 1, 1, 1, 1, 1])[torch.tensor([i for i in range(7) if i not in f])] == 0).any()) for f in folds)
    for labels, pattern in [(torch.tensor([0.0, 1.0, 1.0]), "labels must be an integer tensor of class indices, got dtype torch.float32"),
                            (torch.tensor([0, -1, 1]), r"labels must lie in \[0, 2\)"), ([[0, 1], [1, 0]], r"labels must have shape \(N,\)")]:
        with pytest.raises(ValueError, match=pattern):
            torchcal.fit.fold_indices(labels, folds=2)
    # with priors, a training part without a sample of a class: the error names the fold
    one_of_class_2 = torch.tensor([0, 1] * 5 + [2])
    with pytest.raises(ValueError, match=r"the training part of fold \d has no sample of class\(es\) \[2\]"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torchcal.cross_validate(torchcal.TemperatureScaling(), torch.randn(11, 3), one_of_class_2, folds=3,
                                    priors=torch.tensor([0.4, 0.4, 0.2]))


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), num_replicates=0), ValueError, "num_replicates must be an integer >= 2, got 0"),
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), num_replicates=1), ValueError, "num_replicates must be an integer >= 2, got 1"),
        (lambda: F.smooth_calibration_error(*good_data(), grid_points=0), ValueError, "grid_points must be an integer >= 3, got 0"),
        (lambda: F.smooth_calibration_error(*good_data(), grid_points=True), ValueError, "grid_points must be an integer >= 3, got True"),
        (lambda: F.smooth_calibration_error(*good_data(), grid_points=1.5), ValueError, "grid_points must be an integer >= 3, got 1.5"),
        (lambda: F.consistency_resampling_test(F.cross_entropy, *good_data(), num_resamples=2.5), ValueError, "num_resamples must be an integer >= 1, got 2.5"),
        (lambda: F.consistency_bands(*good_data(), num_resamples=1), ValueError, "num_resamples must be an integer >= 2, got 1"),
        (lambda: F.consistency_bands(*good_data(), num_resamples=True), ValueError, "num_resamples must be an integer >= 2, got True"),
        (lambda: F.smooth_reliability_curve(*good_data(), num_replicates=0), ValueError, "num_replicates must be an integer >= 2, got 0"),
        (lambda: binomial_interval(torch.tensor([12.0]), torch.tensor([10.0])), ValueError, r"successes must lie in \[0, trials\]"),
        (lambda: binomial_interval(torch.tensor([-1.0]), torch.tensor([10.0])), ValueError, r"successes must lie in \[0, trials\]"),
        (lambda: binomial_interval(torch.tensor([1.0]), torch.tensor([float("inf")])), ValueError, "trials be finite"),  # ([0.5, 0.5] before)
        (lambda: binomial_interval(torch.tensor([float("inf")]), torch.tensor([float("inf")]), method="wilson"), ValueError, "trials be finite"),
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), confidence=1.0), ValueError, "confidence must lie strictly between 0 and 1"),
        (lambda: F.expected_calibration_error(*good_data(), n_bins=True), ValueError, "n_bins must be a positive integer, got True"),
        (lambda: F.entropic_calibration_difference(*good_data(), n_bins=0), ValueError, "n_bins must be a positive integer"),
        (lambda: torchcal.AffineCalibration().fit(*good_data(), loss="hinge"), ValueError, r"loss must be one of \['brier', 'log'\]"),
        (lambda: torchcal.HistogramBinning(n_bins=0), ValueError, "n_bins must be an integer >= 1"),
        (lambda: torchcal.IsotonicCalibration(eps=0.7), ValueError, r"eps must be a number in \(0, 0.5\), got 0.7"),
        (lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=-1.0), ValueError, "reg_lambda must be finite and >= 0"),
        (lambda: F.calibration_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0]), torch.tensor([0.5, 0.5])), ValueError,
         "score must be a function"),
        (lambda: check_logits(torch.zeros(2, 3), num_classes=4), ValueError, "K = 3 classes but 4 were expected"),
        # a fuzz review's findings: complex priors and costs lost their imaginary part; bias="no" meant bias=True;
        # a model that is no module, NaN group ids and logits given for ReliabilityBins crashed or passed
        (lambda: F.cross_entropy(*good_data(), priors=torch.tensor([0.2 + 0.5j, 0.3 - 0.5j, 0.5])), ValueError, "priors must be real"),
        (lambda: F.expected_cost(torch.tensor([0, 1]), torch.tensor([0, 1]), F.zero_one_costs(2) + 1j), ValueError, "costs must be real"),
        (lambda: torchcal.AffineCalibration(bias="no"), TypeError, "bias must be True or False, got 'no'"),
        (lambda: torchcal.heads.attach("net", torchcal.TemperatureScaling()), TypeError, r"model must be the network \(a torch.nn.Module\)"),
        (lambda: torchcal.cross_validate(torchcal.TemperatureScaling(), *good_data(), groups=torch.tensor([float("nan")] * 6 + [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])),
         ValueError, "groups has NaN ids"),
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), normalise=True), TypeError, r"cross_entropy does not take the options \['normalise'\]"),
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), confidence="0.9"), ValueError, "confidence must lie strictly between 0 and 1, got '0.9'"),
        (lambda: F.bootstrap(F.cross_entropy, *good_data(), confidence=torch.tensor(1.5)), ValueError, "got 1.5"),
        (lambda: F.reliability_intervals(*good_data()), TypeError, r"call reliability_intervals\(reliability_bins\(logits, labels\)\)"),
    ],
)
def test_bad_options(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_python_lists_are_read_as_numpy_reads_them():
    """Costs and priors given as lists are float64, as NumPy reads them (torch.as_tensor would
    round them to float32 first: a Bayes risk of 0.20000000298 for a cost of 0.2)."""
    logits, labels = good_data()
    costs = [[0, 1, 0.2], [1, 0, 0.2], [1, 1, 0.2]]  # (K, K + 1): an abstain column
    assert F.bayes_risk(logits, labels, costs) == F.bayes_risk(logits, labels, np.array(costs))
    priors = [0.2, 0.3, 0.5]
    assert F.cross_entropy(logits, labels, priors=priors) == F.cross_entropy(logits, labels, priors=np.array(priors))


def test_validators_never_modify_their_input():
    logits, labels = good_data()
    before = logits.clone(), labels.clone()
    check_logits(logits)
    check_labels(labels, N, K)
    check_priors(torch.full((K,), 1 / K), K)
    check_costs(F.zero_one_costs(K), K)
    assert torch.equal(logits, before[0]) and torch.equal(labels, before[1])


# ---------------------------------------------------------------------------------------------
# Probabilities passed where logits are read: plausible, wrong numbers, so every entry point warns,
# pointing at the caller's line however deep the check runs.


def _probs_and_labels():
    logits, labels = good_data()
    return torch.softmax(logits, dim=1), labels


@pytest.mark.parametrize(
    "entry",
    [
        F.cross_entropy,
        F.expected_calibration_error,
        partial(F.bayes_risk, costs=F.zero_one_costs(K)),
        lambda p, y: torchcal.TemperatureScaling().fit(p, y),
        lambda p, y: F.bootstrap(F.cross_entropy, p, y, num_replicates=2),
        lambda p, y: _fitted_temperature()(p),  # through torch's Module.__call__
        lambda p, y: F.cross_entropy(p.half().repeat(20_000, 1), y.repeat(20_000)),  # N > 65,504 in float16
    ],
    ids=["cross_entropy", "ece", "bayes_risk", "fit", "bootstrap", "forward", "float16"],
)
def test_probabilities_read_as_logits_warn_at_the_callers_line(entry):
    probs, labels = _probs_and_labels()
    with pytest.warns(UserWarning, match="look like probabilities") as record:
        entry(probs, labels)
    ours = [w for w in record if "look like probabilities" in str(w.message)]
    assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]


def test_plots_warn_on_probabilities_read_as_logits():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from torchcal.plots import pyplot, reliability_diagram

    probs, labels = _probs_and_labels()
    with pytest.warns(UserWarning, match="look like probabilities"):
        figure, _ = reliability_diagram(probs, labels, n_bins=5)
    pyplot().close(figure)


def test_log_probabilities_and_declared_probabilities_do_not_warn():
    probs, labels = _probs_and_labels()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.cross_entropy(probs.log(), labels)
        check_probs(probs)
        check_probs(torch.softmax(torch.randn(1000, 100, dtype=torch.float32), dim=1).bfloat16())  # rows off by ~2e-3
        metric = metrics.CrossEntropy(num_classes=K, input="probs")
        metric.update(probs, labels)
        assert torch.isclose(metric.compute(), F.cross_entropy(probs.log(), labels).to(metric.compute().dtype))


@pytest.mark.parametrize("metric", [F.error_rate, F.balanced_error_rate, partial(F.bayes_risk, costs=F.zero_one_costs(K))])
def test_decision_metrics_validate_their_scores_once(metric):
    """error_rate validated the logits in error_rate_terms, bayes_risk_terms and bayes_decisions:
    three full sums, and the probabilities warning three times under "always"."""
    probs, labels = _probs_and_labels()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metric(probs, labels)
    assert len([w for w in caught if "look like probabilities" in str(w.message)]) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_probabilities_of_zero_are_floored_in_every_dtype(dtype):
    """A probability of 0 becomes log(1e-20) ~ -46 in every dtype but float16, where it stands
    for anything below 2^-25 and becomes log(2^-25) ~ -17.3 (probability_floor), with a zero
    gradient: in float16 the floor itself rounded to 0, so half-precision networks that return
    probabilities gave -inf (CalibratedModel on a .half() network, Lightning's 16-true: 'diverged network')."""
    from torchcal.heads import scores_from_outputs

    probs = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.25, 0.25]], dtype=dtype, requires_grad=True)
    scores = scores_from_outputs(probs, "probs")
    assert scores.dtype == torch.promote_types(dtype, torch.float32) and bool(scores.isfinite().all())  # (not rounded back)
    floor = 2.0**-25 if dtype == torch.float16 else 1e-20
    torch.testing.assert_close(scores[0, 1:].double(), torch.full((2,), np.log(floor), dtype=torch.float64), rtol=1e-7, atol=0)
    scores.sum().backward()
    assert probs.grad is not None and probs.grad[0, 1:].eq(0).all() and probs.grad.isfinite().all()
    calibrated = torchcal.TemperatureScaling().fit(torch.randn(200, 3), torch.randint(0, 3, (200,)))
    assert bool(calibrated(scores.detach().float()).isfinite().all())


def test_all_reduce_refuses_an_unknown_operation():
    from torchcal.distributed import all_reduce_

    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce_(torch.ones(1), None, "min")  # type: ignore[arg-type]


def test_messages_name_what_was_given():
    """expected_cost takes no scores: its length mismatch names the labels; a 0-d cost matrix is
    not '(K, M) = (0, M)'; a top-label ECE refuses an unknown reduction as the classwise one does."""
    with pytest.raises(ValueError, match="decisions has 20 entries but there are N = 19 labels"):
        F.expected_cost(torch.arange(20) % 3, torch.arange(19) % 3, F.zero_one_costs(3))
    with pytest.raises(ValueError, match=r"\(K, M\) = \(K, M\) .* got \(\)"):
        F.expected_cost(torch.arange(20) % 3, torch.arange(20) % 3, torch.tensor(1.0))
    for kind in ("top-label", "classwise"):
        with pytest.raises(ValueError, match="reduction must be one of"):
            F.expected_calibration_error(torch.randn(20, 3), torch.arange(20) % 3, kind=kind, reduction="foo")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("labels", "num_classes", "message"),
    [
        (torch.arange(10), 5, r"must lie in \[0, 5\)"),
        (torch.tensor([-1, 0]), 2, r"must lie in \[0, 2\)"),
        (torch.tensor([0.0, 1.0]), 2, "integer tensor"),
        (torch.zeros(2, 2, dtype=torch.long), 2, r"shape \(N,\)"),
        (torch.tensor([], dtype=torch.long), 3, "empty"),
        (torch.tensor([0, 1]), 0, "num_classes must be a positive integer"),
    ],
)
def test_class_frequencies_refuses_bad_labels(labels, num_classes, message):
    """It was a bare bincount: labels past K gave a longer vector, no labels NaN, and K = 0 passed."""
    with pytest.raises(ValueError, match=message):
        F.class_frequencies(labels, num_classes)


# --------------------------------------------------------------------------- arguments of helpers
P3 = [0.5, 0.25, 0.25]


def _binary_data():
    logits, labels = good_data()
    return logits[:, :2], (labels > 0).long()


BAD_ARGUMENTS = {
    "smoothed_priors(counts)": (lambda: torchcal.label_shift.smoothed_priors([1.0, 1.0, 1.0], 100), "priors must sum to one"),
    "smoothed_priors(negative)": (lambda: torchcal.label_shift.smoothed_priors([-0.2, 0.6, 0.6], 100), "priors must be finite and non-negative"),
    "smoothed_priors(nan)": (lambda: torchcal.label_shift.smoothed_priors(torch.tensor([np.nan, 0.5, 0.5]), 100), "priors must be finite"),
    "smoothed_priors(2-D)": (lambda: torchcal.label_shift.smoothed_priors([P3], 100), r"priors must have shape \(K,\)"),
    "smoothed_priors(num_samples=-5)": (lambda: torchcal.label_shift.smoothed_priors(P3, -5), "num_samples must be a finite number >= 0.*got -5"),
    "smoothed_priors(num_samples=inf)": (lambda: torchcal.label_shift.smoothed_priors(P3, float("inf")), "num_samples must be a finite number >= 0"),
    "detection_cost(cost_miss=nan)": (lambda: F.detection_cost(*_binary_data(), cost_miss=float("nan")), "must be finite and positive.*cost_miss = nan"),
    "min_detection_cost(cost_false_alarm=inf)": (
        lambda: F.min_detection_cost(*_binary_data(), cost_false_alarm=float("inf")), "must be finite and positive.*cost_false_alarm = inf"),
    "DetectionCost(cost_miss=nan)": (lambda: metrics.DetectionCost(cost_miss=float("nan")), "must be finite and positive"),
    "detection_cost_from_class_sums(cost_miss=-1)": (
        lambda: torchcal.functional.detection.detection_cost_from_class_sums(torch.tensor([1.0, 0.0]), torch.tensor([4.0, 2.0]), cost_miss=-1.0), "must be finite and positive"),
    "smooth_calibration_error(bandwidth=1e-9)": (
        lambda: F.smooth_calibration_error(*good_data(), bandwidth=1e-9), r"bandwidth must lie in \[1e-05, 1\], got 1e-09"),
    "smooth_calibration_error(grid_points=1e8)": (
        lambda: F.smooth_calibration_error(*good_data(), grid_points=10**8), "grid_points must be at most 1,000,001"),
    "SmoothCalibrationError(bandwidth=1e-9)": (lambda: metrics.SmoothCalibrationError(K, bandwidth=1e-9), r"bandwidth must lie in \[1e-05, 1\]"),
    "SmoothCalibrationError(grid_points=1e8)": (lambda: metrics.SmoothCalibrationError(K, grid_points=10**8), "grid_points must be at most"),
    "smooth_reliability_curve(mesh_points=1e8)": (lambda: F.smooth_reliability_curve(*good_data(), mesh_points=10**8), "mesh_points must be at most"),
    "smooth_reliability_curve(bandwidth=1e-9)": (lambda: F.smooth_reliability_curve(*good_data(), bandwidth=1e-9), "bandwidth must lie in"),
    "calibrate_output(kind='bogus')": (
        lambda: torchcal.heads.calibrate_output(_fitted_temperature(), good_data()[0], kind="bogus"), r"kind must be one of .*got 'bogus'"),
    "head_checkpoint(output='bogus')": (lambda: torchcal.heads.head_checkpoint(_fitted_temperature(), output="bogus"), "output must be one of"),
    "CrossEntropy(num_classes=None)": (lambda: metrics.CrossEntropy(num_classes=None), "CrossEntropy needs num_classes"),
    "zero_one_costs(2.0)": (lambda: F.zero_one_costs(2.0), "num_classes must be an integer >= 2, got 2.0"),
    "reliability_bins(class_index=1.0)": (
        lambda: F.reliability_bins(*good_data(), kind="class", class_index=1.0), r"needs an integer class_index in \[0, 3\), got 1.0"),
    "reliability_bins(top-label, class_index=7)": (
        lambda: F.reliability_bins(*good_data(), kind="top-label", class_index=7), 'class_index is used only with kind="class"'),
    "bootstrap(seed=1.5)": (lambda: F.bootstrap(F.cross_entropy, *good_data(), num_replicates=5, seed=1.5), "seed must be an integer, got 1.5"),
    "estimate_priors(max_iter=1.5)": (
        lambda: torchcal.label_shift.estimate_priors(good_data()[0], P3, max_iter=1.5), "max_iter must be an integer >= 1, got 1.5"),
    "class_priors(1)": (lambda: torchcal.data.class_priors(1), "num_classes must be an integer >= 2, got 1"),
    "gaussian_task(2.5)": (lambda: torchcal.data.gaussian_task(2.5), "num_classes must be an integer >= 2, got 2.5"),
    "log_posteriors(priors of K=2)": (lambda: torchcal.data.log_posteriors(torch.zeros(2, 3), [0.5, 0.5]), r"priors must have shape \(3,\)"),
    "class_priors(first=1.5)": (lambda: torchcal.data.class_priors(3, first=1.5), r"first must be a prior in \[0, 1\], got 1.5"),
    "mismatched_priors(last=-1)": (lambda: torchcal.data.mismatched_priors(3, last=-1), r"last must be a prior in \[0, 1\], got -1"),
    "log_posteriors(negative priors)": (
        lambda: torchcal.data.log_posteriors(torch.zeros(2, 3), torch.tensor([-0.5, 0.5, 1.0])), "priors must be finite and non-negative"),
    "gaussian_task(num_samples=-1)": (lambda: torchcal.data.gaussian_task(3, num_samples=-1), "num_samples must be an integer >= 1, got -1"),
    "binary_scores_to_logits(nan llr)": (
        lambda: torchcal.data.binary_scores_to_logits(torch.tensor([np.nan, 0.5]), kind="llr"), "LLRs must be finite; found 1 NaN"),
    "hosmer_lemeshow_test(n_groups=0)": (lambda: F.hosmer_lemeshow_test(*good_data(), n_groups=0), "^n_groups must be a positive integer, got 0"),
    "sweep_calibration_error(max_bins=0)": (lambda: F.sweep_calibration_error(*good_data(), max_bins=0), "^max_bins must be a positive integer, got 0"),
    "bayes_risk_sweep(log_odds 2-D)": (
        lambda: torchcal.plots.bayes_risk_sweep(*good_data(), log_odds=torch.zeros(2, 2)), r"log_odds must have shape \(T,\).*got \(2, 2\)"),
}


@pytest.mark.parametrize("call, pattern", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_of_helpers(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("option, pattern", [
    ({"input": "bogus"}, r"input must be one of \['auto', 'logits', 'probs', 'log_probs', 'llr'\].*got 'bogus'"),
    ({"input": "probabilities"}, "input must be one of"),
    ({"split": "train"}, "split must be 'test' or 'val', got 'train'"),
    ({"fallback": "bogus"}, r"fallback must be None or one of \['auto', 'logits'.*got 'bogus'"),  # (read as probabilities)
])
def test_load_scores_checks_its_options(tmp_path, option, pattern):
    probs = torch.softmax(good_data()[0], dim=1).numpy()
    np.save(tmp_path / "p.npy", probs)
    np.save(tmp_path / "y.npy", good_data()[1].numpy())
    with pytest.raises(ValueError, match=pattern):
        load_scores(tmp_path / "p.npy", labels_path=tmp_path / "y.npy", **option)


def test_head_checkpoint_of_an_unfitted_calibrator():
    with pytest.raises(RuntimeError, match="TemperatureScaling is not fitted"):
        torchcal.heads.head_checkpoint(torchcal.TemperatureScaling())


@pytest.mark.parametrize("labels_per_batch", [5, 2])
def test_collect_scores_refuses_outputs_and_labels_of_other_lengths(labels_per_batch):
    logits, labels = good_data()
    batches = [(logits[:6], labels[:labels_per_batch]), (logits[6:], labels[6:])]
    with pytest.raises(ValueError, match=f"batch 0: the model returned 6 rows of outputs but the batch has {labels_per_batch} labels"):
        torchcal.heads.collect_scores(torch.nn.Identity(), batches)


def test_calibration_loss_metric_refuses_what_is_no_calibrator():
    with pytest.raises(TypeError, match="calibrator must be a torchcal calibrator.*got str"):
        metrics.CalibrationLoss("temp", num_classes=K)


def test_smoothed_priors_of_a_list():
    assert torch.allclose(torchcal.label_shift.smoothed_priors(P3, 100), torchcal.label_shift.smoothed_priors(torch.tensor(P3), 100).double())


@pytest.mark.parametrize(
    "fit",
    [
        lambda x, y: torchcal.MatrixScaling(reg="odir", reg_lambda=1e-3).fit(x, y, max_iter=1),  # Newton-CG's cap
        lambda x, y: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3).fit(x, y, loss="brier", max_iter=2),  # L-BFGS's
        lambda x, y: torchcal.AffineCalibration().fit(x, y, max_iter=1),  # Newton's
        lambda x, y: torchcal.MatrixScaling().fit(x[:10], y[:10]),  # too few samples for its parameters
        # a class without samples, through torchcal's own cross-validation
        lambda x, y: torchcal.fit.cross_validate(torchcal.VectorScaling(), x[y != 2], y[y != 2], folds=2),
    ],
    ids=["newton-cg", "lbfgs", "newton", "matrix-few-samples", "cross-validate-missing-class"],
)
def test_solver_warnings_point_at_the_callers_line(fit):
    """The solvers' warnings are raised several calls deep (fit, the calibrator's _fit, the driver),
    at depths that differ by path: they name the user's line, not one inside torchcal."""
    logits, labels = good_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(3 * logits, labels)
    assert caught, "expected a warning"
    assert all(w.filename == __file__ for w in caught), [(w.filename, str(w.message)) for w in caught]


# ------------------------------------------------- review findings: arrays, priors, shapes, messages
def test_numpy_views_and_byte_orders_torch_cannot_wrap_are_read_as_their_values():
    """A reversed view (x[::-1], np.flip) and big-endian data raised torch's own errors."""
    gen = np.random.default_rng(0)
    logits, labels = gen.normal(size=(300, 4)), gen.integers(0, 4, 300)
    expected = F.cross_entropy(torch.from_numpy(logits[::-1].copy()), torch.from_numpy(labels[::-1].copy()))
    assert F.cross_entropy(logits[::-1], labels[::-1]) == expected
    assert F.cross_entropy(np.flip(logits, 0), np.flip(labels, 0)) == expected
    big_endian = F.cross_entropy(logits.astype(">f8"), labels.astype(">i8"))
    assert big_endian == F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels))


@pytest.mark.parametrize(("logits", "labels", "message"), [
    ([torch.randn(200, 4), torch.randn(100, 4)], torch.zeros(300, dtype=torch.long), r"list of 2 tensors.*torch.cat\(logits\)"),
    (torch.randn(4, 4), np.array(list("abcd")), "labels must hold numbers, got a NumPy array of dtype <U1"),
    ([[1.0, None, 0.0, 2.0]] * 4, torch.zeros(4, dtype=torch.long), r"logits must hold numbers.*None or mixed types"),
    ([[1.0, 2.0], [1.0]], torch.zeros(2, dtype=torch.long), "logits cannot be read as one array"),
])
def test_inputs_that_are_not_arrays_of_numbers_are_named(logits, labels, message):
    with pytest.raises((TypeError, ValueError), match=message):
        F.cross_entropy(logits, labels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_priors_are_checked_within_their_round_off(dtype):
    """Uniform priors in float16 sum to 0.99976 (bfloat16 1.002): refused, and their own division by
    their sum could not help."""
    logits, labels = good_data()
    k = logits.shape[1]
    expected = F.cross_entropy(logits, labels, priors=torch.full((k,), 1 / k, dtype=torch.float64))
    torch.testing.assert_close(F.cross_entropy(logits, labels, priors=torch.full((k,), 1 / k).to(dtype)), expected)
    with pytest.raises(ValueError, match="must sum to one"):
        check_priors(torch.tensor([0.5, 0.6]).to(dtype), 2)
    with pytest.raises(ValueError, match="must sum to one"):  # (a tolerance of K eps let 1.5 through at K = 100)
        check_priors(torch.full((100,), 0.015).to(dtype), 100)


@pytest.mark.parametrize("labels_shape", [(3, 1, 6, 7), (3, 5, 7), (3, 4, 6, 7)])
def test_segmentation_labels_of_the_wrong_shape_are_named(labels_shape):
    """The message blamed the (valid) scores: "logits must have shape (N, K), got (3, 4, 6, 7)"."""
    with pytest.raises(ValueError, match=r"need labels of shape \(N, d1, ...\) = \(3, 6, 7\).*got \(" + ", ".join(map(str, labels_shape))):
        metrics.CrossEntropy(num_classes=4).update(torch.randn(3, 4, 6, 7), torch.zeros(labels_shape, dtype=torch.long))


def test_one_hot_labels_of_two_class_segmentation_scores_are_refused():
    """(N, 2, H, W) scores with one-hot labels of their shape were read as a map of binary scores:
    N 2 H W "samples" of class-1 log-odds, the error rate exactly 0.5 (a review finding). A map of
    binary scores with a dimension of size 2 and its own 0/1 labels is still read as one."""
    gen = torch.Generator().manual_seed(0)
    scores, classes = torch.randn(3, 2, 6, 7, generator=gen), torch.randint(0, 2, (3, 6, 7), generator=gen)
    one_hot = torch.nn.functional.one_hot(classes, 2).movedim(-1, 1)
    for metric in (metrics.CrossEntropy(num_classes=2), metrics.ErrorRate(num_classes=2), metrics.CalibrationError(num_classes=2)):
        with pytest.raises(ValueError, match=r"need labels of shape \(N, d1, ...\) = \(3, 6, 7\) \(class indices, not one-hot\)"):
            metric.update(scores, one_hot)
    binary = metrics.CrossEntropy(num_classes=2)
    maps = torch.randint(0, 2, (3, 2, 6, 7), generator=gen)
    binary.update(scores, maps)
    expected = F.cross_entropy(torch.stack([torch.zeros(3 * 2 * 6 * 7), scores.reshape(-1)], dim=1), maps.reshape(-1))
    torch.testing.assert_close(binary.compute(), expected.to(binary.compute().dtype))


def test_one_binary_score_column_with_labels_of_another_shape_names_the_labels():
    """(N,) scores, the documented one-column form of K = 2, with (N, 1) labels: the message blamed
    the scores, "logits must have shape (N, K)" (a review finding)."""
    scores, labels = torch.randn(12), torch.arange(12) % 2
    for metric in (metrics.CrossEntropy(num_classes=2), metrics.Cllr(), metrics.CalibrationError(num_classes=2)):
        with pytest.raises(ValueError, match=r"labels must have shape \(N,\), got shape \(12, 1\); use labels.reshape\(-1\)"):
            metric.update(scores, labels[:, None])


def test_errors_in_a_validation_split_name_the_split(tmp_path):
    path = tmp_path / "scores.npz"
    labels = np.arange(50) % 3
    np.savez(path, logits=np.zeros((50, 3)), labels=labels, logits_val=np.zeros((50, 3)), labels_val=labels + 1)
    with pytest.raises(ValueError, match=r"\(val split: logits_val, labels_val\): labels must lie in \[0, 3\)"):
        load_scores(path, split="val")


def test_report_takes_one_method_name_and_refuses_one_class():
    from torchcal import report

    logits, labels = good_data()
    assert [result.method for result in report.evaluate((logits, labels), "temperature", bootstrap=0, folds=2).methods] == ["temperature"]
    with pytest.raises(ValueError, match="every label is class 0.*need two classes"):
        report.evaluate((logits, torch.zeros_like(labels)), bootstrap=0, folds=2)
    with pytest.raises(ValueError, match=r"'dirichlet-odir' \(DirichletCalibration\): unknown 'reg_lamda'; it takes reg, reg_lambda"):
        report.make_calibrator("dirichlet-odir", reg_lamda=0.01)


def test_a_method_whose_constructor_takes_any_keyword_gets_its_options(monkeypatch):
    from torchcal import report

    class Wrapped(torchcal.DirichletCalibration):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)

    monkeypatch.setitem(report.METHODS, "wrapped", Wrapped)
    assert report.make_calibrator("wrapped", reg="odir", reg_lambda=0.1).reg_lambda == 0.1


def test_fold_indices_refuses_scores_of_other_rows():
    """Scores for other rows than the labels' built the folds from uninitialised memory (fold sizes
    399,200 / 200 / ... at N = 400,000), or raised an IndexError (review finding)."""
    labels = torch.arange(50) % 3
    for scores in (torch.randn(20, 3), torch.randn(50)):
        with pytest.raises(ValueError, match=r"scores must have shape \(N, K\) with the labels' N = 50 rows"):
            torchcal.fit.fold_indices(labels, 5, scores=scores)
