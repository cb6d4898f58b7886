"""torchcal.plots: what is drawn is what the metrics say, and matplotlib stays a lazy import."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchcal.functional import bayes_risk, cross_entropy, error_rate, reliability_bins
from torchcal.plots import (
    bayes_risk_curve,
    bayes_risk_curves,
    bayes_risk_sweep,
    classwise_reliability,
    corp_reliability_diagram,
    det_plot,
    reliability_diagram,
    smooth_reliability_diagram,
)

pytest.importorskip("matplotlib")



@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def binary():
    """Posteriors with known calibration: labels drawn from softmax(logits / 2), so logits / 2 is calibrated."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2000, 2, generator=gen, dtype=torch.float64) * 2.5
    labels = torch.multinomial(torch.softmax(logits / 2, dim=1), 1, generator=gen).squeeze(1)
    return logits, labels


def test_import_torchcal_does_not_import_matplotlib():
    code = "import sys, torchcal, torchcal.report, torchcal.data; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reliability_diagram_draws_the_bins(synthetic, tmp_path):
    logits, labels = synthetic(4, 3000, seed=0)
    logits, labels = torch.from_numpy(logits), torch.from_numpy(labels)
    fig, ax = reliability_diagram({"raw": logits, "scaled": logits / 3}, labels, n_bins=10)
    curves = {line.get_label(): line for line in ax.get_lines()}
    assert {"raw", "scaled", "perfect calibration"} <= set(curves)
    bins = reliability_bins(logits, labels, n_bins=10)
    full = bins.counts > 0
    np.testing.assert_allclose(curves["raw"].get_xdata(), bins.mean_score[full].numpy())  # markers at bin means
    np.testing.assert_allclose(curves["raw"].get_ydata(), bins.frequency[full].numpy())
    histogram = next(a for a in fig.axes if a is not ax)
    assert histogram.get_yscale() == "log" and len(histogram.patches) == 2  # one count histogram per system
    fig.savefig(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_classwise_reliability_one_panel_per_class(synthetic):
    logits, labels = synthetic(3, 600, seed=1)
    fig, axes = classwise_reliability(torch.from_numpy(logits), torch.from_numpy(labels), n_bins=5)
    assert [ax.get_visible() for ax in axes.flat] == [True, True, True]
    assert "class 2" in axes.flat[2].get_xlabel()
    assert fig.get_suptitle() == "Reliability per class: all 3 classes"


def test_classwise_reliability_says_which_classes_it_shows(synthetic):
    logits, labels = (torch.from_numpy(x) for x in synthetic(12, 600, seed=1))
    fig, axes = classwise_reliability(logits, labels, n_bins=5)
    assert fig.get_suptitle() == "Reliability per class: classes 0-9 of 12 (the first 10; classes= picks others)"
    assert sum(ax.get_visible() for ax in axes.flat) == 10
    fig, _ = classwise_reliability(logits, labels, classes=[11, 3], n_bins=5)
    assert fig.get_suptitle() == "Reliability per class: classes 11, 3 of 12"


def test_sweep_is_the_bayes_risk_of_the_documented_cost_family(synthetic, monkeypatch):
    logits, labels = synthetic(4, 2000, seed=2)
    logits, labels = torch.from_numpy(logits), torch.from_numpy(labels)
    priors = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    t = torch.tensor([-4.0, -1.0, 0.3, 2.5])
    _, nec = bayes_risk_sweep(logits, labels, class_index=2, log_odds=t, priors=priors)
    for value, ti in zip(nec, t):
        pi_k = torch.sigmoid(ti.double())
        pi = (1 - pi_k) * priors / (1 - priors[2])
        pi[2] = pi_k
        costs = (pi / priors)[:, None] * (1 - torch.eye(4, dtype=torch.float64))  # c_ij = pi_i / P_i
        assert float(value) == pytest.approx(float(bayes_risk(logits, labels, costs, priors, normalize=True)), rel=1e-9)
    # in steps of a few samples (the sweep holds (T, step) at a time: (T, N) took 2 GB per million
    # samples, a review finding), the same values
    monkeypatch.setattr(sys.modules["torchcal.plots"], "_SWEEP_ELEMENTS", 4 * 7)
    _, stepped = bayes_risk_sweep(logits, labels, class_index=2, log_odds=t, priors=priors)
    torch.testing.assert_close(stepped, nec, rtol=1e-14, atol=0)
    # with data priors, the operating point logit(P_k) is the 0-1 cost matrix: NEC = error / (1 - max P)
    p = torch.bincount(labels).double() / len(labels)
    _, at_01 = bayes_risk_sweep(logits, labels, class_index=1, log_odds=torch.logit(p[1:2]))
    assert float(at_01) == pytest.approx(float(error_rate(logits, labels)) / (1 - float(p.max())), rel=1e-9)


@pytest.mark.parametrize(("num_classes", "priors"), [(2, None), (4, None), (4, (0.3, 0.7, 0.0, 0.0))])
def test_sweep_is_finite_far_out(synthetic, num_classes, priors):
    """``1 - sigmoid(t)`` rounds to 0 from t = 37: the sweep returned NaN there and inf at t = -40
    for K = 2 (review finding); a class of prior 0 then left 1 - P_k - P_j's round-off where 0 is
    (NEC 2e-28 for 1). Against the definition in 100 digits (mpmath), with the decisions taken as
    documented: k where ``log q_k - max_j log q_j > logit(P_k) - t``."""
    mpmath = pytest.importorskip("mpmath")
    logits, labels = (torch.from_numpy(x) for x in synthetic(num_classes, 2000, seed=3))
    p = torch.bincount(labels, minlength=num_classes).double() / len(labels) if priors is None else torch.tensor(priors, dtype=torch.float64)
    k = 1
    t = torch.tensor([-100.0, -40.0, -37.0, 0.5, 37.0, 40.0, 100.0], dtype=torch.float64)
    _, nec = bayes_risk_sweep(logits, labels, class_index=k, log_odds=t, priors=None if priors is None else p)
    others = logits.double().clone()
    others[:, k] = -math.inf
    best_other = others.argmax(1)
    margin = logits[:, k].double() - others.amax(1)
    with mpmath.workdps(100):  # 1 - (1 - sigmoid(-100)) keeps 56 of them
        for value, ti in zip(nec.tolist(), t.tolist()):
            pi_k = 1 / (1 + mpmath.exp(-ti))
            rest = mpmath.fsum(mpmath.mpf(float(p[j])) for j in range(num_classes) if j != k)  # 1 - P_k, exactly as the P_j sum
            pi = [(1 - pi_k) * mpmath.mpf(float(p[j])) / rest for j in range(num_classes)]
            pi[k] = pi_k
            decision = torch.where(margin > math.log(p[k] / (1 - p[k])) - ti, k, best_other)
            errors = [float((decision[labels == j] != j).double().mean()) if p[j] > 0 else 0.0 for j in range(num_classes)]
            expected = sum(pi[j] * errors[j] for j in range(num_classes)) / (1 - max(pi))
            assert value == pytest.approx(float(expected), rel=1e-12)


def test_binary_curve_integrates_to_the_cross_entropy(binary):
    """Ferrer & Ramos Fig. 1: with costs C(a) = [[0, 1/a], [1/(1-a), 0]] the Bayes risk integrated
    over a in (0, 1) is the cross-entropy. The sweep's point t = logit(P_1) + logit(a) has costs
    proportional to C(a), so EC_C(a) = EC_sweep(t) * P_0 / (a * pi_0)."""
    logits, labels = binary
    p1 = float(labels.double().mean())
    u = torch.linspace(-30, 30, 60001, dtype=torch.float64)  # u = logit(a), so da = a (1 - a) du
    a = torch.sigmoid(u)
    t = math.log(p1 / (1 - p1)) + u
    nec = torch.cat([bayes_risk_sweep(logits, labels, 1, chunk)[1] for chunk in t.split(5000)])
    pi1 = torch.sigmoid(t)
    ec_sweep = nec * torch.minimum(pi1, 1 - pi1)
    ec_fig1 = ec_sweep * (1 - p1) / (a * (1 - pi1))
    integral = torch.trapezoid(ec_fig1 * a * (1 - a), u)
    assert float(integral) == pytest.approx(float(cross_entropy(logits, labels)), rel=1e-4)


def test_calibrated_scores_have_the_lower_curve(binary, tmp_path):
    logits, labels = binary
    fig, ax = bayes_risk_curve({"raw": logits, "calibrated": logits / 2}, labels)
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert np.mean(lines["calibrated"] <= lines["raw"] + 1e-12) > 0.95
    fig.savefig(tmp_path / "b.png")


def test_bayes_risk_curves_panels_and_errors(synthetic):
    logits, labels = (torch.from_numpy(x) for x in synthetic(3, 600, seed=3))
    fig, axes = bayes_risk_curves(logits, labels)
    assert sum(ax.get_visible() for ax in axes.flat) == 3
    with pytest.raises(ValueError, match="class_index"):
        bayes_risk_curve(logits, labels)
    with pytest.raises(ValueError, match=r"class_index must lie in \[0, 3\)"):
        bayes_risk_sweep(logits, labels, class_index=3)


def test_the_sweep_breaks_exact_ties_as_bayes_decisions_do():
    """A tie goes to the lower class index, as ``bayes_decisions``: at the 0-1 point the sweep is
    the error rate (it sent every tie to the best other class: 1.0 against 0.0 for K = 3, and for
    K = 2 the sweep of class 0 at t was not the sweep of class 1 at -t)."""
    logits, labels = torch.tensor([[0.0, 1, 1], [0, 1, 1], [2, 0, 0], [0, 0, 2]]), torch.tensor([1, 1, 0, 2])
    at_zero_one = bayes_risk_sweep(logits, labels, class_index=1, log_odds=torch.tensor([0.0]))[1]
    assert float(at_zero_one) == float(bayes_risk(logits, labels, torch.ones(3, 3) - torch.eye(3), normalize=True)) == 0.0
    logits, labels = torch.tensor([[0.0, 0], [1, 0], [0, 1], [0, 1]]), torch.tensor([0, 0, 1, 1])
    t = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(bayes_risk_sweep(logits, labels, class_index=0, log_odds=t)[1],
                               bayes_risk_sweep(logits, labels, class_index=1, log_odds=-t)[1])
    assert float(bayes_risk_sweep(logits, labels, class_index=0, log_odds=torch.tensor([0.0]))[1]) == float(error_rate(logits, labels))


def test_bayes_risk_curve_draws_given_operating_points_in_order(synthetic):
    logits, labels = (torch.from_numpy(x) for x in synthetic(2, 400, seed=3))
    t = torch.tensor([2.0, -2, 0, 1, -1], dtype=torch.float64)
    fig, ax = bayes_risk_curve(logits, labels, log_odds=t)
    x, y = ax.get_lines()[0].get_data()
    expected = bayes_risk_sweep(logits, labels, log_odds=t.sort().values)[1]
    assert ax.get_xlim() == (-2.0, 2.0) and list(x) == [-2.0, -1.0, 0.0, 1.0, 2.0]
    np.testing.assert_allclose(y, expected.numpy(), rtol=0, atol=0)


def test_the_zero_one_point_is_on_every_default_curve_and_named_only_when_drawn():
    """A class of 8 samples in 1,600 has its 0-1 point at log(8 / 1592) = -5.29, below the measurable
    range's -log(1592 / 10) = -5.07: the legend named a line the axes did not show (the report's
    bayes_risk.png at K = 1,000 showed it in none of its panels)."""
    generator = torch.Generator().manual_seed(4)
    labels = torch.arange(200).repeat_interleave(8)
    logits = torch.randn(1600, 200, generator=generator, dtype=torch.float64)
    zero_one = math.log(8 / 1592)
    t, _ = bayes_risk_sweep(logits, labels, class_index=0)
    assert float(t[0]) <= zero_one - 0.5 and float(t[-1]) >= math.log(2)
    fig, ax = bayes_risk_curve(logits, labels, class_index=0)
    (line,) = [line for line in ax.get_lines() if line.get_label() == "0-1 costs"]
    assert line.get_xdata()[0] == pytest.approx(zero_one)
    assert ax.get_xlim()[0] <= zero_one <= ax.get_xlim()[1]
    fig, ax = bayes_risk_curve(logits, labels, class_index=0, log_odds=torch.linspace(0.0, -6.0, 7))  # descending
    assert "0-1 costs" in [line.get_label() for line in ax.get_lines()]
    fig, ax = bayes_risk_curve(logits, labels, class_index=0, log_odds=torch.linspace(-2.0, 2.0, 5))
    assert "0-1 costs" not in [line.get_label() for line in ax.get_lines()]
    assert "0-1 costs" not in [text.get_text() for text in ax.get_legend().get_texts()]


def test_reliability_diagram_from_binned_statistics(synthetic):
    """Streaming metrics keep only the bins: the diagram draws ReliabilityBins as they are."""
    logits, labels = (torch.from_numpy(x) for x in synthetic(3, 500, seed=4))
    bins = reliability_bins(logits, labels, n_bins=8)
    fig, ax = reliability_diagram({"streamed": bins, "raw": logits}, labels, n_bins=8)
    curves = {line.get_label(): line for line in ax.get_lines()}
    np.testing.assert_allclose(curves["streamed"].get_ydata(), curves["raw"].get_ydata())
    assert "(8 bins)" in ax.get_title()
    reliability_diagram(bins)  # no labels needed
    with pytest.raises(ValueError, match="needs labels"):
        reliability_diagram(logits)


def _numpy_sweep(logits, labels, class_index, log_odds, priors):
    """NEC of the Bayes decisions for the documented cost family, in NumPy: the costs of a mistake on
    true class i are r_i = pi_i / P_i, the decision maximises r_j q_j. A class of prior 0 has pi = 0;
    its ratio is the limit (1 - pi_k) / (1 - P_k) that the other classes share."""
    z = logits.astype(np.float64)
    q = np.exp(z - z.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    present = np.bincount(labels, minlength=z.shape[1]) > 0
    nec = []
    for t in log_odds:
        pi_k = 1 / (1 + np.exp(-t))
        pi = (1 - pi_k) * priors / (1 - priors[class_index])
        pi[class_index] = pi_k
        ratio = np.full_like(priors, (1 - pi_k) / (1 - priors[class_index]))
        ratio[class_index] = pi_k / priors[class_index]
        decisions = (q * ratio).argmax(1)
        errors = [np.mean(decisions[labels == i] != i) for i in np.flatnonzero(present)]
        nec.append(np.dot(pi[present], errors) / (1 - pi.max()))
    return np.array(nec)


def test_bayes_risk_curves_of_data_missing_a_class(real):
    """A class absent from the labels has prior 0 (class frequencies): the other classes' sweeps are
    still defined, and the figure draws them instead of refusing (the report's bayes_risk.png did)."""
    data = real("cifar10_resnet110_kangsepp")
    keep = data["labels_val"] != 9
    logits, labels = data["logits_val"][keep], data["labels_val"][keep]
    priors = np.bincount(labels, minlength=10) / len(labels)
    t = np.linspace(-5, 5, 11)
    for k in (0, 4):
        _, nec = bayes_risk_sweep(torch.from_numpy(logits), torch.from_numpy(labels), k, torch.from_numpy(t))
        np.testing.assert_allclose(nec.numpy(), _numpy_sweep(logits, labels, k, t, priors), rtol=1e-12)
    fig, axes = bayes_risk_curves(torch.from_numpy(logits), torch.from_numpy(labels))
    assert [ax.get_title() for ax in axes.flat if ax.get_visible()] == [
        f"Bayes risk, effective prior of class {k}" for k in range(9)]
    with pytest.raises(ValueError, match="class 9 has prior 0"):
        bayes_risk_sweep(torch.from_numpy(logits), torch.from_numpy(labels), class_index=9)
    with pytest.raises(ValueError, match="class 4 has prior 1: its effective prior can be swept only when it and another"):
        bayes_risk_curves(torch.from_numpy(logits), torch.full((len(labels),), 4))


def test_sweep_refuses_a_positive_prior_for_a_class_without_samples(synthetic):
    """Its error rate is unknown: as bayes_risk, the sweep says so instead of counting it as 0."""
    logits, labels = (torch.from_numpy(x) for x in synthetic(3, 300, seed=5))
    logits, labels = logits[labels != 2], labels[labels != 2]
    priors = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        bayes_risk(logits, labels, torch.ones(3, 3) - torch.eye(3), priors)
    with pytest.raises(ValueError, match=r"class 2 has a positive prior but no sample"):
        bayes_risk_sweep(logits, labels, class_index=1, priors=priors)


@pytest.mark.parametrize("draw", [reliability_diagram, classwise_reliability, bayes_risk_curves,
                                  lambda logits, labels: bayes_risk_curve(logits, labels, class_index=1)])
def test_bad_systems_are_named_before_drawing(draw):
    labels = torch.tensor([0, 1, 2, 1])
    with pytest.raises(ValueError, match="no system to draw"):
        draw({}, labels)
    with pytest.raises(ValueError, match=r"logits must have shape \(N, K\), got shape \(4,\)"):
        draw(torch.randn(4), labels)
    with pytest.raises(ValueError, match="labels has 3 entries but the scores have N = 4 rows"):
        draw(torch.randn(4, 3), labels[:3])


def test_bayes_risk_curve_takes_numpy_input_as_the_reliability_diagram_does(synthetic):
    logits, labels = synthetic(3, 400, seed=6)
    t = torch.linspace(-2, 2, 5, dtype=torch.float64)
    _, ax = bayes_risk_curve({"numpy": logits}, labels, class_index=2, log_odds=t)
    _, nec = bayes_risk_sweep(torch.from_numpy(logits), torch.from_numpy(labels), 2, t)
    np.testing.assert_allclose(next(line for line in ax.lines if line.get_label() == "numpy").get_ydata(), nec.numpy())


def test_empty_panels_and_operating_points_are_refused(synthetic):
    logits, labels = (torch.from_numpy(x) for x in synthetic(3, 300, seed=7))
    for draw in (classwise_reliability, bayes_risk_curves):
        with pytest.raises(ValueError, match="no panel to draw"):
            draw(logits, labels, classes=[])
        with pytest.raises(ValueError, match="no panel to draw"):
            draw(logits, labels, max_panels=0)
    for log_odds in (torch.tensor([]), torch.tensor([0.0, float("nan")]), torch.tensor([-math.inf, 0.0])):
        with pytest.raises(ValueError, match="log_odds must be finite operating points, at least one"):
            bayes_risk_curve(logits, labels, class_index=1, log_odds=log_odds)


def test_det_axes_reach_down_to_the_lowest_rate_drawn():
    """Speaker verification: false-alarm rates down to 1 in 20,000. The axes stopped at 0.1 %, which
    hid most of the curve; they now begin just below its lowest rate, ticked in decades."""
    from torchcal.functional.detection import det_curve
    from torchcal.plots import det_plot

    gen = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.zeros(20000), torch.ones(500)]).long()
    llr = torch.randn(len(labels), generator=gen, dtype=torch.float64) + 6.0 * labels
    scores = torch.stack([torch.zeros_like(llr), llr], 1)
    false_alarm, miss = det_curve(scores, labels)
    lowest = float(false_alarm[(false_alarm > 0) & (miss > 0)].min())
    assert lowest == pytest.approx(1 / 20000)
    _, ax = det_plot(scores, labels)
    [line] = [line for line in ax.lines if line.get_label().startswith("EER")]
    lower = ax.get_xlim()[0]
    assert ax.get_ylim()[0] == lower and lower < float(torch.special.ndtri(torch.tensor(lowest)))
    assert min(line.get_xdata().min(), line.get_ydata().min()) >= lower  # every point drawn is inside
    assert [t.get_text() for t in ax.get_xticklabels()][:3] == ["0.01", "0.1", "1"]  # 1e-4, 1e-3, 1e-2


