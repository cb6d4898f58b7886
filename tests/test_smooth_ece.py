"""Smooth ECE against the relplot package (Błasiok & Nakkiran's reference code), side by side."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from torchcal.functional import bootstrap
from torchcal.functional.bootstrap import resample_indices
from torchcal.functional.diagnostics import binary_problems
from torchcal.functional.smooth_ece import (
    _at_fixed_points,
    _reflected_gaussian_smooth,
    smooth_calibration_error,
    smooth_ece_bandwidth,
    smooth_ece_from_grid,
    smooth_reliability_curve,
)
from torchcal.metrics.smooth_ece import SmoothCalibrationError

relplot = pytest.importorskip("relplot")
from relplot.estimators import KernelSmoother  # noqa: E402
from relplot.kernels import ReflectedGaussianKernel  # noqa: E402
from relplot.metrics import search_param  # noqa: E402

TEMPERATURE = 2.395  # SOURCES.md: temperature scaling fitted on the validation split


def _cifar(real, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    data = real("cifar10_resnet110_kangsepp")
    return torch.from_numpy(data["logits"]) / temperature, torch.from_numpy(data["labels"])


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_top_label_matches_relplot_on_cifar10(real, temperature):
    logits, labels = _cifar(real, temperature)
    f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
    expected, width = relplot.smECE(f, y, return_width=True)
    assert float(smooth_calibration_error(logits, labels)) == pytest.approx(expected, abs=1e-6)
    assert float(smooth_ece_bandwidth(logits, labels)[0]) == width


@pytest.mark.parametrize("name", ["sst2_gpt2-0shot_ferrer", "adrenalmnist3d_resnet50_ferrer"])
def test_binary_matches_relplot(real, name):
    data = real(name)
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    probs = torch.softmax(logits.double(), dim=1)[:, 1].numpy()
    assert float(smooth_calibration_error(logits, labels, kind="binary")) == pytest.approx(
        relplot.smECE(probs, labels.numpy().astype(float)), abs=1e-6
    )


def test_classwise_is_the_mean_of_one_vs_rest_relplot(real):
    logits, labels = _cifar(real)
    logits, labels = logits[:3000], labels[:3000]
    probs = torch.softmax(logits.double(), dim=1).numpy()
    expected = np.mean([relplot.smECE(probs[:, k], (labels.numpy() == k).astype(float)) for k in range(10)])
    assert float(smooth_calibration_error(logits, labels, kind="classwise")) == pytest.approx(expected, abs=1e-6)


def test_fixed_bandwidth_matches_relplot(real):
    logits, labels = _cifar(real)
    f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
    for sigma in (0.004, 0.05, 0.3):
        assert float(smooth_calibration_error(logits, labels, bandwidth=sigma)) == pytest.approx(relplot.smECE_sigma(f, y, sigma), abs=1e-6)


def test_streaming_with_a_fixed_bandwidth_equals_relplot_at_any_bandwidth(real):
    """A fixed bandwidth below 0.01 on CIFAR-100's top-label scores: on 1001 points the metric
    was 1.2-2.4 % above relplot's smECE_sigma (a review); on relplot's grid for it, equal."""
    data = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
    for sigma in (0.002, 0.005, 0.05):
        metric = SmoothCalibrationError(100, bandwidth=sigma)
        for chunk in torch.arange(labels.shape[0]).split(4000):
            metric.update(logits[chunk], labels[chunk])
        assert float(metric.compute()) == pytest.approx(relplot.smECE_sigma(f, y, sigma), abs=1e-9)


def test_streaming_equals_functional_on_its_grid_and_relplot_when_bandwidth_is_large(real):
    logits, labels = _cifar(real)
    metric = SmoothCalibrationError(num_classes=10)
    for chunk in torch.arange(labels.shape[0]).split(3333):
        metric.update(logits[chunk], labels[chunk])
    streamed = float(metric.compute())
    assert streamed == pytest.approx(float(smooth_calibration_error(logits, labels, grid_points=1001)), abs=1e-12)
    # relplot's grid is 1001 points for a bandwidth >= 0.01 (here 0.071)
    f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
    assert streamed == pytest.approx(relplot.smECE(f, y), abs=1e-6)


def test_a_larger_grid_is_not_closer_to_relplot_where_confidences_crowd_near_one(real):
    """The reflection counts the share of a score rounded onto the end point 1 once (relplot's as
    well), and that share depends on G: on CIFAR-100's over-confident scores the value moves by
    several % with G, away from relplot's, whose grid is the default G = 1001 here (module docs)."""
    data = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
    expected = relplot.smECE(f, y)
    values = []
    for grid_points in (1001, 4001, 16001):
        metric = SmoothCalibrationError(100, grid_points=grid_points)
        metric.update(logits, labels)
        values.append(float(metric.compute()))
    assert values[0] == pytest.approx(expected, abs=1e-12)
    assert expected - values[1] > 0.02 * expected and values[1] - values[2] > 0.01 * expected


