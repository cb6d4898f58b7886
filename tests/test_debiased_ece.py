"""Debiased ECE and the monotonic-sweep ECE against independent NumPy float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchcal.functional import expected_calibration_error
from torchcal.functional.debiased_ece import debiased_calibration_error, sweep_calibration_error, sweep_n_bins
from torchcal.functional.diagnostics import binned_scores


def _equal_mass_bins(s: np.ndarray, n_bins: int) -> list[np.ndarray]:
    """Masks of numpy-quantile bins, right-closed, outer edges 0 and 1 (torchcal's convention)."""
    edges = np.quantile(s, np.linspace(0, 1, n_bins + 1))
    index = np.searchsorted(edges[1:-1] * (1 + 1e-12), s, side="left")
    return [index == m for m in range(n_bins)]


def _debiased_numpy(s: np.ndarray, y: np.ndarray, n_bins: int) -> float:
    """Kumar et al.'s unbiased l2 estimate, bin by bin, as in their ``calibration`` package."""
    total = 0.0
    for inside in _equal_mass_bins(s, n_bins):
        n = inside.sum()
        if n < 2:
            continue
        frequency = y[inside].mean()
        total += n / len(s) * ((s[inside].mean() - frequency) ** 2 - frequency * (1 - frequency) / (n - 1))
    return max(total, 0.0) ** 0.5


def _sweep_numpy(s: np.ndarray, y: np.ndarray, p: int, max_bins: int | None = None) -> tuple[int, float]:
    """One column's sweep, bin count by bin count, each with its own quantiles and masks."""
    chosen = 1
    for n_bins in range(2, (len(s) if max_bins is None else min(max_bins, len(s))) + 1):
        frequency = [y[inside].mean() for inside in _equal_mass_bins(s, n_bins) if inside.any()]
        if np.any(np.diff(frequency) < 0):
            break
        chosen = n_bins
    gaps = [(inside.mean(), abs(y[inside].mean() - s[inside].mean())) for inside in _equal_mass_bins(s, chosen) if inside.any()]
    return chosen, sum(w * g**p for w, g in gaps) ** (1 / p)


def _top_label(logits: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    probs = torch.softmax(logits.double(), 1).numpy()
    return probs.max(1), (probs.argmax(1) == labels.numpy()).astype(float)


@pytest.mark.parametrize("temperature", [1.0, 2.395])
def test_on_cifar10_before_and_after_temperature_scaling(real, temperature):
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits"]) / temperature, torch.from_numpy(data["labels"])
    s, y = _top_label(logits, labels)
    assert float(debiased_calibration_error(logits, labels)) == pytest.approx(_debiased_numpy(s, y, 15), rel=1e-9)
    n_bins, value = _sweep_numpy(s, y, 2)
    assert sweep_n_bins(torch.from_numpy(s), torch.from_numpy(y)) == n_bins
    assert float(sweep_calibration_error(logits, labels)) == pytest.approx(value, rel=1e-9)
    assert float(sweep_calibration_error(logits, labels, norm="l1")) == pytest.approx(_sweep_numpy(s, y, 1)[1], rel=1e-9)


def test_classwise_and_binary(real, synthetic):
    scores, y = synthetic(3, 900, seed=6)
    logits, labels = torch.from_numpy(scores) / 4, torch.from_numpy(y)
    probs = torch.softmax(logits, 1).numpy()
    columns = [(probs[:, k], (y == k).astype(float)) for k in range(3)]
    expected = np.mean([_debiased_numpy(s, t, 10) for s, t in columns])
    assert float(debiased_calibration_error(logits, labels, n_bins=10, kind="classwise")) == pytest.approx(expected, rel=1e-9)
    # Kumar et al.'s marginal calibration error: the root of the mean of the classes' squares
    marginal = np.sqrt(np.mean([_debiased_numpy(s, t, 10) ** 2 for s, t in columns]))
    assert float(debiased_calibration_error(logits, labels, n_bins=10, kind="classwise", reduction="rms")) == pytest.approx(marginal, rel=1e-9)
    expected = np.max([_sweep_numpy(s, t, 2)[1] for s, t in columns])
    assert float(sweep_calibration_error(logits, labels, kind="classwise", reduction="max")) == pytest.approx(expected, rel=1e-9)
    data = real("adrenalmnist3d_resnet50_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    s, t = torch.softmax(logits.double(), 1)[:, 1].numpy(), data["labels"].astype(float)
    assert float(debiased_calibration_error(logits, labels, n_bins=5, kind="binary")) == pytest.approx(_debiased_numpy(s, t, 5), rel=1e-9)


def test_debiasing_removes_most_of_the_plug_in_bias_on_calibrated_data():
    generator = torch.Generator().manual_seed(0)
    plug_in, debiased = [], []
    for _ in range(20):
        q = torch.rand(500, generator=generator, dtype=torch.float64)
        logits, labels = torch.stack([(1 - q).log(), q.log()], 1), torch.bernoulli(q, generator=generator).long()
        plug_in.append(float(expected_calibration_error(logits, labels, strategy="quantile", kind="binary", norm="l2")))
        debiased.append(float(debiased_calibration_error(logits, labels, kind="binary")))
    assert np.mean(debiased) < 0.5 * np.mean(plug_in)  # true l2 error is 0


def test_row_order_and_dtype(synthetic):
    scores, y = synthetic(4, 1000, seed=7)
    logits, labels = torch.from_numpy(scores) / 3, torch.from_numpy(y)
    permutation = torch.randperm(1000)
    for fn in (debiased_calibration_error, sweep_calibration_error):
        reference = float(fn(logits, labels))
        assert float(fn(logits[permutation], labels[permutation])) == pytest.approx(reference, rel=1e-12)
        assert float(fn(logits.float(), labels)) == pytest.approx(reference, rel=1e-5)


def test_bad_input():
    logits, labels = torch.randn(20, 3), torch.randint(0, 3, (20,))
    with pytest.raises(ValueError, match="norm"):
        sweep_calibration_error(logits, labels, norm="max")
    with pytest.raises(ValueError, match="kind"):
        debiased_calibration_error(logits, labels, kind="class")
    with pytest.raises(ValueError, match="max_bins must be a positive integer"):
        sweep_calibration_error(logits, labels, max_bins=0)
    with pytest.raises(ValueError, match="reduction"):
        debiased_calibration_error(logits, labels, reduction="median")


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
def test_streaming_metric_equals_functional(synthetic, strategy):
    from torchcal.metrics.debiased_ece import DebiasedCalibrationError

    scores, y = synthetic(3, 1200, seed=8)
    logits, labels = torch.from_numpy(scores) / 3, torch.from_numpy(y)
    for reduction in ("mean", "rms"):
        metric = DebiasedCalibrationError(3, n_bins=10, strategy=strategy, kind="classwise", reduction=reduction)
        for chunk in torch.arange(1200).split(500):
            metric.update(logits[chunk], labels[chunk])
        expected = debiased_calibration_error(logits, labels, n_bins=10, strategy=strategy, kind="classwise", reduction=reduction)
        assert float(metric.compute()) == pytest.approx(float(expected), rel=1e-12)


def _columns_numpy(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """torchcal's scores and 0/1 targets of each column of ``kind``."""
    binned = binned_scores(logits, labels, 1, "uniform", kind)
    return list(zip(binned.scores.T.numpy(), binned.targets.T.numpy().astype(float)))


@pytest.mark.parametrize(("n", "k", "dtype"), [(7, 3, torch.float64), (301, 5, torch.float32), (250, 2, torch.float64), (99, 4, torch.float32)])
def test_batched_sweep_equals_the_column_by_column_reference(awkward, n, k, dtype):
    """The columns, each sorted once and swept side by side, give each column's own sweep (one sort
    and pass per bin count): with tied scores, a class that never occurs (swept to M = N), few
    samples, K = 2, odd N, float32 and float64 logits, in another row order, and with max_bins."""
    logits, labels = awkward(n, k, seed=n, dtype=dtype)
    permutation = torch.randperm(n)
    for kind in ("classwise", "top-label", "binary") if k == 2 else ("classwise", "top-label"):
        columns = _columns_numpy(logits, labels, kind)
        for max_bins in (None, 4):
            bin_counts = [sweep_n_bins(torch.from_numpy(s), torch.from_numpy(t), max_bins) for s, t in columns]
            for norm, p in (("l2", 2), ("l1", 1)):
                reference = [_sweep_numpy(s, t, p, max_bins) for s, t in columns]
                assert bin_counts == [m for m, _ in reference]
                errors = np.array([e for _, e in reference])
                expected = {"mean": errors.mean(), "max": errors.max(), "rms": np.sqrt(np.mean(errors**2))}
                for reduction in expected if kind == "classwise" else ("mean",):
                    for order in (slice(None), permutation):
                        got = sweep_calibration_error(logits[order], labels[order], kind, norm, reduction, max_bins)
                        assert float(got) == pytest.approx(expected[reduction], rel=1e-12, abs=1e-15), (kind, norm, reduction)


@pytest.mark.parametrize(
    ("scores", "targets"),
    [
        ([0.1, 0.2, 0.3, 0.4, 0.5], [0, 0, 0, 0, 0]),  # one class only
        ([0.1, 0.1, 0.2, 0.3, 0.3, 0.9], [0, 0, 0, 1, 1, 1]),  # separable, with ties
        ([0.2, 0.2, 0.5, 0.5, 0.5, 0.5], [0, 1, 1, 0, 0, 1]),  # tied groups of equal frequency
        ([0.2, 0.2, 0.5, 0.5], [1, 1, 0, 1]),  # frequencies 1 then 0.5: some M must decrease
        ([0.3] * 6, [1, 0, 1, 0, 0, 1]),  # all tied: one non-empty bin for every M
        ([0.1] + [0.5] * 9, [1, 1, 0, 1, 0, 0, 1, 0, 1, 0]),  # decreases only from M = 9, past M^2 > N
        ([0.1, 0.4, 0.2, 0.8, 0.6, 0.3, 0.9], [0, 1, 0, 1, 0, 0, 1]),
    ],
)
def test_sweep_n_bins_where_the_frequencies_may_not_decrease(scores, targets):
    """Columns whose tied groups' frequencies never decrease are never stopped (M = N, found without
    sweeping on); the others are swept on, whatever the groups."""
    s, y = np.array(scores), np.array(targets, dtype=float)
    assert sweep_n_bins(torch.from_numpy(s), torch.from_numpy(y)) == _sweep_numpy(s, y, 2)[0]


def test_sweep_n_bins_is_that_of_float64_for_the_same_float32_values(real):
    """With float32 scores the equal-mass edges got float32's tolerance (9.5e-7), not 1e-12 as the
    sweep itself uses: the CIFAR-10 ResNet-110 confidences gave 17 bins in float32, 7 in float64
    (a brute-force sweep of those values: 7)."""
    data = real("cifar10_resnet110_kangsepp")
    probs = torch.softmax(torch.from_numpy(data["logits"]).double(), 1)
    confidence, predicted = probs.max(1)
    correct = predicted == torch.from_numpy(data["labels"])
    as_float32 = confidence.float()
    assert sweep_n_bins(as_float32, correct) == sweep_n_bins(as_float32.double(), correct) == 7
