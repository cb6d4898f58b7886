"""Refinement loss (loss after temperature scaling on the same data): the functional against a SciPy
float64 minimisation of the temperature-scaling objective on real logits, the streaming metric
against the functional, precision, row order, merging, misuse."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import brentq, minimize_scalar
from scipy.special import log_softmax, softmax
from torchmetrics import MetricCollection

from torchcal import ConvergenceWarning, TemperatureScaling, _tempered_moments
from torchcal.functional import cross_entropy, refinement_loss
from torchcal.metrics import CrossEntropy, RefinementLoss

BUNDLED = Path(__file__).resolve().parents[1] / "torchcal" / "data" / "examples" / "cifar10_resnet110_kangsepp.npz"


def bundled_val() -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(BUNDLED) as f:
        return torch.from_numpy(f["logits_val"]), torch.from_numpy(f["labels_val"]).long()


def scipy_refinement(logits: np.ndarray, labels: np.ndarray, loss: str = "log") -> float:
    """min over T of the mean loss of softmax(logits / T), by bounded Brent on log T in float64."""
    z, onehot = logits.astype(np.float64), np.eye(logits.shape[1])[labels]

    def objective(log_t: float) -> float:
        scaled = z / np.exp(log_t)
        if loss == "log":
            return float(-log_softmax(scaled, axis=1)[np.arange(len(labels)), labels].mean())
        return float(((softmax(scaled, axis=1) - onehot) ** 2).sum(axis=1).mean())

    return float(minimize_scalar(objective, bounds=(-5, 5), method="bounded", options={"xatol": 1e-10}).fun)


def scipy_inverse_temperature(logits: np.ndarray, labels: np.ndarray, loss: str, priors: np.ndarray | None = None) -> float:
    """argmin over beta of the (prior-weighted) mean loss of softmax(beta * logits), in float64: bounded
    Brent on log beta, then brentq on the derivative (the chain rule through the softmax,
    dq/dbeta = q (z - E_q z)), which places the root to round-off where the flat loss only gives
    sqrt(eps)."""
    z, rows = logits.astype(np.float64), np.arange(len(labels))
    onehot = np.eye(z.shape[1])[labels]
    counts = np.bincount(labels, minlength=z.shape[1])
    weights = np.ones(len(labels)) if priors is None else (priors / (counts / len(labels)))[labels]

    def objective(log_beta: float) -> float:
        scaled = z * np.exp(log_beta)
        if loss == "log":
            return float(weights @ -log_softmax(scaled, axis=1)[rows, labels])
        return float(weights @ ((softmax(scaled, axis=1) - onehot) ** 2).sum(axis=1))

    def slope(beta: float) -> float:
        q = softmax(beta * z, axis=1)
        dq = q * (z - (q * z).sum(axis=1, keepdims=True))
        if loss == "log":
            return float(weights @ -(dq[rows, labels] / q[rows, labels]))
        return float(weights @ (2 * (q - onehot) * dq).sum(axis=1))

    start = math.exp(minimize_scalar(objective, bounds=(-7, 3), method="bounded", options={"xatol": 1e-10}).x)
    return float(brentq(slope, 0.99 * start, 1.01 * start, xtol=1e-300, rtol=4 * np.finfo(float).eps))


@pytest.fixture(scope="module")
def val():
    return bundled_val()


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_functional_equals_scipy_minimisation(val, loss):
    logits, labels = val
    expected = scipy_refinement(logits.numpy(), labels.numpy(), loss)
    got = refinement_loss(logits, labels, loss=loss)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if loss == "log":  # the network is over-confident: temperature scaling lowers the log-loss
        assert float(got) < float(cross_entropy(logits, labels)) - 0.01


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_functional_on_cifar100_equals_scipy(real, loss):
    data = real("cifar100_resnet20_ferrer")
    logits, labels = data["logits"][:3000], data["labels"][:3000]
    got = refinement_loss(torch.from_numpy(logits), torch.from_numpy(labels).long(), loss=loss)
    assert float(got) == pytest.approx(scipy_refinement(logits, labels, loss), rel=1e-9)


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_precision_and_row_order_do_not_matter(val, loss):
    logits, labels = val
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    reference = refinement_loss(logits.double(), labels, loss=loss)
    assert float(refinement_loss(logits.float(), labels, loss=loss)) == pytest.approx(float(reference), rel=1e-7)
    assert float(refinement_loss(logits.double()[perm], labels[perm], loss=loss)) == pytest.approx(float(reference), rel=1e-12)


@pytest.mark.parametrize("priors", [None, [0.4, 0.1, 0.1, 0.1, 0.3]], ids=["plain", "priors"])
@pytest.mark.parametrize("loss", ["log", "brier"])
def test_temperature_equals_the_scipy_optimum_on_random_data(loss, priors):
    """The 1-D solver's 1/T (the Brier score's was L-BFGS, which stopped up to 1e-6 from it) against
    SciPy in float64, with and without class re-weighting to deployment priors."""
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(4000, 5, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=gen).squeeze(1)  # three times too confident
    weights = None if priors is None else torch.tensor(priors, dtype=torch.float64)
    ts = TemperatureScaling().fit(logits, labels, loss=loss, priors=weights)
    assert ts.fit_record_.converged and 2.5 < ts.temperature < 3.5
    expected = scipy_inverse_temperature(logits.numpy(), labels.numpy(), loss, None if priors is None else np.array(priors))
    assert 1 / ts.temperature == pytest.approx(expected, rel=1e-8)


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_temperature_on_cifar100_equals_scipy_in_either_precision_and_row_order(real, loss):
    data = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"]).long()
    double = TemperatureScaling().fit(logits.double(), labels, loss=loss)
    assert 1 / double.temperature == pytest.approx(scipy_inverse_temperature(data["logits"], data["labels"], loss), rel=1e-8)
    single = TemperatureScaling().fit(logits, labels, loss=loss)  # float32 passes, float64 sums
    assert single.temperature == pytest.approx(double.temperature, rel=1e-6)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(4))
    permuted = TemperatureScaling().fit(logits.double()[perm], labels[perm], loss=loss)
    assert permuted.temperature == pytest.approx(double.temperature, rel=1e-12)


@pytest.mark.parametrize("name", ["bundled", "cifar100_resnet20_ferrer", "agnews_gpt2-0shot_ferrer"])
def test_streaming_metric_equals_the_functional(name, val, real):
    """The sum-reducible grid state gives the exact value within 1e-6 relative (the documented
    interpolation accuracy), streamed in batches, in float32, with the rows permuted."""
    if name == "bundled":
        logits, labels = val
    else:
        data = real(name)
        logits, labels = torch.from_numpy(data["logits"][:4000]), torch.from_numpy(data["labels"][:4000]).long()
    exact = float(refinement_loss(logits, labels))
    metric = RefinementLoss()
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(2))
    for part in perm.split(700):
        metric.update(logits[part].float(), labels[part])
    value = metric.compute()
    assert value.dtype == torch.float64 and value.ndim == 0
    assert float(value) == pytest.approx(exact, rel=1e-6)


def test_streaming_state_is_the_loss_and_its_derivatives_on_the_grid(val, monkeypatch):
    """The state at every grid point against autograd: in float64 for float64 scores, in chunks of a
    few rows (one pass per update, every grid point from each chunk: the update used to build
    float64 (N, K) temporaries per grid point, 37.5 s per epoch at 50,000 x 1,000), and for
    float32 scores within their round-off."""
    import torchcal.metrics.refinement as module

    logits, labels = val[0][:1000].double(), val[1][:1000]
    passes = []

    def counted(*args, **kwargs):
        passes.append(len(args[2]))
        return _tempered_moments.tempered_moments(*args, **kwargs)

    monkeypatch.setattr(module, "tempered_moments", counted)
    monkeypatch.setattr(_tempered_moments, "_CHUNK_ELEMENTS", 64)  # chunks of 6 rows
    metric = RefinementLoss()
    metric.update(logits, labels)
    assert passes == [49]
    for i, u in enumerate(metric.log_inverse_temperatures):
        u = u.clone().requires_grad_(True)
        total = torch.nn.functional.cross_entropy(u.exp() * logits, labels, reduction="sum")
        (slope,) = torch.autograd.grad(total, u, create_graph=True)
        (curvature,) = torch.autograd.grad(slope, u)
        state = torch.stack([metric.loss_sums[i], metric.slope_sums[i], metric.curvature_sums[i]])
        torch.testing.assert_close(state, torch.stack([total, slope, curvature]).detach(), rtol=1e-10, atol=1e-10)
    single = RefinementLoss()
    single.update(logits.float(), labels)
    torch.testing.assert_close(single.loss_sums, metric.loss_sums, rtol=1e-6, atol=1e-6)
    assert float(single.compute()) == pytest.approx(float(metric.compute()), rel=1e-7)


def test_merged_states_equal_one_pass(val):
    """Sum-reducible: two metrics on halves merged (as DDP's sum reduction does) equal one."""
    logits, labels = val
    one, a, b = RefinementLoss(), RefinementLoss(), RefinementLoss()
    one.update(logits, labels)
    a.update(logits[:2500], labels[:2500])
    b.update(logits[2500:], labels[2500:])
    a.merge_state(b)
    assert float(a.compute()) == pytest.approx(float(one.compute()), rel=1e-12)
    collection = MetricCollection({"refinement": RefinementLoss()})
    collection.update(logits, labels)
    assert float(collection.compute()["refinement"]) == pytest.approx(float(one.compute()), rel=1e-12)


def test_merging_a_state_of_other_options_is_refused(val):
    """The states of metrics built with other options the update depends on (here the temperature
    grid) are not the same sums: merging them gave 0.2938 on the CIFAR-10 halves, against 0.2089
    for the metric on all of them. States of the same options still merge, also into a metric
    that has not been updated yet."""
    logits, labels = val
    a, b = RefinementLoss(), RefinementLoss(temperature_range=(0.5, 50.0))
    a.update(logits[:2500], labels[:2500])
    b.update(logits[2500:], labels[2500:])
    with pytest.raises(ValueError, match="RefinementLoss accumulated under other options"):
        a.merge_state(b)
    with pytest.raises(ValueError, match="other options"):
        a.merge_state({name: getattr(b, name) for name in b._defaults})
    with pytest.raises(ValueError, match="instance of RefinementLoss"):  # (torchmetrics' message, for another class)
        a.merge_state(CrossEntropy(10))
    fresh = RefinementLoss(temperature_range=(0.5, 50.0))
    fresh.merge_state(b)
    with pytest.warns(UserWarning, match="called before"):  # (torchmetrics counts updates, not merges)
        assert float(fresh.compute()) == pytest.approx(float(b.compute()), rel=1e-12)


def test_numpy_counts_and_half_precision_states(val):
    """``num_temperatures`` from NumPy was refused as "not an integer >= 3"; ``set_dtype`` to
    float16 failed in compute (``linalg.solve`` has no half kernel), to bfloat16 in the first update
    (the grid buffer, cast too, was hashed through NumPy). The grid stays float64, and the value is
    computed in float64 from the half-precision sums, returned in their dtype."""
    logits, labels = val
    for count in np.arange(25, 50, 24):
        assert RefinementLoss(num_temperatures=count).num_temperatures == int(count)
    reference = RefinementLoss()
    reference.update(logits, labels)
    for dtype in (torch.float16, torch.bfloat16):
        metric = RefinementLoss().set_dtype(dtype)
        metric.update(logits, labels)
        assert metric.log_inverse_temperatures.dtype == torch.float64
        value = metric.compute()
        assert value.dtype == dtype
        assert float(value) == pytest.approx(float(reference.compute()), rel=2e-2)
    with pytest.raises(ValueError, match="other options"):  # the grid still tells states apart
        RefinementLoss(num_temperatures=25).merge_state(reference)


def test_empty_batch_is_a_no_op_and_range_warning(val):
    logits, labels = val
    metric = RefinementLoss()
    with pytest.warns(UserWarning, match="called before"):  # torchmetrics' own warning
        assert torch.isnan(metric.compute())
    metric.reset()
    metric.update(logits[:0], labels[:0])
    metric.update(logits, labels)
    assert float(metric.compute()) == pytest.approx(float(refinement_loss(logits, labels)), rel=1e-6)
    # the fitted temperature (about 2.3) lies above this range: an upper bound, with a warning. The
    # passes run in the precision of the scores: float32 row sums of exponentials round low, by 2e-8
    # here (terms below half an ulp of the sum vanish).
    for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 1e-7)):
        narrow = RefinementLoss(temperature_range=(0.5, 1.5))
        narrow.update(logits.to(dtype), labels)
        with pytest.warns(UserWarning, match="beyond T_max"):
            bound = float(narrow.compute())
        assert bound == pytest.approx(float(cross_entropy(logits.double() / 1.5, labels)), rel=rel)
        assert bound > float(refinement_loss(logits, labels))
    # separable float32 scores: the loss at T_min is 3.7e-44 (mpmath), its float32 sum -1.8e-49;
    # a loss is never returned below 0 (it was -8.8e-50: a review finding)
    for dtype in (torch.float32, torch.float64):
        separable = RefinementLoss()
        separable.update(torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=dtype), torch.tensor([0, 1]))
        with pytest.warns(UserWarning, match="beyond T_min"):
            assert 0 <= float(separable.compute()) < 1e-43
    # constant score rows: the loss is log K at every temperature, not beyond either end
    constant = RefinementLoss()
    constant.update(torch.ones(20, 4), torch.arange(20) % 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(constant.compute()) == pytest.approx(math.log(4), rel=1e-12)


def test_plot_and_bad_input(val):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    logits, labels = val
    metric = RefinementLoss()
    metric.update(logits[:500], labels[:500])
    fig, ax = metric.plot()
    assert fig is not None and ax is not None
    with pytest.raises(ValueError, match="num_temperatures"):
        RefinementLoss(num_temperatures=2)
    with pytest.raises(ValueError, match="temperature_range"):
        RefinementLoss(temperature_range=(2.0, 1.0))
    with pytest.raises(ValueError, match="loss must be one of"):
        refinement_loss(logits, labels, loss="hinge")
    with pytest.raises(ValueError):
        metric.update(logits[:10], labels[:9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RefinementLoss(validate_args=False).update(logits[:10], labels[:10])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_equals_the_cpu(val):
    logits, labels = val
    metric = RefinementLoss().to("cuda")
    metric.update(logits.cuda(), labels.cuda())
    value = metric.compute()
    assert value.device.type == "cuda"
    assert float(value) == pytest.approx(float(refinement_loss(logits, labels)), rel=1e-6)
    assert float(refinement_loss(logits.cuda(), labels.cuda())) == pytest.approx(float(refinement_loss(logits, labels)), rel=1e-7)


def _numpy_brier(logits: np.ndarray, labels: np.ndarray, beta: float) -> float:
    q = softmax(beta * logits, axis=1)
    return float(((q**2).sum(1) - 2 * q[np.arange(len(labels)), labels] + 1).mean())


def test_brier_temperature_finds_a_minimum_past_a_rise_from_uniform():
    """The Brier score is not convex in 1/T: here it rises from beta = 0 (0.5) and falls towards 1/3
    further on (the two wrong rows reach their worst, 2, and the others 0). The fit stopped at
    beta = 0 ("not positively related"), as is right for the log loss only; a NumPy grid finds the
    lower values."""
    z = torch.tensor([[1.0, 0.0]] * 8 + [[0.0, 1.0]] * 2 + [[6.0, 0.0]] * 2, dtype=torch.float64)
    y = torch.tensor([0] * 8 + [1] * 2 + [1] * 2)
    grid = np.exp(np.linspace(np.log(1e-3), np.log(1e3), 4001))
    best = min(_numpy_brier(z.numpy(), y.numpy(), b) for b in grid)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaling = TemperatureScaling().fit(z, y, loss="brier")
    assert not [w for w in caught if "not positively related" in str(w.message)]
    assert scaling.temperature < math.inf
    assert _numpy_brier(z.numpy(), y.numpy(), 1 / scaling.temperature) <= best + 1e-9 < 0.5


def test_brier_temperature_stays_infinite_where_uniform_is_best():
    """Labels unrelated to the scores: uniform posteriors (Brier 1 - 1/K) beat every finite T."""
    generator = torch.Generator().manual_seed(5)
    z, y = torch.randn(300, 3, generator=generator, dtype=torch.float64), torch.arange(300) % 3
    z[y == 0, 0] -= 2.0  # anti-informative for class 0
    with pytest.warns(ConvergenceWarning, match="not positively related"):
        scaling = TemperatureScaling().fit(z, y, loss="brier")
    assert scaling.temperature == math.inf
    grid = np.exp(np.linspace(np.log(1e-3), np.log(1e3), 2001))
    assert min(_numpy_brier(z.numpy(), y.numpy(), b) for b in grid) >= 2 / 3 - 1e-12


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_refinement_loss_of_logits_that_carry_a_graph(loss):
    """Model outputs computed with gradients on: the chunked passes write with out=, which
    autograd refuses; the loss is a number for early stopping, not a graph."""
    logits = torch.nn.Linear(8, 4)(torch.randn(500, 8, generator=torch.Generator().manual_seed(6)))
    labels = torch.arange(500) % 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert float(refinement_loss(logits, labels, loss)) == float(refinement_loss(logits.detach(), labels, loss))
