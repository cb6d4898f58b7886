"""Plots of the statistics: what is drawn is what the functions compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchcal.functional import reliability_bins
from torchcal.functional.reliability_intervals import reliability_intervals
from torchcal.functional.smooth_ece import smooth_reliability_curve
from torchcal.plots import reliability_diagram, smooth_reliability_diagram

pytest.importorskip("matplotlib")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_error_bars_are_the_binomial_intervals(synthetic):
    scores, y = synthetic(3, 1500, seed=0)
    logits, labels = torch.from_numpy(scores), torch.from_numpy(y)
    _, ax = reliability_diagram(logits, labels, n_bins=10, intervals="wilson")
    bins = reliability_bins(logits, labels, n_bins=10)
    lower, upper = reliability_intervals(bins, method="wilson")
    full = bins.counts > 0
    (bars,) = [c for c in ax.collections if c.__class__.__name__ == "LineCollection" and len(c.get_segments()) == int(full.sum())]
    drawn = np.array([[segment[0][1], segment[1][1]] for segment in bars.get_segments()])
    np.testing.assert_allclose(np.sort(drawn, axis=1), np.stack([lower[full], upper[full]], 1), atol=1e-12)


def test_smooth_diagram_draws_the_curve_and_names_smece(real):
    data = real("sst2_gpt2-0shot_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    _, ax = smooth_reliability_diagram({"gpt2": logits}, labels, kind="binary", num_replicates=20)
    curve = smooth_reliability_curve(logits, labels, kind="binary", num_replicates=20)
    line = next(line for line in ax.lines if line.get_label().startswith("gpt2"))
    shown = (curve.density >= 0.05 * curve.density.mean()).numpy()
    assert shown.mean() > 0.5
    np.testing.assert_allclose(line.get_ydata()[shown], curve.frequency.numpy()[shown], atol=1e-12)
    assert np.isnan(line.get_ydata()[~shown]).all()
    assert f"{float(curve.smooth_ece):.4f}" in line.get_label()


def test_det_plot_draws_the_det_curve_on_probit_axes(real):
    from torchcal.functional.detection import det_curve, equal_error_rate
    from torchcal.plots import det_plot

    data = real("adrenalmnist3d_resnet50_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    _, ax = det_plot({"resnet": logits}, labels)
    curve = det_curve(logits, labels)
    inside = (curve.false_alarm > 0) & (curve.miss > 0)
    line = next(line for line in ax.lines if line.get_label().startswith("resnet"))
    np.testing.assert_allclose(line.get_xdata(), torch.special.ndtri(curve.false_alarm[inside]).numpy())
    np.testing.assert_allclose(line.get_ydata(), torch.special.ndtri(curve.miss[inside]).numpy())
    assert f"{100 * float(equal_error_rate(logits, labels)):.2f} %" in line.get_label()


def test_corp_diagram_draws_the_pav_step_function(real):
    from sklearn.isotonic import IsotonicRegression

    from torchcal.plots import corp_reliability_diagram

    data = real("sst2_gpt2-4shot_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    _, ax = corp_reliability_diagram({"gpt2": logits}, labels, kind="binary")
    line = next(line for line in ax.lines if line.get_label().startswith("gpt2"))
    p = torch.softmax(logits.double(), 1)[:, 1].numpy()
    order = np.argsort(p, kind="stable")
    expected = IsotonicRegression(y_min=0, y_max=1).fit(p, data["labels"].astype(float)).predict(p)[order]
    np.testing.assert_allclose(line.get_xdata(), p[order], atol=1e-12)
    np.testing.assert_allclose(line.get_ydata(), expected, atol=1e-12)


def test_det_plot_of_perfectly_separated_scores(real):
    """Separated classes have an EER of 0 and no DET point inside the probit axes (both rates > 0):
    the plot says EER 0.00 % next to a system that has one, instead of failing (evaluate's det.png)."""
    from torchcal.functional.detection import det_curve
    from torchcal.plots import det_plot

    data = real("adrenalmnist3d_resnet50_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    separated = torch.stack([torch.zeros(len(labels)), 4.0 * labels - 2 + 0.1 * torch.rand(len(labels))], 1).double()
    curve = det_curve(separated, labels)
    assert not bool(((curve.false_alarm > 0) & (curve.miss > 0)).any())
    _, ax = det_plot({"separated": separated, "resnet": logits}, labels)
    labels_drawn = [line.get_label() for line in ax.lines]
    assert "separated: EER 0.00 %" in labels_drawn and any(name.startswith("resnet: EER") for name in labels_drawn)
    det_plot(separated, labels)  # alone