@pytest.mark.parametrize("draw", [reliability_diagram, classwise_reliability, bayes_risk_curves, corp_reliability_diagram,
                                  det_plot, lambda logits, labels: smooth_reliability_diagram(logits, labels, num_replicates=5),
                                  lambda logits, labels: bayes_risk_curve(logits, labels, class_index=1)])
def test_every_plot_takes_a_calibrators_output_which_requires_grad(binary, draw):
    """The smooth and CORP diagrams raised "Can't call numpy() on Tensor that requires grad" on the
    module's own example, ``{"raw": logits, "tempered": calibrated}``."""
    from torchcal import TemperatureScaling

    logits, labels = binary
    calibrated = TemperatureScaling().fit(logits, labels)(logits)
    assert calibrated.requires_grad
    draw({"raw": logits, "tempered": calibrated}, labels)


def test_one_operating_point_given_as_a_number(binary):
    """A float gave log-odds of shape () beside a (1,) cost, and the curve an IndexError."""
    logits, labels = binary
    t, nec = bayes_risk_sweep(logits, labels, log_odds=0.5)
    assert t.shape == nec.shape == (1,)
    _, expected = bayes_risk_sweep(logits, labels, log_odds=torch.tensor([0.5]))
    assert float(nec[0]) == float(expected[0])
    bayes_risk_curve(logits, labels, log_odds=0.5)


def test_more_than_ten_systems_get_colours_of_their_own(synthetic):
    """The default cycle has 10 colours: with every method of the command line (14 for K = 2), the
    report's reliability figure gave temperature and beta, affine and histogram, ... one colour each
    (a review finding)."""
    import matplotlib.colors

    from torchcal.plots import reliability_diagram

    logits, labels = synthetic(2, 300, seed=0)
    logits, labels = torch.from_numpy(logits), torch.from_numpy(labels)
    systems = {"raw": logits} | {f"method {i}": logits * (1 + i / 20) for i in range(14)}
    _, ax = reliability_diagram(systems, labels)
    colours = {line.get_label(): matplotlib.colors.to_rgba(line.get_color()) for line in ax.lines
               if line.get_label() in systems}
    assert len(colours) == 15 and len(set(colours.values())) == 15 and colours["raw"] == (0, 0, 0, 1)