def test_streaming_classwise_merges_states(synthetic):
    scores, y = synthetic(3, 600, seed=1)
    logits, labels = torch.from_numpy(scores), torch.from_numpy(y)
    first, second = SmoothCalibrationError(3, kind="classwise"), SmoothCalibrationError(3, kind="classwise")
    first.update(logits[:250], labels[:250])
    second.update(logits[250:], labels[250:])
    first.grid += second.grid  # what the "sum" reduction does across processes
    assert float(first.compute()) == pytest.approx(float(smooth_calibration_error(logits, labels, "classwise", grid_points=1001)), abs=1e-12)


def test_float32_float64_and_row_order_agree(synthetic):
    scores, y = synthetic(4, 2000, seed=2)
    logits, labels = torch.from_numpy(scores), torch.from_numpy(y)
    reference = float(smooth_calibration_error(logits, labels))
    permutation = torch.randperm(labels.shape[0])
    assert float(smooth_calibration_error(logits[permutation], labels[permutation])) == pytest.approx(reference, abs=1e-12)
    assert float(smooth_calibration_error(logits.float(), labels)) == pytest.approx(reference, abs=1e-6)


def test_curve_matches_relplot_kernel_smoother_and_band_brackets_it(real):
    data = real("sst2_gpt2-0shot_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    curve = smooth_reliability_curve(logits, labels, kind="binary", num_replicates=100)
    probs = torch.softmax(logits.double(), dim=1)[:, 1].numpy().reshape(-1, 1)
    smoother = KernelSmoother(ReflectedGaussianKernel(float(curve.bandwidth))).fit(probs, labels.numpy().astype(float))
    np.testing.assert_allclose(curve.frequency.numpy(), smoother.predict(curve.mesh.numpy().reshape(-1, 1)), atol=1e-9)
    assert bool((curve.lower <= curve.upper).all())
    inside = ((curve.lower <= curve.frequency + 1e-12) & (curve.frequency <= curve.upper + 1e-12)).double().mean()
    assert float(inside) > 0.9
    # a calibrated generator's band covers the diagonal where the scores are dense
    generator = torch.Generator().manual_seed(3)
    q = torch.rand(4000, generator=generator, dtype=torch.float64)
    y = torch.bernoulli(q, generator=generator).long()
    calibrated = smooth_reliability_curve(torch.stack([(1 - q).log(), q.log()], 1), y, kind="binary", num_replicates=100)
    middle = (calibrated.mesh > 0.1) & (calibrated.mesh < 0.9)
    covered = (calibrated.lower <= calibrated.mesh) & (calibrated.mesh <= calibrated.upper)
    assert float(covered[middle].double().mean()) > 0.8


def test_bad_input():
    logits, labels = torch.randn(10, 3), torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="kind"):
        smooth_calibration_error(logits, labels, kind="class")
    with pytest.raises(ValueError, match="bandwidth"):
        smooth_calibration_error(logits, labels, bandwidth=0.0)
    with pytest.raises(ValueError, match="grid_points"):
        SmoothCalibrationError(3, grid_points=2)
    with pytest.raises(ValueError, match="K = 2"):
        SmoothCalibrationError(3, kind="binary")


