"""The CUDA code paths: fits and metrics on the GPU agree with the CPU, stay on the device, and
synchronise with the host only where the algorithm needs a decision (skipped without a GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from sync_count import count_host_syncs

import torchcal
from torchcal.data import EXAMPLE_PATH, load_scores
from torchcal.metrics import BrierScore, CalibrationError, CrossEntropy, PosteriorQuality

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def resnet110():
    """The bundled ResNet-110 CIFAR-10 logits: validation split to fit, test split to score."""
    return load_scores(EXAMPLE_PATH, split="val"), load_scores(EXAMPLE_PATH)


def binary(scores):
    keep = scores.labels < 2
    return scores.logits[keep][:, :2], scores.labels[keep]


CALIBRATORS = {
    "temperature": (torchcal.TemperatureScaling, False),
    "affine": (torchcal.AffineCalibration, False),
    "vector": (torchcal.VectorScaling, False),
    "matrix": (torchcal.MatrixScaling, False),
    "dirichlet-odir": (lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=10.0), False),
    "dirichlet-odir-cv": (lambda: torchcal.DirichletCalibration(reg="odir", reg_grid=(0.1, 10.0), cv_folds=3), False),
    "platt": (torchcal.PlattScaling, True),
    "beta": (torchcal.BetaCalibration, True),
    "histogram": (torchcal.HistogramBinning, False),
    "isotonic": (torchcal.IsotonicCalibration, False),
}


@pytest.mark.parametrize("name", CALIBRATORS)
def test_fit_on_cuda_equals_fit_on_cpu(name, resnet110):
    make, is_binary = CALIBRATORS[name]
    val, test = resnet110
    (x, y), (x_test, y_test) = (binary(val), binary(test)) if is_binary else ((val.logits, val.labels), (test.logits, test.labels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchcal.ConvergenceWarning)
        on_cpu = make().fit(x, y)
        on_cuda = make().fit(x.to(CUDA), y.to(CUDA))
    for tensor in on_cuda.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            assert tensor.device.type == "cuda"
    out = on_cuda(x_test.to(CUDA))
    assert out.device.type == "cuda"
    records = f"CPU {on_cpu.fit_record_}, CUDA {on_cuda.fit_record_}"
    if name in ("histogram", "isotonic"):
        # Step maps of softmax outputs, which differ between devices in the last bits: a sample
        # can cross a step, so the maps agree as scores rather than sample by sample.
        nll = [torch.nn.functional.nll_loss(m(x_test.to(d)).cpu(), y_test).item() for m, d in ((on_cpu, "cpu"), (on_cuda, CUDA))]
        assert nll[0] == pytest.approx(nll[1], rel=1e-3), records
        return
    assert on_cuda.fit_record_.loss == pytest.approx(on_cpu.fit_record_.loss, rel=1e-7), records  # TS passes in float32
    if name != "matrix":
        # (These logits sum to about 0 in every row, up to noise: an unregularised full map has a
        # direction in which the loss is flat to 1e-15, so its round-off differs between devices.)
        torch.testing.assert_close(out.cpu(), on_cpu(x_test), rtol=1e-5, atol=1e-6, msg=lambda m: f"{m}\n{records}")


@pytest.mark.parametrize("make", [torchcal.MatrixScaling, lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0)], ids=["matrix", "dirichlet-odir"])
def test_brier_fit_on_cuda_equals_fit_on_cpu(make, resnet110):
    """The Brier fits run L-BFGS in curvature-scaled coordinates; the scaling is built on the device."""
    val, test = resnet110
    on_cpu = make().fit(val.logits, val.labels, loss="brier")
    on_cuda = make().fit(val.logits.to(CUDA), val.labels.to(CUDA), loss="brier")
    records = f"CPU {on_cpu.fit_record_}, CUDA {on_cuda.fit_record_}"
    assert on_cuda.fit_record_.converged and on_cpu.fit_record_.converged, records
    # (stopped at a gradient near 1e-6 on a non-convex objective: the loss agrees to about g^2)
    assert on_cuda.fit_record_.loss == pytest.approx(on_cpu.fit_record_.loss, rel=1e-7), records
    if type(on_cpu) is torchcal.MatrixScaling:
        return  # the unregularised map's flat direction (test_fit_on_cuda_equals_fit_on_cpu)
    # parameters at two such stops differ along the weakly curved directions: outputs to 1e-4
    torch.testing.assert_close(on_cuda(test.logits.to(CUDA)).cpu(), on_cpu(test.logits), rtol=1e-4, atol=1e-4, msg=lambda m: f"{m}\n{records}")


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_metrics_on_cuda_equal_metrics_on_cpu(precision, resnet110):
    _, test = resnet110
    made = {}
    for device in ("cpu", "cuda"):
        metrics = [PosteriorQuality(10, precision=precision), CrossEntropy(10), BrierScore(10), CalibrationError(10)]
        for metric in metrics:
            metric.to(device)
            for start in range(0, 10_000, 3_000):
                metric.update(test.logits[start : start + 3_000].to(device), test.labels[start : start + 3_000].to(device))
        made[device] = metrics
    fused_cpu, *rest_cpu = (m.compute() for m in made["cpu"])
    fused_cuda, *rest_cuda = (m.compute() for m in made["cuda"])
    for key in fused_cpu:
        torch.testing.assert_close(fused_cuda[key].cpu(), fused_cpu[key], rtol=1e-6, atol=1e-9)
    for a, b in zip(rest_cuda, rest_cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)


def test_uniform_bins_on_cuda_equal_bins_on_cpu():
    from torchcal.functional.diagnostics import uniform_bin_indices

    scores = torch.cat([torch.rand(10_000, dtype=torch.float64), torch.arange(16, dtype=torch.float64) / 15]).unsqueeze(1)
    assert torch.equal(uniform_bin_indices(scores.to(CUDA), 15).cpu(), uniform_bin_indices(scores, 15))


def test_first_maximum_with_ties_on_cuda():
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [3.0, 0.0, 3.0]], device=CUDA)
    labels = torch.tensor([1, 1, 2], device=CUDA)
    metric = PosteriorQuality(3).to(CUDA)
    metric.update(logits, labels)
    assert float(metric.compute()["error_rate"]) == pytest.approx(2 / 3)


def test_ties_on_integer_logits_on_cuda_equal_cpu():
    g = torch.Generator().manual_seed(7)
    logits, labels = torch.randint(0, 4, (3000, 50), generator=g).float(), torch.randint(0, 50, (3000,), generator=g)
    for make in (lambda: PosteriorQuality(50, precision="float32"), lambda: CalibrationError(50)):
        on_cpu, on_cuda = make(), make().to(CUDA)
        on_cpu.update(logits, labels)
        on_cuda.update(logits.to(CUDA), labels.to(CUDA))
        expected, got = on_cpu.compute(), on_cuda.compute()
        for key in expected if isinstance(expected, dict) else [None]:
            pick = (lambda r: r[key]) if key else (lambda r: r)
            torch.testing.assert_close(pick(got).cpu(), pick(expected), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_exp_on_cuda(dtype):
    from torchcal._fast_exp import scaled_exp

    x = -80 * torch.rand(10_000, dtype=dtype, device=CUDA)
    for scale in (1.0, 0.5):
        torch.testing.assert_close(scaled_exp(x, scale), torch.exp(scale * x))
        y = x.clone()
        torch.testing.assert_close(scaled_exp(y, scale, out=y), torch.exp(scale * x))


def test_bootstrap_of_the_calibration_error_on_cuda_equals_cpu(resnet110):
    from torchcal.functional import bootstrap, expected_calibration_error

    _, test = resnet110
    on_cpu = bootstrap(expected_calibration_error, test.logits, test.labels, 200, kind="classwise")
    on_cuda = bootstrap(expected_calibration_error, test.logits.to(CUDA), test.labels.to(CUDA), 200, kind="classwise")
    assert on_cuda.replicates.device.type == "cuda"
    torch.testing.assert_close(on_cuda.replicates.cpu(), on_cpu.replicates, rtol=1e-9, atol=1e-12)


def test_host_synchronisations_are_per_iteration_not_per_chunk(monkeypatch):
    from torchcal import _tempered_moments

    generator = torch.Generator(device=CUDA).manual_seed(0)
    logits = 3 * torch.randn(200_000, 100, device=CUDA, generator=generator)
    labels = torch.distributions.Categorical(logits=logits / 3).sample()
    torchcal.TemperatureScaling().fit(logits, labels)  # warm-up
    syncs = count_host_syncs(lambda: torchcal.TemperatureScaling().fit(logits, labels))
    # a read-back per Newton step (of the subsample fit and of the full one) and a few for the
    # set-up, however many chunks a pass takes
    assert syncs <= 50
    monkeypatch.setattr(_tempered_moments, "_DEVICE_CHUNK_ELEMENTS", 1 << 16)  # 300 chunks per pass
    chunked = count_host_syncs(lambda: torchcal.TemperatureScaling().fit(logits, labels))
    assert abs(chunked - syncs) <= 2  # a Newton step more or less, as the sums round differently

    metric = PosteriorQuality(100, validate_args=False).to(CUDA)
    metric.update(logits[:1000], labels[:1000])
    assert count_host_syncs(lambda: [metric.update(logits[i : i + 1000], labels[i : i + 1000]) for i in range(0, 20_000, 1000)]) == 0


def test_calibrated_model_on_cuda(resnet110):
    val, test = resnet110
    head = torchcal.TemperatureScaling().fit(val.logits.to(CUDA), val.labels.to(CUDA))
    network = torch.nn.Linear(10, 10).to(CUDA)
    with torch.no_grad():
        network.weight.copy_(torch.eye(10))
        network.bias.zero_()
    model = torchcal.CalibratedModel(network, head).eval()
    out = model(test.logits[:100].to(CUDA))
    torch.testing.assert_close(out, head(test.logits[:100].to(CUDA)))


def test_plots_of_cuda_scores_equal_plots_of_cpu_scores(resnet110):
    """The figures read their data back from the device (a CUDA tensor has no .numpy())."""
    from torchcal import plots

    plt = plots.pyplot()
    _, test = resnet110
    logits, labels = test.logits[:2000], test.labels[:2000]
    _, nec_cpu = plots.bayes_risk_sweep(logits, labels, 3)
    _, nec = plots.bayes_risk_sweep(logits.to(CUDA), labels.to(CUDA), 3)
    torch.testing.assert_close(nec.cpu(), nec_cpu)
    for draw in (plots.reliability_diagram, plots.bayes_risk_curves, plots.classwise_reliability):
        fig, _ = draw(logits.to(CUDA), labels.to(CUDA))
        plt.close(fig)
