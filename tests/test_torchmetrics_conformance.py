"""The metric classes as torchmetrics and Lightning users meet them: one tensor from ``compute()``,
collections and compute groups, the wrappers, ``plot``, input kinds, segmentation shapes,
``ignore_index``, empty batches, tensors that require grad, and ``torchcal.metrics`` after a plain
``import torchcal``. Every number is checked against the float64 functional forms."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings
from functools import partial
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.wrappers import BootStrapper, ClasswiseWrapper, MetricTracker, MultitaskWrapper

import torchcal
import torchcal.functional as F
from torchcal import metrics as M

K = 10


@pytest.fixture(scope="module")
def cifar():
    """The bundled CIFAR-10 ResNet-110 test logits (float32) and labels: 2,000 of them."""
    with np.load(str(files("torchcal.data") / "examples" / "cifar10_resnet110_kangsepp.npz")) as f:
        return torch.from_numpy(f["logits"][:2000]).float(), torch.from_numpy(f["labels"][:2000]).long()


COSTS = F.zero_one_costs(K, abstain=0.3)

# name -> (metric factory taking the common keyword arguments, float64 functional reference)
CASES = {
    "CrossEntropy": (lambda **kw: M.CrossEntropy(K, **kw), F.cross_entropy),
    "BrierScore(normalize)": (lambda **kw: M.BrierScore(K, normalize=True, **kw), partial(F.brier_score, normalize=True)),
    "BayesRisk": (lambda **kw: M.BayesRisk(COSTS, **kw), partial(F.bayes_risk, costs=COSTS)),
    "ErrorRate": (lambda **kw: M.ErrorRate(K, **kw), F.error_rate),
    "BalancedErrorRate": (lambda **kw: M.BalancedErrorRate(K, **kw), F.balanced_error_rate),
    "ExpectedCalibrationError": (lambda **kw: M.ExpectedCalibrationError(K, **kw), F.expected_calibration_error),
    "ExpectedCalibrationError(classwise, quantile)": (
        lambda **kw: M.ExpectedCalibrationError(K, 10, "quantile", "classwise", **kw),
        partial(F.expected_calibration_error, n_bins=10, strategy="quantile", kind="classwise"),
    ),
    "SignedCalibrationError": (lambda **kw: M.SignedCalibrationError(K, **kw), F.signed_calibration_error),
    "EntropicCalibrationDifference": (lambda **kw: M.EntropicCalibrationDifference(K, **kw), F.entropic_calibration_difference),
    "PosteriorStatistic(nce)": (lambda **kw: M.PosteriorStatistic("nce", K, **kw), partial(F.cross_entropy, normalize=True)),
    "SmoothCalibrationError": (lambda **kw: M.SmoothCalibrationError(K, **kw), partial(F.smooth_calibration_error, grid_points=1001)),
    "SmoothCalibrationError(classwise)": (
        lambda **kw: M.SmoothCalibrationError(K, kind="classwise", **kw),
        partial(F.smooth_calibration_error, kind="classwise", grid_points=1001),
    ),
    "DebiasedCalibrationError": (lambda **kw: M.DebiasedCalibrationError(K, **kw), F.debiased_calibration_error),
    "MurphyDecomposition": (lambda **kw: M.MurphyDecomposition(K, **kw), lambda x, y: torch.stack(list(F.murphy_decomposition(x, y)))),
    "SpiegelhalterTest": (lambda **kw: M.SpiegelhalterTest(K, **kw), lambda x, y: F.spiegelhalter_test(x, y).statistic),
    "RefinementLoss": (lambda **kw: M.RefinementLoss(K, **kw), F.refinement_loss),
}
# Streamed by interpolation over a temperature grid: within 4e-7 of the exact fit (its module docs).
RTOL = {"RefinementLoss": 1e-6}
PRIORS = torch.tensor([0.9, 0.1], dtype=torch.float64)  # the training priors of "cat or not" on CIFAR-10
# the same conventions for the K = 2 detection metrics, on the binary problem "cat or not" (``binary``)
BINARY_CASES = {
    "Cllr": (lambda **kw: M.Cllr(PRIORS, **kw), partial(F.cllr, priors=PRIORS)),
    "Cllr(data priors)": (lambda **kw: M.Cllr(**kw), F.cllr),
    "DetectionCost": (
        lambda **kw: M.DetectionCost(0.1, 5.0, priors=PRIORS, **kw),
        partial(F.detection_cost, target_prior=0.1, cost_miss=5.0, priors=PRIORS),
    ),
    "DetectionCost(data priors)": (lambda **kw: M.DetectionCost(0.1, 5.0, **kw), partial(F.detection_cost, target_prior=0.1, cost_miss=5.0)),
    "SpiegelhalterTest(binary)": (
        lambda **kw: M.SpiegelhalterTest(2, kind="binary", **kw), lambda x, y: F.spiegelhalter_test(x, y, kind="binary").statistic
    ),
}
ALL_CASES = {**CASES, **BINARY_CASES}


@pytest.fixture(scope="module")
def binary(cifar):
    """The binary problem "cat (class 3) or not" of the same logits: (N, 2) float32 and 0/1 labels."""
    logits, labels = cifar
    rest = torch.logsumexp(torch.cat([logits[:, :3], logits[:, 4:]], 1), 1)
    return torch.stack([rest, logits[:, 3]], 1), (labels == 3).long()


def _data(name, cifar, binary):
    return binary if name in BINARY_CASES else cifar


def _streamed(metric: Metric, scores: torch.Tensor, labels: torch.Tensor, batch: int = 700) -> torch.Tensor:
    for start in range(0, labels.shape[0], batch):
        metric.update(scores[start : start + batch], labels[start : start + batch])
    return metric.compute()


def _close(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-10) -> None:
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected.to(torch.float64), rtol=rtol, atol=1e-12)


# --------------------------------------------------------------------------- names and values
def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# The rule of issue 12, "a class for every functional and a functional for every class, named alike",
# with its exceptions written out, so that a new name must be placed in one of these lists.
NOT_METRICS = {  # functional helpers, curves and intervals: no single value to stream
    "bayes_decisions", "bootstrap", "class_frequencies", "consistency_bands", "det_curve",
    "reliability_bins", "reliability_intervals", "risk_coverage_curve", "smooth_reliability_curve", "zero_one_costs",
}
WHOLE_SAMPLE = {  # statistics that need every score at once, so no sum-reducible state: functional only
    "aurc": "the risk-coverage curve ranks every sample by confidence",
    "consistency_resampling_test": "redraws every sample's label from its posterior, L times",
    "corp_decomposition": "PAV (isotonic regression) over the whole sample",
    "cross_validated_calibration_loss": "refits the calibrator on folds of the whole sample",
    "equal_error_rate": "the ROC convex hull, from PAV over the whole sample",
    "hosmer_lemeshow_test": "equal-mass groups: quantiles of every score",
    "kolmogorov_smirnov_test": "the cumulative differences walk the samples in score order",
    "kuiper_test": "the cumulative differences walk the samples in score order",
    "min_cllr": "PAV over the whole sample",
    "min_detection_cost": "the minimum over every threshold: all scores sorted",
    "sweep_calibration_error": "equal-mass bins, and a sweep of their number over the sorted scores",
}
FUNCTIONAL_ALIASES = {"smooth_ece": "smooth_calibration_error"}
CLASS_ALIASES = {
    "BrierDecomposition": "MurphyDecomposition",
    "CalibrationError": "ExpectedCalibrationError",
    "ECD": "EntropicCalibrationDifference",
}
NOT_TWINS = {"PosteriorStatistic"}  # one member of PosteriorQuality, picked by name: no functional of its own


def test_every_class_has_a_functional_twin_and_back():
    functions = {name for name in F.__all__ if name[0].islower()}
    classes = set(M.__all__)
    listed = NOT_METRICS | set(WHOLE_SAMPLE) | set(FUNCTIONAL_ALIASES)
    assert listed <= functions and set(CLASS_ALIASES) | NOT_TWINS <= classes  # no stale exception
    for alias, name in FUNCTIONAL_ALIASES.items():
        assert getattr(F, alias) is getattr(F, name)
    for alias, name in CLASS_ALIASES.items():
        assert getattr(M, alias) is getattr(M, name)
    twins = {_snake(name) for name in classes - set(CLASS_ALIASES) - NOT_TWINS}
    assert twins <= functions, twins - functions  # every class has its functional, named alike
    assert not twins & set(WHOLE_SAMPLE), "a streaming class exists: remove it from WHOLE_SAMPLE"
    missing = functions - listed - twins
    assert not missing, f"functionals with no class: add one, or list them with the reason: {sorted(missing)}"


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_every_input_kind_gives_the_functional_value(cifar, binary, name):
    make, fn = ALL_CASES[name]
    logits, labels = _data(name, cifar, binary)
    expected = fn(logits.double(), labels)
    probs = logits.double().softmax(1)
    for kind, scores in (("logits", logits), ("log_probs", probs.log()), ("probs", probs)):
        _close(_streamed(make(input=kind), scores, labels), expected, RTOL.get(name, 1e-10))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_casting_the_module_keeps_the_float64_states(cifar, binary, dtype):
    """Lightning's ``precision="16-true"`` calls ``.to(dtype)`` on every submodule, metrics too:
    their float64 sums (and float64 buffers) must stay float64 (half-precision sums overflow)."""
    for name, (make, fn) in ALL_CASES.items():
        logits, labels = _data(name, cifar, binary)
        metric = make().to(dtype)
        assert all(getattr(metric, key).dtype == torch.float64 for key, v in metric._defaults.items() if torch.is_tensor(v) and v.is_floating_point())
        _close(_streamed(metric, logits, labels), fn(logits.double(), labels), RTOL.get(name, 1e-10))


def test_metrics_whose_updates_differ_never_share_a_compute_group(cifar):
    """A MetricCollection merges metrics whose states are equal after the first update. The most
    confident samples get the same decisions under two abstention costs, so after a first batch of
    them two BayesRisk states are equal by chance; they must not be merged (the 0.3 one read
    0.0614 instead of 0.0645 on CIFAR-10 ResNet-20)."""
    logits, labels = cifar
    order = torch.argsort(-logits.softmax(1).amax(1))
    logits, labels = logits[order], labels[order]
    costs = {"abstain05": F.zero_one_costs(K, abstain=0.05), "abstain30": F.zero_one_costs(K, abstain=0.3)}
    assert torch.equal(*(F.bayes_decisions(logits[:4], c) for c in costs.values()))
    collection = MetricCollection({name: M.BayesRisk(c) for name, c in costs.items()})
    collection.update(logits[:4], labels[:4])
    collection.update(logits[4:], labels[4:])
    assert len(collection.compute_groups) == 2
    result = collection.compute()
    for name, c in costs.items():
        _close(result[name], F.bayes_risk(logits.double(), labels, c))


def test_calibration_losses_of_different_calibrators_never_share_a_compute_group(cifar):
    """The calibrator, a submodule, is part of what the update depends on: two CalibrationLoss
    metrics of the error rate whose calibrators decide alike on the first batch had equal states
    after it, and the second then read the first's value."""
    logits, labels = cifar
    gen = torch.Generator().manual_seed(0)
    fit, test = torch.randperm(logits.shape[0], generator=gen).split(logits.shape[0] // 2)
    calibrators = {"ts": torchcal.TemperatureScaling(), "vs": torchcal.VectorScaling()}
    for calibrator in calibrators.values():
        calibrator.fit(logits[fit], labels[fit])
    with torch.no_grad():
        agree = calibrators["ts"](logits[test]).argmax(1) == calibrators["vs"](logits[test]).argmax(1)
    assert not agree.all()
    test = torch.cat([test[agree][:8], test[~agree], test[agree][8:]])  # a first batch decided alike
    collection = MetricCollection({name: M.CalibrationLoss(c, K, score=F.error_rate, relative=False) for name, c in calibrators.items()})
    collection.update(logits[test[:8]], labels[test[:8]])
    collection.update(logits[test[8:]], labels[test[8:]])
    assert len(collection.compute_groups) == 2
    result = collection.compute()
    for name, calibrator in calibrators.items():
        with torch.no_grad():
            expected = F.calibration_loss(logits[test], calibrator(logits[test]), labels[test], score=F.error_rate).absolute
        _close(result[name], expected)


def test_posterior_quality_and_its_functional(cifar):
    logits, labels = cifar
    expected = F.posterior_quality(logits.double(), labels)._asdict()
    got = _streamed(M.PosteriorQuality(K), logits, labels)
    assert got.keys() == expected.keys()
    for key in expected:
        _close(got[key], expected[key])
    prefixed = _streamed(M.PosteriorQuality(K, prefix="val_", input="probs"), logits.double().softmax(1), labels)
    _close(prefixed["val_ece"], expected["ece"])
    called = M.PosteriorQuality(K)  # forward: the batch values, and the members keep accumulating
    first = called(logits[:500], labels[:500])
    called.update(logits[500:1200], labels[500:1200])
    called(logits[1200:], labels[1200:])
    for key, value in F.posterior_quality(logits[:500].double(), labels[:500])._asdict().items():
        _close(first[key], value)
    for key, value in called.compute().items():
        _close(value, expected[key])


def test_calibration_loss_returns_one_tensor_and_the_result_on_request(cifar):
    logits, labels = cifar
    head = torchcal.TemperatureScaling().fit(logits[:1000], labels[:1000])
    with torch.no_grad():
        expected = F.calibration_loss(logits[1000:], head(logits[1000:]), labels[1000:])
    relative, absolute = M.CalibrationLoss(head, K), M.CalibrationLoss(head, K, relative=False)
    _close(_streamed(relative, logits[1000:], labels[1000:]), expected.relative)
    _close(_streamed(absolute, logits[1000:], labels[1000:]), expected.absolute)
    _close(relative.result().absolute, expected.absolute)


# --------------------------------------------------------------------------- mis-declared inputs
def test_probabilities_read_as_logits_warn_and_the_declared_kind_is_right(cifar, binary):
    logits, labels = cifar
    probs = logits.softmax(1)
    with pytest.warns(UserWarning, match="look like probabilities.*input='probs'"):
        wrong = M.CrossEntropy(K)(probs, labels)
    assert abs(float(wrong) - float(F.cross_entropy(logits, labels))) > 1  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _close(M.CrossEntropy(K, input="probs")(probs, labels), F.cross_entropy(logits.double(), labels), rtol=1e-6)
        M.CrossEntropy(K)(logits, labels)  # real logits: no warning
    for name, (make, _) in ALL_CASES.items():
        scores, targets = _data(name, (probs, labels), (binary[0].softmax(1), binary[1]))
        with pytest.warns(UserWarning, match="look like probabilities"):
            make().update(scores, targets)
    # half precision: a bfloat16 sum of 1,500 such rows came to 1,496, past the pre-test's tolerance
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        half = torch.randn(1500, K, generator=gen).softmax(1).to(dtype)
        with pytest.warns(UserWarning, match="look like probabilities"):
            M.CrossEntropy(K).update(half, labels[:1500])
    with pytest.raises(ValueError, match="sum to one"):
        M.CrossEntropy(K, input="probs").update(probs * 0.9, labels)
    # one column of probabilities of class 1 (torchmetrics' binary convention), at the user's line
    column, targets = binary[0].softmax(1)[:, 1], binary[1]
    with pytest.warns(UserWarning, match="one column .* all in \\[0, 1\\]") as record:
        M.CrossEntropy(2)(column, targets)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        M.CrossEntropy(2)(binary[0][:, 1] - binary[0][:, 0], targets)  # log-odds
        M.CrossEntropy(2, input="probs")(column, targets)
        M.CrossEntropy(2)(column[:19], targets[:19])  # too few rows to tell
    with pytest.raises(ValueError, match="input must be one of"):
        M.CrossEntropy(K, input="softmax")


def test_no_requires_grad_warning_from_metrics_or_heads(cifar, binary):
    logits, labels = cifar
    z = logits[:300].clone().requires_grad_()
    head = torchcal.TemperatureScaling().fit(logits[:300], labels[:300])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for make, _ in CASES.values():
            make()(z, labels[:300])
        for make, _ in BINARY_CASES.values():
            make()(binary[0][:300].clone().requires_grad_(), binary[1][:300])
        M.CrossEntropy(K, input="probs")(z.softmax(1), labels[:300])
        M.PosteriorQuality(K).update(z, labels[:300])
        head(z)
        torchcal.attach(torch.nn.Identity(), head, output="probs")(z.softmax(1))
        torchcal.heads.scores_from_outputs(z.softmax(1), "probs")
        torchcal.heads.scores_from_outputs(z, "logits")
        torchcal.functional.cross_entropy(z, labels[:300], priors=torch.full((K,), 0.1, requires_grad=True))


# --------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_segmentation_shapes_ignore_index_and_empty_batches(cifar, binary, name):
    """(N, K, H, W) scores with (N, H, W) labels equal the flattened pixels; ignore_index drops
    pixels; an empty batch, or one whose labels are all ignored, changes nothing."""
    make, fn = ALL_CASES[name]
    logits, labels = _data(name, cifar, binary)
    images, pixel_labels = logits[:1800].reshape(50, 6, 6, -1).permute(0, 3, 1, 2), labels[:1800].reshape(50, 6, 6)
    ignored = pixel_labels.clone()
    ignored[:, 0, :] = 255  # a border of unlabelled pixels
    kept = (ignored != 255).reshape(-1)
    metric = make(ignore_index=255)
    for start in range(0, 50, 20):
        metric.update(images[start : start + 20], ignored[start : start + 20])
    metric.update(images[:0], ignored[:0])
    metric.update(images[:3], torch.full_like(ignored[:3], 255))
    _close(metric.compute(), fn(logits[:1800][kept].double(), labels[:1800][kept]), RTOL.get(name, 1e-10))


@pytest.mark.parametrize("kind", ["logits", "probs", "log_probs"])
def test_binary_scores_of_one_column(kind):
    gen = torch.Generator().manual_seed(3)
    log_odds = 3 * torch.randn(400, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(torch.sigmoid(log_odds / 3), generator=gen).long()
    two_columns = torch.stack([torch.zeros_like(log_odds), log_odds], 1)
    one_column = {"logits": log_odds, "probs": torch.sigmoid(log_odds), "log_probs": torch.nn.functional.logsigmoid(log_odds)}[kind]
    for metric, fn in ((M.CrossEntropy(2, input=kind), F.cross_entropy),
                       (M.ExpectedCalibrationError(2, kind="binary", input=kind), partial(F.expected_calibration_error, kind="binary")),
                       (M.Cllr(PRIORS, input=kind), partial(F.cllr, priors=PRIORS)),
                       (M.SpiegelhalterTest(2, kind="binary", input=kind), lambda x, y: F.spiegelhalter_test(x, y, kind="binary").statistic)):
        _close(_streamed(metric, one_column.reshape(4, 10, 10), labels.reshape(4, 10, 10), batch=2), fn(two_columns, labels))
        metric.reset()  # a 2-D map of binary scores, (N, d1), is not (N, K) class scores
        _close(_streamed(metric, one_column.reshape(40, 10), labels.reshape(40, 10), batch=7), fn(two_columns, labels))


EMPTY_CASES = {  # options whose empty state read 0 (an empty maximum, zeroed bins), besides ALL_CASES
    "ECE(max)": lambda **kw: M.ExpectedCalibrationError(K, norm="max", **kw),
    "ECE(classwise, max, max)": lambda **kw: M.ExpectedCalibrationError(K, kind="classwise", norm="max", reduction="max", **kw),
    "DebiasedECE(uniform)": lambda **kw: M.DebiasedCalibrationError(K, strategy="uniform", **kw),
    "ECD(5 bins)": lambda **kw: M.EntropicCalibrationDifference(K, n_bins=5, **kw),
}


@pytest.mark.parametrize("name", list(ALL_CASES) + list(EMPTY_CASES))
def test_compute_without_samples_is_nan(name):
    """No samples (no update, or every label ignored): NaN, as for an empty sum, not an error
    about the data or a value that reads as a result (a smooth ECE of 0, "perfectly calibrated")."""
    make = EMPTY_CASES[name] if name in EMPTY_CASES else ALL_CASES[name][0]
    k = 2 if name in BINARY_CASES else K
    for metric in (make(), make(ignore_index=255)):
        if metric.ignore_index is not None:
            metric.update(torch.randn(4, k), torch.full((4,), 255))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchmetrics: compute before update
            assert bool(metric.compute().isnan().all()), name


def _fitted_temperature() -> torchcal.TemperatureScaling:
    return torchcal.TemperatureScaling().fit(torch.randn(100, K), torch.arange(100) % K)


# The README's names of the metrics that keep every sample -> (a configuration that does, one that keeps sums)
KEEPS_EVERY_SAMPLE = {
    "ExpectedCalibrationError": (lambda: M.ExpectedCalibrationError(K, strategy="quantile"), lambda: M.ExpectedCalibrationError(K)),
    "MurphyDecomposition": (lambda: M.MurphyDecomposition(K, strategy="quantile"), lambda: M.MurphyDecomposition(K)),
    "ECD": (lambda: M.ECD(K, n_bins=10, strategy="quantile"), lambda: M.ECD(K, strategy="quantile")),
    "DebiasedCalibrationError": (lambda: M.DebiasedCalibrationError(K), lambda: M.DebiasedCalibrationError(K, strategy="uniform")),
    "Cllr": (lambda: M.Cllr(), lambda: M.Cllr(PRIORS)),
    "DetectionCost": (lambda: M.DetectionCost(0.1, 5.0), lambda: M.DetectionCost(0.1, 5.0, priors=PRIORS)),
    "CalibrationLoss": (lambda: M.CalibrationLoss(torchcal.TemperatureScaling(), K), lambda: M.CalibrationLoss(_fitted_temperature(), K)),
}


def test_the_readme_names_the_metrics_that_keep_every_sample():
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    sentence = readme[readme.index("keep every sample") : readme.index("synchronises them")]
    for name, (every_sample, sums) in KEEPS_EVERY_SAMPLE.items():
        assert re.search(f"`{name}[`(]", sentence), name
        assert any(isinstance(d, list) for d in every_sample()._defaults.values()), name
        assert not any(isinstance(d, list) for d in sums()._defaults.values()), name
    for name, (make, _) in ALL_CASES.items():  # the cases' options: lists only in the metrics named
        metric = make()
        if any(isinstance(d, list) for d in metric._defaults.values()):
            assert re.search(f"`{type(metric).__name__}[`(]", sentence), name


VECTOR_CASES = {  # vector-valued metric -> the shape of its value
    "MurphyDecomposition": (lambda strategy: M.MurphyDecomposition(K, strategy=strategy), (3,)),
    "ECD(10 bins)": (lambda strategy: M.EntropicCalibrationDifference(K, n_bins=10, strategy=strategy), (10,)),
    "ECE(classwise, none)": (lambda strategy: M.ExpectedCalibrationError(K, strategy=strategy, kind="classwise", reduction="none"), (K,)),
}


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
@pytest.mark.parametrize("name", list(VECTOR_CASES))
def test_vector_values_without_samples_are_nan_of_their_shape(cifar, name, strategy):
    """Equal-mass bins keep every sample (list states): before any, NaN of the usual shape too,
    which ClasswiseWrapper and MetricTracker (an epoch without samples) need."""
    make, shape = VECTOR_CASES[name]
    logits, labels = cifar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics: compute before update
        empty = make(strategy).compute()
        assert empty.shape == shape and bool(empty.isnan().all()), name
        if name.startswith("ECE"):
            per_class = ClasswiseWrapper(make(strategy)).compute()
            assert len(per_class) == K and all(bool(v.isnan()) for v in per_class.values())
        tracker = MetricTracker(make(strategy), maximize=False)
        tracker.increment()
        tracker.update(logits, labels)
        tracker.increment()  # an epoch without samples
        history = tracker.compute_all()
    assert history.shape == (2, *shape) and not bool(history[0].isnan().any()) and bool(history[1].isnan().all())


UNDEFINED_ON_A_BATCH = {  # metric, the batch its value is undefined on
    "BalancedErrorRate": (lambda: M.BalancedErrorRate(K), "cifar"),
    "CrossEntropy(priors)": (lambda: M.CrossEntropy(K, priors=torch.full((K,), 1 / K)), "cifar"),
    "BayesRisk(priors)": (lambda: M.BayesRisk(COSTS, priors=torch.full((K,), 1 / K)), "cifar"),
    "CrossEntropy(normalize)": (lambda: M.CrossEntropy(K, normalize=True), "one class"),
    "Cllr(data priors)": (lambda: M.Cllr(), "one class"),
    "PosteriorStatistic(nce)": (lambda: M.PosteriorStatistic("nce", K, priors=torch.full((K,), 1 / K)), "cifar"),
}


@pytest.mark.parametrize("name", list(UNDEFINED_ON_A_BATCH))
def test_forward_on_a_batch_that_leaves_the_metric_undefined(cifar, binary, name):
    """``metric(scores, labels)`` (what ``self.log(name, metric(...))`` runs) on a batch missing a
    class with a positive prior, or of one class where the score is normalised by the prior's:
    NaN for the batch, which is still accumulated; the other batches' values and the total are the
    functional's."""
    make, undefined = UNDEFINED_ON_A_BATCH[name]
    logits, labels = binary if name.startswith("Cllr") else cifar
    reference = make()
    metric = make()
    first = metric(logits[:1000], labels[:1000])  # every class present
    reference.update(logits[:1000], labels[:1000])
    _close(first, reference.compute())
    odd = torch.arange(1000, 1008) if undefined == "cifar" else torch.nonzero(labels[1000:] == 1).flatten()[:4] + 1000
    assert undefined == "one class" or labels[odd].unique().numel() < K  # 8 samples: some class is missing
    assert torch.isnan(metric(logits[odd], labels[odd]))
    metric.update(logits[1500:], labels[1500:])
    rows = torch.cat([torch.arange(1000), odd, torch.arange(1500, labels.shape[0])])
    reference.reset()
    reference.update(logits[rows], labels[rows])
    _close(metric.compute(), reference.compute())


def test_ecd_takes_the_options_of_its_functional(cifar):
    logits, labels = cifar
    for strategy in ("uniform", "quantile"):
        metric = M.EntropicCalibrationDifference(K, n_bins=8, strategy=strategy)
        expected = F.entropic_calibration_difference(logits, labels, n_bins=8, strategy=strategy)
        _close(_streamed(metric, logits, labels), expected)


# --------------------------------------------------------------------------- collections and wrappers
def test_posterior_quality_runs_one_pass_per_update(cifar, monkeypatch):
    import torchcal.metrics.fused as fused

    calls = []
    original = fused.softmax_rows
    monkeypatch.setattr(fused, "softmax_rows", lambda *a: calls.append(1) or original(*a))
    logits, labels = cifar
    metric = M.PosteriorQuality(K)
    for start in range(0, 2000, 500):
        metric.update(logits[start : start + 500], labels[start : start + 500])
    assert len(calls) == 4 and len(metric.compute_groups) == 1
    collection = MetricCollection({"nll": M.CrossEntropy(K), "nce": M.CrossEntropy(K, normalize=True), "ece": M.ExpectedCalibrationError(K)})
    _streamed(collection, logits, labels)
    assert sorted(map(sorted, collection.compute_groups.values())) == [["ece"], ["nce", "nll"]]
    _close(collection.compute()["nce"], F.cross_entropy(logits, labels, normalize=True))


def test_wrappers(cifar):
    logits, labels = cifar
    torch.manual_seed(0)
    boot = BootStrapper(M.CrossEntropy(K), num_bootstraps=30)
    boot.update(logits, labels)
    spread = boot.compute()
    value = float(F.cross_entropy(logits, labels))
    assert 0 < float(spread["std"]) < 0.5 * value and abs(float(spread["mean"]) - value) < 4 * float(spread["std"])
    boot = BootStrapper(M.CrossEntropy(K), num_bootstraps=30, quantile=torch.tensor([0.025, 0.975], dtype=torch.float64))
    boot.update(logits, labels)
    lower, upper = boot.compute()["quantile"].tolist()
    assert lower < value < upper
    boot = BootStrapper(M.RefinementLoss(K), num_bootstraps=10)
    boot.update(logits, labels)
    spread, value = boot.compute(), float(F.refinement_loss(logits, labels))
    assert 0 < float(spread["std"]) < 0.5 * value and abs(float(spread["mean"]) - value) < 4 * float(spread["std"])
    collection = MetricCollection({"nll": M.CrossEntropy(K), "refinement": M.RefinementLoss(K)})
    result = _streamed(collection, logits, labels)
    _close(result["refinement"], F.refinement_loss(logits, labels), rtol=1e-6)
    assert float(result["refinement"]) < float(result["nll"])

    tracker = MetricTracker(MetricCollection({"nll": M.CrossEntropy(K), "ece": M.ExpectedCalibrationError(K)}), maximize=False)
    for epoch in range(2):
        tracker.increment()
        tracker.update(logits[epoch * 1000 : (epoch + 1) * 1000], labels[epoch * 1000 : (epoch + 1) * 1000])
    history = tracker.compute_all()
    for epoch in range(2):
        part = slice(epoch * 1000, (epoch + 1) * 1000)
        _close(history["nll"][epoch], F.cross_entropy(logits[part], labels[part]))
        _close(history["ece"][epoch], F.expected_calibration_error(logits[part], labels[part]))

    classwise = ClasswiseWrapper(M.ExpectedCalibrationError(K, kind="classwise", reduction="none"), prefix="ece_")
    per_class = _streamed(classwise, logits, labels)
    expected = F.expected_calibration_error(logits, labels, kind="classwise", reduction="none")
    assert len(per_class) == K
    for k in range(K):
        _close(per_class[f"ece_{k}"], expected[k])

    tasks = MultitaskWrapper({"a": M.CrossEntropy(K), "b": M.BrierScore(K, input="probs")})
    tasks.update({"a": logits, "b": logits.double().softmax(1)}, {"a": labels, "b": labels})
    result = tasks.compute()
    _close(result["a"], F.cross_entropy(logits, labels))
    _close(result["b"], F.brier_score(logits.double(), labels))


@pytest.mark.parametrize("make, functional", [
    (lambda: M.DebiasedCalibrationError(K), F.debiased_calibration_error),
    (lambda: M.ExpectedCalibrationError(K, strategy="quantile"), partial(F.expected_calibration_error, strategy="quantile")),
    (lambda: M.CrossEntropy(K), F.cross_entropy),
], ids=["debiased", "ece-quantile", "cross-entropy"])
def test_running_window_of_metrics_that_keep_every_sample(cifar, make, functional):
    """``Running`` holds the list states of its window's batches, which torchmetrics' ``reset``
    emptied in place: the window read 0 or NaN (review finding: 0.000 against 0.084)."""
    from torchmetrics.wrappers import Running

    logits, labels = cifar
    running = Running(make(), window=2)
    for start in range(0, 2000, 400):
        running.update(logits[start : start + 400], labels[start : start + 400])
    _close(running.compute(), functional(logits[1200:], labels[1200:]))


def test_compute_after_merge_or_load_is_not_the_cached_value(cifar):
    """torchmetrics keeps the value computed before a ``merge_state`` or a state load: compute()
    returned the first half's cross-entropy after merging the second (review finding). A state
    accumulated under other update options is refused on loading, as on merging."""
    logits, labels = cifar
    first, second = M.CrossEntropy(K), M.CrossEntropy(K)
    first.update(logits[:1000], labels[:1000])
    second.update(logits[1000:], labels[1000:])
    first.compute()
    first.merge_state(second)
    _close(first.compute(), F.cross_entropy(logits, labels))
    whole, loaded = M.CrossEntropy(K), M.CrossEntropy(K)
    other, refusing = M.BayesRisk(F.zero_one_costs(K)), M.BayesRisk(COSTS)
    for metric in (whole, loaded, other, refusing):
        metric.persistent(True)
    whole.update(logits, labels)
    loaded.update(logits[:1000], labels[:1000])
    loaded.compute()
    loaded.load_state_dict(whole.state_dict())
    _close(loaded.compute(), F.cross_entropy(logits, labels))
    other.update(logits, labels)
    with pytest.raises(ValueError, match="cannot load the state of a BayesRisk accumulated under other options"):
        refusing.load_state_dict(other.state_dict())


def test_a_refused_batch_is_not_counted(cifar):
    """An update that raises (a NaN score) still counted its samples: smooth ECE of no sample then
    read 0, "perfectly calibrated", instead of NaN (review finding)."""
    logits, labels = cifar
    bad = logits[:100].clone()
    bad[0, 0] = math.nan
    for metric in (M.SmoothCalibrationError(K), M.CrossEntropy(K)):
        with pytest.raises(ValueError):
            metric.update(bad, labels[:100])
        assert int(metric.sample_count) == 0 and math.isnan(float(metric.compute()))


def test_a_batch_refused_inside_forward_keeps_the_state_accumulated_so_far(cifar):
    """forward: torchmetrics resets the state to the batch's before the update's checks run, so a
    refused batch (a NaN score) after 2,000 good samples left none: compute() NaN, sample_count 0
    (a review; update() refusing the same batch kept them). Every kind of state: sums, a
    per-sample (cat) state, a Bayes risk's counts."""
    logits, labels = cifar
    bad = logits[:100].clone()
    bad[5, 3] = math.nan
    for make, value in [(lambda: M.CrossEntropy(K), lambda x, y: F.cross_entropy(x, y)),
                        (lambda: M.ExpectedCalibrationError(K, strategy="quantile"),
                         lambda x, y: F.expected_calibration_error(x, y, strategy="quantile")),
                        (lambda: M.BayesRisk(F.zero_one_costs(K)), lambda x, y: F.bayes_risk(x, y, F.zero_one_costs(K)))]:
        metric = make()
        for part in torch.arange(600).split(200):
            metric(logits[part], labels[part])
        with pytest.raises(ValueError, match="NaN"):
            metric(bad, labels[:100])
        assert int(metric.sample_count) == 600
        _close(metric.compute(), value(logits[:600], labels[:600]))
        metric(logits[600:800], labels[600:800])  # and it goes on accumulating
        _close(metric.compute(), value(logits[:800], labels[:800]))


def test_options_that_the_metrics_cannot_honour_are_refused_when_built():
    """A review: BayesRisk of a one-row cost matrix was a K = 1 metric that read 0;
    SpiegelhalterTest(4, kind="binary") failed only at its first update; MurphyDecomposition
    ignored norm= and named another class's __init__ for reduction=."""
    with pytest.raises(ValueError, match=r"costs must have one row per class, K >= 2 rows; got shape \(1, 2\)"):
        M.BayesRisk(torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match='kind="binary" needs K = 2 classes, got K = 4'):
        M.SpiegelhalterTest(4, kind="binary")
    for option in ({"norm": "max"}, {"reduction": "none"}):
        with pytest.raises(TypeError, match=f"MurphyDecomposition takes no {next(iter(option))}"):
            M.MurphyDecomposition(K, **option)


def test_classwise_equal_mass_metrics_need_num_classes():
    """Accepted with num_classes=None, they raised a TypeError from an empty state's shape at
    compute(), forward on an empty batch or a sync (review finding); now refused when built, as
    their equal-width forms were."""
    for make in (lambda: M.ExpectedCalibrationError(None, strategy="quantile", kind="classwise"),
                 lambda: M.DebiasedCalibrationError(None, kind="classwise")):
        with pytest.raises(ValueError, match="needs num_classes"):
            make()


def test_plots_show_values_above_one(cifar):
    """A normalised Brier score (2.94 on real LLRs) and a classwise ECE summed over the classes were
    cut off by their plots' upper bounds, 2 and 1 (review finding); torchmetrics keeps the bounds
    as class constants, so these classes have none."""
    pytest.importorskip("matplotlib")
    logits, labels = cifar
    wrong = -4 * logits[:200]  # confidently wrong
    for metric in (M.BrierScore(K, normalize=True), M.ExpectedCalibrationError(K, kind="classwise", reduction="sum")):
        metric.update(wrong, labels[:200])
        value = float(metric.compute())
        assert value > 1.0
        _, ax = metric.plot()
        assert ax.get_ylim()[1] >= value


def test_refinement_warning_points_at_the_caller(cifar):
    """The "best temperature lies beyond" warning named torchcal's own file (review finding)."""
    logits, labels = cifar
    metric = M.RefinementLoss(K, temperature_range=(0.05, 0.1))
    metric.update(logits, labels)
    with pytest.warns(UserWarning, match="the best temperature lies beyond") as caught:
        metric.compute()
    assert caught[0].filename == __file__


def test_plot_of_every_class_and_of_collections(cifar, binary):
    pytest.importorskip("matplotlib")
    from torchcal.plots import pyplot

    logits, labels = cifar
    head = torchcal.TemperatureScaling().fit(logits[:500], labels[:500])
    every = [make() for make, _ in ALL_CASES.values()] + [M.CalibrationLoss(head, K), M.ExpectedCost(COSTS)]
    for metric in every:
        values = []
        for start in range(500, 2000, 500):
            inputs, targets = binary if metric.num_classes == 2 else (logits, labels)
            if isinstance(metric, M.ExpectedCost):
                inputs = F.bayes_decisions(logits, COSTS)
            metric.update(inputs[start : start + 500], targets[start : start + 500])
            values.append(metric.compute())
        for fig, ax in (metric.plot(), metric.plot(metric.compute()), metric.plot(values)):
            assert ax.get_lines() or ax.collections or ax.patches, type(metric).__name__
            pyplot().close(fig)
    quality = M.PosteriorQuality(K)
    quality.update(logits, labels)
    figures = quality.plot()
    assert len(figures) == 6
    for fig, _ in figures:
        pyplot().close(fig)
    ece = M.ExpectedCalibrationError(K)
    ece.update(logits, labels)
    fig, ax = ece.plot_reliability()
    assert "onfidence" in ax.get_xlabel()
    pyplot().close(fig)


# --------------------------------------------------------------------------- Lightning
def test_self_log_and_log_dict_in_a_lightning_run(cifar):
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    logits, labels = cifar

    class Replay(LightningModule):
        """Validation returns the stored logits: the logged values must be the functional ones."""

        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(K))
            self.nll = M.CrossEntropy(K)
            self.ece = M.ExpectedCalibrationError(K, norm="max", ignore_index=-1)
            self.quality = M.PosteriorQuality(K, prefix="val_")
            self.collection = MetricCollection({"brier": M.BrierScore(K), "ecd": M.EntropicCalibrationDifference(K)}, prefix="col_")

        def validation_step(self, batch, batch_idx):
            z, y = batch
            z = z + self.bias
            self.nll.update(z, y)
            self.ece.update(z, y)
            self.quality.update(z, y)
            self.collection.update(z, y)
            self.log("val_nll", self.nll)
            self.log("val_mce", self.ece)
            self.log_dict(self.quality)
            self.log_dict(self.collection)

    trainer = Trainer(fast_dev_run=3, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.validate(Replay(), DataLoader(TensorDataset(logits, labels), batch_size=400))
    seen = slice(0, 1200)  # fast_dev_run=3: three batches
    z, y = logits[seen], labels[seen]
    logged = trainer.callback_metrics
    expected = {
        "val_nll": F.cross_entropy(z, y), "val_mce": F.expected_calibration_error(z, y, norm="max"),
        "col_brier": F.brier_score(z, y), "col_ecd": F.entropic_calibration_difference(z, y),
        **{f"val_{k}": v for k, v in F.posterior_quality(z, y)._asdict().items()},
    }
    assert set(expected) <= set(logged)
    for key, value in expected.items():  # Lightning logs float32
        assert float(logged[key]) == pytest.approx(float(value), rel=1e-6), key


def test_forward_and_self_log_on_batches_missing_classes_in_a_lightning_run(cifar):
    """The pattern of Lightning's docs, ``self.metric(preds, target); self.log(name, self.metric)``,
    with batches of 8 that always miss some of the 10 classes: the per-batch value is NaN where the
    batch leaves the metric undefined, and the epoch's value is the metric of every sample."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    logits, labels = cifar

    class Replay(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(K))
            self.balanced = M.BalancedErrorRate(K)

        def validation_step(self, batch, batch_idx):
            z, y = batch
            self.balanced(z + self.bias, y)
            self.log("val_balanced", self.balanced, on_step=True, on_epoch=True)

    trainer = Trainer(limit_val_batches=50, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.validate(Replay(), DataLoader(TensorDataset(logits, labels), batch_size=8))
    seen = slice(0, 400)
    assert float(trainer.callback_metrics["val_balanced_epoch"]) == pytest.approx(float(F.balanced_error_rate(logits[seen], labels[seen])), rel=1e-6)


# --------------------------------------------------------------------------- the package attributes
def test_lazy_submodules_after_a_plain_import():
    code = (
        "import sys, torchcal\n"
        "assert not {'torchmetrics', 'lightning', 'matplotlib', 'torchcal.metrics'} & set(sys.modules), sorted(sys.modules)\n"
        "assert torchcal.metrics.CrossEntropy(3).num_classes == 3\n"
        "print(torchcal.report.__name__, torchcal.plots.__name__, torchcal.lightning.__name__, torchcal.data.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torchcal.report", "torchcal.plots", "torchcal.lightning", "torchcal.data"]
    with pytest.raises(AttributeError, match="no attribute 'metric'"):
        torchcal.metric  # noqa: B018


def test_calibration_loss_state_saved_in_another_process_loads_and_merges(tmp_path):
    """The options digest hashed ``repr`` of the score function and its reduction, which hold
    memory addresses: a ``CalibrationLoss`` state saved by one process was refused ("accumulated
    under other options") by an identically built metric in another (review finding)."""
    code = (
        "import torch, torchcal\n"
        "from torchcal import metrics as M\n"
        "g = torch.Generator().manual_seed(0)\n"
        "logits = 3 * torch.randn(2000, 4, generator=g, dtype=torch.float64)\n"
        "labels = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=g).squeeze(1)\n"
        "calibrator = torchcal.TemperatureScaling().fit(logits[:1000], labels[:1000])\n"
        "metric = M.CalibrationLoss(calibrator, num_classes=4)\n"
        "metric.persistent(True)\n"
        "metric.update(logits[1000:1500], labels[1000:1500])\n"
        f"torch.save({{'calibrator': calibrator.state_dict(), 'metric': metric.state_dict(), 'data': (logits, labels)}}, {str(tmp_path / 'saved.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    saved = torch.load(tmp_path / "saved.pt")
    logits, labels = saved["data"]
    calibrator = torchcal.TemperatureScaling()
    calibrator.load_state_dict(saved["calibrator"])
    loaded, rest, whole = (M.CalibrationLoss(calibrator, num_classes=4) for _ in range(3))
    loaded.persistent(True)
    loaded.load_state_dict(saved["metric"])
    rest.update(logits[1500:], labels[1500:])
    loaded.merge_state(rest)
    whole.update(logits[1000:], labels[1000:])
    raw = logits[1000:]
    expected = F.calibration_loss(raw, calibrator(raw).detach(), labels[1000:]).relative
    _close(loaded.compute(), expected)
    _close(whole.compute(), expected)