def test_bootstrap_interval_of_smooth_ece(real):
    data = real("adrenalmnist3d_resnet50_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    result = bootstrap(smooth_calibration_error, logits, labels, num_replicates=30, kind="binary")
    assert float(result.estimate) == pytest.approx(relplot.smECE(torch.softmax(logits.double(), 1)[:, 1].numpy(), data["labels"].astype(float)), abs=1e-6)
    assert float(result.lower) < float(result.estimate) < float(result.upper)
    # the replicates are smooth_calibration_error of the resampled rows (the bootstrap's general path)
    first = next(resample_indices(len(labels), 30, seed=0))[0]
    assert float(result.replicates[0]) == pytest.approx(float(smooth_calibration_error(logits[first], labels[first], kind="binary")), abs=1e-12)


def test_small_bandwidth_uses_relplots_finer_grid():
    # 100k calibrated binary samples: the bandwidth falls below 0.01 and relplot's grid grows past 1001
    generator = torch.Generator().manual_seed(0)
    q = torch.rand(100_000, generator=generator, dtype=torch.float64)
    labels = torch.bernoulli(q, generator=generator).long()
    logits = torch.stack([(1 - q).log(), q.log()], 1)
    expected, width = relplot.smECE(q.numpy(), labels.numpy().astype(float), return_width=True)
    assert width < 0.01
    assert float(smooth_calibration_error(logits, labels, kind="binary")) == pytest.approx(expected, abs=1e-9)
    # the streaming metric's fixed 1001-point grid rounds the scores more coarsely: close, not equal
    metric = SmoothCalibrationError(2, kind="binary")
    metric.update(logits, labels)
    assert float(metric.compute()) == pytest.approx(expected, abs=5e-5)


def _relplot_by_column(logits: torch.Tensor, labels: torch.Tensor, kind: str, bandwidth: float | None = None) -> np.ndarray:
    """relplot's smECE and bandwidth (C, 2) of each column of ``kind``, one column at a time, on torchcal's scores."""
    scores, targets = binary_problems(logits, labels, kind, ("top-label", "binary", "classwise"))
    columns = zip(scores.T.numpy(), targets.T.numpy())
    if bandwidth is not None:
        return np.array([(relplot.smECE_sigma(f, y, bandwidth), bandwidth) for f, y in columns])
    return np.array([relplot.smECE(f, y, return_width=True) for f, y in columns])


@pytest.mark.parametrize(("n", "k", "dtype"), [(7, 3, torch.float64), (301, 5, torch.float32), (250, 2, torch.float64), (40001, 3, torch.float32)])
def test_batched_columns_equal_relplot_column_by_column(awkward, n, k, dtype):
    """All columns smoothed together, their fixed points searched side by side, give each column's
    own smECE and bandwidth: with tied scores, a class that never occurs, few samples, K = 2, odd N,
    a bandwidth below 0.01 (a grid of its own), float32 and float64 logits, in another row order."""
    logits, labels = awkward(n, k, seed=n, dtype=dtype)
    permutation = torch.randperm(n)
    for kind in ("classwise", "binary") if k == 2 else ("classwise",):
        expected = _relplot_by_column(logits, labels, kind)
        at_sigma = _relplot_by_column(logits, labels, kind, bandwidth=0.03)
        for order in (slice(None), permutation):
            assert smooth_ece_bandwidth(logits[order], labels[order], kind).tolist() == expected[:, 1].tolist()
            assert float(smooth_calibration_error(logits[order], labels[order], kind)) == pytest.approx(expected[:, 0].mean(), abs=1e-12)
            at = smooth_calibration_error(logits[order], labels[order], kind, bandwidth=0.03)
            assert float(at) == pytest.approx(at_sigma[:, 0].mean(), abs=1e-12)


def test_streaming_classwise_equals_its_columns_one_by_one(awkward):
    """The metric's batched compute is the mean of smooth_ece_from_grid of each column's grid."""
    logits, labels = awkward(2001, 6, seed=4)
    for bandwidth in (None, 0.02):
        metric = SmoothCalibrationError(6, kind="classwise", bandwidth=bandwidth)
        metric.update(logits, labels)
        by_column = [float(smooth_ece_from_grid(column, bandwidth)[0]) for column in metric.grid]
        assert float(metric.compute()) == pytest.approx(np.mean(by_column), abs=1e-15)


@pytest.mark.parametrize(("sigma", "grid_points"), [(0.05, 1001), (0.003, 3334), (0.3, 7)])
def test_smoothing_equals_relplots_direct_convolution(sigma, grid_points):
    """The FFT of a fast length (a circular convolution, un-aliased on the part kept) is numpy.convolve."""
    values = np.random.RandomState(0).rand(2, grid_points)
    expected = [ReflectedGaussianKernel(sigma).convolve(row, grid_points) for row in values]
    got = _reflected_gaussian_smooth(torch.from_numpy(values), sigma).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def test_fixed_point_search_keeps_a_bracket_per_column():
    """The columns' bisections run side by side, one call per distinct bandwidth of a step, and each
    ends where relplot's search_param ends alone: at 1 when even 1 is too small (level 2), at the
    floor 1e-3 (level 0), or at the fixed point of its own smECE(sigma) = level (1 + sigma)."""
    levels = torch.tensor([2.0, 0.3, 0.0, 0.0123, 0.3, 0.05, 0.0004], dtype=torch.float64)
    calls = []

    def smooth_ece_at(columns: torch.Tensor, sigma: float) -> torch.Tensor:
        calls.append(sigma)
        return levels[columns] * (1 + sigma)

    values, bandwidths = _at_fixed_points(smooth_ece_at, torch.arange(len(levels)))
    expected = [search_param(lambda a, level=level: a < 1e-3 or a < level * (1 + a)) for level in levels.tolist()]
    assert bandwidths.tolist() == expected
    assert values.tolist() == (levels * (1 + bandwidths)).tolist()
    assert len(calls) == len(set(calls))  # each bandwidth tried once, for all the columns at it


def test_small_bandwidths_are_smoothed_in_chunks_of_bounded_size_with_the_same_values(monkeypatch):
    """At a small fixed bandwidth the mesh (10 / sigma points) and, for the curve's band, the grid
    outgrew the chunks sized for the grid: the classwise metric on CIFAR-100 at sigma = 1e-5 peaked
    at 5.1 GB, the curve of 300 samples with 1,000 replicates at 2e-4 at 8.1 GB (now 0.5 GB each).
    Chunked ten times finer, the values are the same."""
    module = sys.modules[smooth_reliability_curve.__module__]  # (torchcal.functional.smooth_ece is a function's name too)
    gen = torch.Generator().manual_seed(4)
    logits, labels = torch.randn(300, 5, generator=gen, dtype=torch.float64), torch.randint(0, 5, (300,), generator=gen)
    metric = SmoothCalibrationError(5, kind="classwise", bandwidth=2e-4)
    metric.update(logits, labels)
    before = (float(metric.compute()), smooth_reliability_curve(logits, labels, bandwidth=2e-4, num_replicates=40))
    monkeypatch.setattr(module, "COLUMN_CHUNK_ELEMENTS", 1 << 17)  # a chunk: one column of that mesh (50,000 x 6 / 2)
    metric.reset()
    metric.update(logits, labels)
    after = (float(metric.compute()), smooth_reliability_curve(logits, labels, bandwidth=2e-4, num_replicates=40))
    assert after[0] == before[0]
    for a, b in zip(after[1], before[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_smooth_reliability_curve_offers_only_its_own_kinds():
    """kind="binary" at K = 3 advised kind="classwise", which the curve then refused (review finding)."""
    logits, labels = torch.randn(300, 3, dtype=torch.float64), torch.randint(0, 3, (300,))
    with pytest.raises(ValueError, match=r'needs K = 2 classes, got K = 3; use kind="top-label"\.$'):
        smooth_reliability_curve(logits, labels, kind="binary")


def test_a_bandwidth_from_smooth_ece_bandwidth_is_taken_as_given():
    """The (1,) tensor smooth_ece_bandwidth returns passed the check and failed later ("type Tensor
    doesn't define __round__"; the metric at compute()). One-element tensors and NumPy numbers are
    taken as floats; several bandwidths are refused, naming bandwidth=None for per-column ones."""
    gen = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(500, 3, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=gen).squeeze(1)
    bandwidth = smooth_ece_bandwidth(logits, labels)
    assert bandwidth.shape == (1,)
    expected = smooth_calibration_error(logits, labels, bandwidth=float(bandwidth))
    for given in (bandwidth, bandwidth[0], np.float64(float(bandwidth)), bandwidth.numpy()):
        assert float(smooth_calibration_error(logits, labels, bandwidth=given)) == float(expected)
        metric = SmoothCalibrationError(3, bandwidth=given)
        metric.update(logits, labels)
        assert float(metric.compute()) == pytest.approx(float(expected), rel=1e-12)
        assert smooth_reliability_curve(logits, labels, bandwidth=given) is not None
    with pytest.raises(ValueError, match=r"bandwidth must be one number, got \(3,\).*bandwidth=None"):
        smooth_calibration_error(logits, labels, bandwidth=smooth_ece_bandwidth(logits, labels, kind="classwise"))
    with pytest.raises(ValueError, match="bandwidth must lie in"):
        SmoothCalibrationError(3, bandwidth="0.1")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["top-label", "classwise"])
def test_the_metric_computes_after_set_dtype_to_half_precision(dtype, kind):
    """torch.fft has no float16 or bfloat16: after ``set_dtype`` to either, compute() raised
    (review finding). The grid is smoothed in float64; only its rounding to ``dtype`` remains."""
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(3000, 4, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=g).squeeze(1)
    metric = SmoothCalibrationError(4, kind=kind).set_dtype(dtype)
    metric.update(logits, labels)
    reference = SmoothCalibrationError(4, kind=kind)
    reference.update(logits, labels)
    torch.testing.assert_close(metric.compute().double(), reference.compute(), rtol=2e-2, atol=1e-3)
