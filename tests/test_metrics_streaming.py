"""Metric classes: any batching equals the functional value; clone, pickle, state_dict, reset."""

from __future__ import annotations

import ast
import io
import math
import pickle
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcal
from torchcal.functional import (
    bayes_decisions,
    bayes_risk,
    brier_score,
    calibration_loss,
    cross_entropy,
    cross_validated_calibration_loss,
    entropic_calibration_difference,
    expected_calibration_error,
    expected_cost,
    zero_one_costs,
)
from torchcal.metrics import (
    ECD,
    BayesRisk,
    BrierScore,
    CalibrationError,
    CalibrationLoss,
    CrossEntropy,
    ExpectedCost,
)


def make_data(n: int, k: int, scale: float, seed: int):
    """Logits ``scale * N(0, 1)`` (float32 unless |z| is huge) and labels drawn from
    ``softmax(logits / scale)``, so the logits are over-confident by the factor ``scale``."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, k, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=g).squeeze(1)
    labels[:k] = torch.arange(k)
    logits = scale * latent
    return logits.float() if scale < 100 else logits, labels


def priors_for(k: int) -> torch.Tensor:
    p = torch.arange(1, k + 1, dtype=torch.float64)
    return p / p.sum()


def costs_for(k: int) -> torch.Tensor:
    costs = zero_one_costs(k, abstain=0.2)
    costs[0, 1:k] = 3.0  # asymmetric
    return costs


def case_list(k: int):
    """(name, metric factory taking torchmetrics keyword arguments, functional reference)."""
    p, c = priors_for(k), costs_for(k)
    cases = [
        ("xe", lambda **kw: CrossEntropy(k, **kw), cross_entropy),
        ("nxe-priors", lambda **kw: CrossEntropy(k, priors=p, normalize=True, **kw), partial(cross_entropy, priors=p, normalize=True)),
        ("brier", lambda **kw: BrierScore(k, **kw), brier_score),
        ("nbrier-priors", lambda **kw: BrierScore(k, priors=p, normalize=True, **kw), partial(brier_score, priors=p, normalize=True)),
        ("bayes-risk", lambda **kw: BayesRisk(c, **kw), partial(bayes_risk, costs=c)),
        ("nbayes-risk-priors", lambda **kw: BayesRisk(c, priors=p, normalize=True, **kw), partial(bayes_risk, costs=c, priors=p, normalize=True)),
        ("ece", lambda **kw: CalibrationError(k, **kw), expected_calibration_error),
        ("rmsce-quantile", lambda **kw: CalibrationError(k, n_bins=10, strategy="quantile", norm="l2", **kw),
         partial(expected_calibration_error, n_bins=10, strategy="quantile", norm="l2")),
        ("classwise-sum", lambda **kw: CalibrationError(k, kind="classwise", reduction="sum", **kw),
         partial(expected_calibration_error, kind="classwise", reduction="sum")),
        ("classwise-mce-quantile", lambda **kw: CalibrationError(k, 5, "quantile", "classwise", "max", "max", **kw),
         partial(expected_calibration_error, n_bins=5, strategy="quantile", kind="classwise", norm="max", reduction="max")),
        ("ecd", lambda **kw: ECD(**kw), entropic_calibration_difference),
    ]
    if k == 2:
        cases.append(("binary-ece", lambda **kw: CalibrationError(2, kind="binary", **kw), partial(expected_calibration_error, kind="binary")))
    return cases


def expected_cost_case(k: int):
    c, p = costs_for(k), priors_for(k)
    return lambda **kw: ExpectedCost(c, priors=p, normalize=True, **kw), partial(expected_cost, costs=c, priors=p, normalize=True)


def batches(n: int, sizes):
    """Consecutive slices covering range(n), with sizes taken cyclically from ``sizes``."""
    start, i = 0, 0
    while start < n:
        yield slice(start, min(start + sizes[i % len(sizes)], n))
        start += sizes[i % len(sizes)]
        i += 1


SPLITS = [[10**9], [1, 2, 3, 500, 17], [128]]


@pytest.mark.parametrize("k, scale", [(2, 3.0), (10, 2.0), (1000, 5.0), (4, 1e4)])
def test_every_split_gives_the_functional_value(k, scale):
    n = 1100
    logits, labels = make_data(n, k, scale, seed=k)
    decisions = bayes_decisions(logits, costs_for(k))
    cases = [(name, factory, fn, logits) for name, factory, fn in case_list(k)]
    cases.append(("expected-cost", *expected_cost_case(k), decisions))
    for name, factory, fn, inputs in cases:
        expected = fn(inputs, labels).item()
        for sizes in SPLITS:
            metric = factory()
            for part in batches(n, sizes):
                metric.update(inputs[part], labels[part])
            got = metric.compute()
            assert got.dtype == torch.float64, name
            assert got.item() == pytest.approx(expected, rel=1e-10, abs=1e-12), (name, sizes)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(10, 150), min_size=1, max_size=6), st.integers(0, 10**6))
def test_random_splits_give_the_functional_value(sizes, seed):
    logits, labels = make_data(300, 4, 2.0, seed=seed)
    for name, factory, fn in case_list(4):
        metric = factory()
        for part in batches(300, sizes):
            metric.update(logits[part], labels[part])
        assert metric.compute().item() == pytest.approx(fn(logits, labels).item(), rel=1e-10, abs=1e-12), name


@pytest.fixture(scope="module")
def calibration_data():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(900, 3, generator=g, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 3).sample()
    fitted = torchcal.TemperatureScaling().fit(logits[:300], labels[:300])
    return logits[300:], labels[300:], fitted


@pytest.mark.parametrize("score", [cross_entropy, brier_score, partial(bayes_risk, costs=costs_for(3))])
def test_calibration_loss_with_a_fitted_calibrator(calibration_data, score):
    logits, labels, fitted = calibration_data
    with torch.no_grad():
        expected = calibration_loss(logits, fitted(logits), labels, score=score, priors=priors_for(3))
    metric = CalibrationLoss(fitted, num_classes=3, score=score, priors=priors_for(3))
    for part in batches(600, [7, 100, 250, 1000]):
        metric.update(logits[part], labels[part])
    got = metric.result()
    assert (got.absolute.item(), got.relative.item()) == pytest.approx(
        (expected.absolute.item(), expected.relative.item()), rel=1e-10
    )
    assert metric.compute().item() == pytest.approx(expected.relative.item(), rel=1e-10)


def test_calibration_loss_holds_no_trainable_parameters(calibration_data):
    """A metric has no parameters to train: the fitted calibrator's, registered as the metric's
    submodule, reached a LightningModule's optimiser, and DDP stopped on them ("parameters that
    were not used in producing the loss"). The metric holds a frozen copy; the user's calibrator
    stays as it was."""
    logits, labels, fitted = calibration_data
    metric = CalibrationLoss(fitted, num_classes=3)
    assert not any(p.requires_grad for p in metric.parameters())
    assert all(p.requires_grad for p in fitted.parameters())
    module = torch.nn.Module()
    module.metric = metric
    assert not [name for name, p in module.named_parameters() if p.requires_grad]


def test_calibration_loss_cross_validates_an_unfitted_calibrator(calibration_data):
    logits, labels, _ = calibration_data
    metric = CalibrationLoss(torchcal.TemperatureScaling(), num_classes=3, folds=4, seed=2)
    for part in batches(600, [50]):
        metric.update(logits[part], labels[part])
    expected = cross_validated_calibration_loss(logits, labels, torchcal.TemperatureScaling(), folds=4, seed=2)
    got = metric.compute()
    assert got.item() == pytest.approx(expected.relative.item(), rel=1e-12)
    assert got.item() > 20


def test_calibration_loss_result_without_samples_is_nan_as_compute(calibration_data):
    """Fitted (sums) or not (kept logits), a metric that kept no sample gives NaN in both fields
    of result(), as compute() does."""
    _, _, fitted = calibration_data
    for calibrator in (fitted, torchcal.TemperatureScaling()):
        metric = CalibrationLoss(calibrator, num_classes=3, ignore_index=-1)
        metric.update(torch.randn(5, 3), torch.full((5,), -1))
        result = metric.result()
        assert math.isnan(result.absolute) and math.isnan(result.relative)
        assert math.isnan(metric.compute())


def test_calibration_loss_needs_a_decomposable_score_when_streaming(calibration_data):
    _, _, fitted = calibration_data
    with pytest.raises(ValueError, match="not a mean of per-sample values"):
        CalibrationLoss(fitted, num_classes=3, score=expected_calibration_error)


def _filled(factory, logits, labels):
    metric = factory()
    metric.update(logits[:300], labels[:300])
    return metric


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric")  # computed right after loading
@pytest.mark.parametrize("name, factory, fn", case_list(3), ids=[c[0] for c in case_list(3)])
def test_clone_pickle_state_dict_and_reset(name, factory, fn):
    logits, labels = make_data(600, 3, 2.0, seed=1)
    metric = _filled(factory, logits, labels)
    value = metric.compute()

    clone = metric.clone()
    clone.update(logits[300:], labels[300:])
    assert clone.compute().item() == pytest.approx(fn(logits, labels).item(), rel=1e-10)
    assert metric.compute().item() == value.item()  # the original is untouched

    restored = pickle.loads(pickle.dumps(metric))
    assert restored.compute().item() == value.item()

    assert metric.state_dict() == {}
    metric.persistent(True)
    buffer = io.BytesIO()
    torch.save(metric.state_dict(), buffer)
    fresh = factory()
    if name.endswith("quantile"):  # list states are restored as lists of tensors
        fresh.persistent(True)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert fresh.compute().item() == pytest.approx(value.item(), rel=1e-12)

    metric.reset()
    metric.update(logits[300:], labels[300:])
    assert metric.compute().item() == pytest.approx(fn(logits[300:], labels[300:]).item(), rel=1e-10)


def test_forward_returns_the_batch_value_and_accumulates():
    logits, labels = make_data(400, 4, 2.0, seed=2)
    metric = CrossEntropy(4)
    first = metric(logits[:200], labels[:200])
    metric(logits[200:], labels[200:])
    assert first.item() == pytest.approx(cross_entropy(logits[:200], labels[:200]).item(), rel=1e-12)
    assert metric.compute().item() == pytest.approx(cross_entropy(logits, labels).item(), rel=1e-12)


def test_differentiable_metrics_pass_gradients():
    """As in torchmetrics, the value returned by ``forward`` carries the gradient."""
    logits, labels = make_data(50, 3, 1.0, seed=3)
    for metric, fn in ((CrossEntropy(3), cross_entropy), (BrierScore(3), brier_score), (ECD(), entropic_calibration_difference)):
        assert metric.is_differentiable
        z = logits.double().requires_grad_()
        (grad,) = torch.autograd.grad(metric(z, labels), z)
        z2 = logits.double().requires_grad_()
        (expected,) = torch.autograd.grad(fn(z2, labels), z2)
        torch.testing.assert_close(grad, expected)


def test_metrics_reject_bad_input():
    logits, labels = make_data(20, 3, 1.0, seed=4)
    with pytest.raises(ValueError, match="K = 3 classes but 4 were expected"):
        CrossEntropy(4).update(logits, labels)
    with pytest.raises(ValueError, match="K = 3 classes but 4 were expected"):
        CalibrationError(4).update(logits, labels)
    with pytest.raises(ValueError, match="num_classes"):
        BrierScore(1)
    with pytest.raises(ValueError, match="K = 2"):
        CalibrationError(3, kind="binary")
    with pytest.raises(ValueError, match="strategy"):
        CalibrationError(3, strategy="adaptive")
    with pytest.raises(ValueError, match="n_bins"):
        CalibrationError(3, n_bins=0)
    with pytest.raises(ValueError, match="norm"):
        CalibrationError(3, norm="l3")
    with pytest.raises(ValueError, match="decisions must lie"):
        ExpectedCost(zero_one_costs(3)).update(torch.tensor([0, 5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="sum to one"):
        BayesRisk(zero_one_costs(3), priors=torch.tensor([0.5, 0.2, 0.2]))
    with pytest.raises(ValueError, match="class_index"):
        CalibrationError(3, kind="classwise").reliability_bins()


def test_reliability_bins_of_the_metric_match_the_functional():
    logits, labels = make_data(800, 5, 2.0, seed=5)
    for strategy in ("uniform", "quantile"):
        metric = CalibrationError(5, n_bins=8, strategy=strategy, kind="classwise")
        for part in batches(800, [100]):
            metric.update(logits[part], labels[part])
        got = metric.reliability_bins(class_index=2)
        expected = torchcal.functional.reliability_bins(logits, labels, 8, strategy, kind="class", class_index=2)
        for field in ("edges", "counts", "mean_score", "frequency"):
            torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-12, atol=1e-15)


def test_metrics_and_functional_modules_import_the_plots_lazily():
    """No module-level import of ``torchcal.plots`` or matplotlib (``plot()`` imports them)."""
    package = Path(torchcal.__file__).parent
    for path in [*package.joinpath("metrics").glob("*.py"), *package.joinpath("functional").glob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n.startswith(("torchcal.plots", "matplotlib")) for n in names), (path.name, names)


def test_calibration_error_plot_draws_the_accumulated_bins():
    pytest.importorskip("matplotlib")
    from torchcal.plots import pyplot

    logits, labels = make_data(500, 3, 2.0, seed=6)
    metric = CalibrationError(3, n_bins=10, kind="classwise")
    metric.update(logits, labels)
    fig, ax = metric.plot_reliability(class_index=2)
    bins = metric.reliability_bins(class_index=2)
    drawn = [line for line in ax.get_lines() if len(line.get_xdata()) == int((bins.counts > 0).sum())]
    assert drawn, "no curve with one point per non-empty bin"
    assert sorted(drawn[0].get_xdata()) == pytest.approx(sorted(bins.mean_score[bins.counts > 0].tolist()))
    assert "class 2" in ax.get_xlabel()
    pyplot().close(fig)


def test_a_binary_metric_takes_one_column_of_log_odds_with_labels_of_one_dimension(real):
    """(N, 1) scores, as nn.Linear(d, 1) outputs them, with (N,) labels raised "K >= 2" (and with
    validate_args=False an IndexError), while (N,) and (N, 1) labels with (N, 1) scores worked."""
    import torchcal.metrics as M

    data = real("sst2_gpt2-0shot_ferrer")
    two = torch.from_numpy(data["logits"]).double()
    labels = torch.from_numpy(data["labels"])
    column = (two[:, 1] - two[:, 0]).unsqueeze(1)
    for validate in (True, False):
        for cls in (M.CrossEntropy, M.BrierScore, M.ErrorRate):
            metric, reference = cls(2, validate_args=validate), cls(2)
            metric.update(column, labels)
            reference.update(two, labels)
            torch.testing.assert_close(metric.compute(), reference.compute(), rtol=1e-12, atol=1e-12)


def test_half_precision_probabilities_are_floored_at_what_their_zeros_stand_for(real):
    """A float16 probability below 2^-25 rounds to 0, a bfloat16 probability of class 1 above
    1 - 2^-9 to 1: floored at 1e-20 (46 nats) those rows had put the cross-entropy of CIFAR-10
    ResNet-110's float16 posteriors 5.5 % above the float64 logits' and that of FVCAUS's bfloat16
    one-column posteriors 25 % above (an invariance review). Floored at what the rounding leaves
    possible (2^-25, and 2^-9 below 1) they are within 0.5 % and 1 %."""
    import torchcal.metrics as M
    from torchcal.functional import cross_entropy

    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits_val"]).double(), torch.from_numpy(data["labels_val"])
    exact = float(cross_entropy(logits, labels))
    probs16 = torch.softmax(logits, 1).half()
    assert int((probs16[torch.arange(len(labels)), labels] == 0).sum()) > 0  # (rows whose label's posterior rounded to 0)
    assert float(M.CrossEntropy(10, input="probs")(probs16, labels)) == pytest.approx(exact, rel=5e-3)

    data = real("fvcaus_xvector-plda_ferrer")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"])
    exact = float(cross_entropy(logits, labels))
    p1 = torch.sigmoid(logits[:, 1] - logits[:, 0]).bfloat16()
    assert int(((p1 == 1) & (labels == 0)).sum()) > 0
    assert float(M.CrossEntropy(2, input="probs")(p1, labels)) == pytest.approx(exact, rel=1e-2)
