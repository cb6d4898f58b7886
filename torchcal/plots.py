"""Pictures of posterior quality: reliability diagrams and Bayes-risk curves.

Every function takes one system's scores, or several as a ``{name: logits}`` mapping drawn on the
same axes (e.g. ``{"raw": logits, "affine": calibrated}``), and returns matplotlib
``(fig, ax)``. Matplotlib is imported only when a function is called, never by ``import torchcal``;
without a display (Linux with no ``$DISPLAY``) the non-interactive Agg backend is selected.

Bayes-risk curves show the normalised expected cost (NEC) of the Bayes decisions across a family
of cost matrices, one point per operating point. They are the integrand of Ferrer & Ramos' Fig. 1:
for a binary task, the area under the unnormalised risk over the cost family of their eq. 34 is the
cross-entropy. The family used here, for the effective prior of class ``k`` (see
:func:`bayes_risk_sweep`), generalises the binary one to K classes.

Example:
    >>> import torch
    >>> from torchcal.plots import reliability_diagram
    >>> logits, labels = 3 * torch.randn(1000, 4), torch.randint(0, 4, (1000,))
    >>> fig, ax = reliability_diagram({"raw": logits, "tempered": logits / 3}, labels)
    >>> fig.savefig("reliability.png")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels, check_priors
from torchcal.functional import ReliabilityBins, reliability_bins
from torchcal.functional.diagnostics import Strategy
from torchcal.functional.reliability_intervals import reliability_intervals
from torchcal.functional.scoring import _check_classes_present, class_frequencies

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "bayes_risk_curve",
    "bayes_risk_curves",
    "bayes_risk_sweep",
    "classwise_reliability",
    "corp_reliability_diagram",
    "det_plot",
    "pyplot",
    "reliability_diagram",
    "smooth_reliability_diagram",
]

Systems = Tensor | Mapping[str, Tensor]
BinnedSystems = Tensor | ReliabilityBins | Mapping[str, Tensor | ReliabilityBins]

#: Reliability-diagram bins with fewer samples than this get open markers.
SPARSE_BIN = 30
#: The smoothed reliability curve is drawn where the score density is at least this fraction of the
#: uniform density on [0, 1] (elsewhere too few scores fall for the kernel regression to mean much).
SPARSE_DENSITY = 0.05



def pyplot():
    """``matplotlib.pyplot``, imported on first use with the Agg backend when there is no display."""
    if "matplotlib.pyplot" not in sys.modules and sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _systems(logits: BinnedSystems) -> dict[str, Any]:
    systems = dict(logits) if isinstance(logits, Mapping) else {"": logits}
    # a calibrator's output requires grad, which NumPy refuses; a plot has no use for it
    systems = {name: scores.detach() if isinstance(scores, Tensor) else scores for name, scores in systems.items()}
    if not systems:
        raise ValueError("no system to draw: pass (N, K) scores, or a mapping {name: scores} with at least one entry.")
    return systems


def _classes_and_labels(systems: dict[str, Any], labels: Tensor) -> tuple[int, Tensor]:
    """K and the labels as a tensor, validated against the first system's scores before anything is drawn."""
    logits, labels = check_logits_and_labels(next(iter(systems.values())), labels)
    return logits.shape[1], labels


def _colors(names: Sequence[str]) -> dict[str, Any]:
    """"raw" in black, the others in the default colour cycle; more than its 10, in the 20 of
    "tab20" (the cycle gave two of 14 methods one colour)."""
    others = [name for name in names if name != "raw"]
    if len(others) <= 10:
        palette = [f"C{i}" for i in range(len(others))]
    else:
        tab20 = pyplot().get_cmap("tab20")
        palette = [tab20(i % 20) for i in range(len(others))]
    colours = iter(palette)
    return {name: "black" if name == "raw" else next(colours) for name in names}


def _figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return cast("Figure", ax.figure), ax
    fig, ax = pyplot().subplots(figsize=figsize, layout="constrained")
    return fig, ax


# --- reliability diagrams --------------------------------------------------------------------------

def reliability_diagram(
    logits: BinnedSystems,
    labels: Tensor | None = None,
    *,
    kind: Literal["top-label", "binary", "class"] = "top-label",
    class_index: int | None = None,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    ax: Axes | None = None,
    show_histogram: bool = True,
    intervals: str | None = None,
) -> tuple[Figure, Axes]:
    """Observed frequency against mean predicted probability, per bin, with the bin counts.

    Markers sit at each non-empty bin's mean score (not its centre); they are open for bins with
    fewer than :data:`SPARSE_BIN` samples, whose frequency is too noisy to read. Below the curves,
    a step histogram on a log scale (right axis) shows how many samples fall in each bin.

    Args:
        logits: (N, K) scores, or ``{name: (N, K) scores}`` for several systems on one plot; or
            already binned statistics (:class:`~torchcal.functional.ReliabilityBins`, e.g. from a
            streaming ``torchcal.metrics.CalibrationError``), alone or as mapping values.
        labels: (N,) class indices; not needed for binned statistics.
        kind: ``"top-label"`` (confidence vs accuracy), ``"binary"`` (class 1 of K = 2) or
            ``"class"`` (``q_j`` vs ``[y == j]`` for ``class_index`` j). For binned statistics
            they only name the axes.
        n_bins, strategy: binning, as :func:`torchcal.functional.reliability_bins`.
        ax: draw into these axes instead of a new figure.
        show_histogram: draw the bin counts.
        intervals: ``"clopper-pearson"`` or ``"wilson"`` draws each bin's 95 % binomial interval
            (:func:`torchcal.functional.reliability_intervals`) as an error bar.

    Returns:
        ``(fig, ax)``; ``ax`` holds the reliability curves (the histogram is on a twin axis).
    """
    fig, ax = _figure_and_axes(ax, (5.0, 4.6))
    systems = _systems(logits)
    colors = _colors(list(systems))
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    histogram = ax.twinx() if show_histogram else None
    largest = 1.0
    for name, scores in systems.items():
        if isinstance(scores, ReliabilityBins):
            bins = scores
        elif labels is None:
            raise ValueError("reliability_diagram needs labels with scores (or ReliabilityBins instead of scores).")
        else:
            bins = reliability_bins(scores, labels, n_bins=n_bins, strategy=strategy, kind=kind, class_index=class_index)
        counts, x, y = (v.cpu().numpy() for v in (bins.counts, bins.mean_score, bins.frequency))
        full, sparse = counts > 0, counts < SPARSE_BIN
        ax.plot(x[full], y[full], linewidth=1.5, color=colors[name], label=name or None)
        ax.plot(x[full & ~sparse], y[full & ~sparse], "o", markersize=4, color=colors[name])
        ax.plot(x[full & sparse], y[full & sparse], "o", markersize=4, color=colors[name], markerfacecolor="white")
        if intervals is not None:
            lower, upper = (v.cpu().numpy() for v in reliability_intervals(bins, method=intervals))  # type: ignore[arg-type]
            ax.errorbar(x[full], y[full], yerr=[y[full] - lower[full], upper[full] - y[full]], fmt="none",
                        ecolor=colors[name], elinewidth=1, capsize=2)
        if histogram is not None:
            histogram.stairs(counts, bins.edges.cpu().numpy(), color=colors[name], alpha=0.8,
                             linewidth=1, baseline=0.5)
            largest = max(largest, float(counts.max()))
    if histogram is not None:
        _style_histogram(histogram, largest)
    what = {"top-label": ("confidence (top-label probability)", "accuracy"),
            "binary": ("predicted probability of class 1", "frequency of class 1"),
            "class": (f"predicted probability of class {class_index}", f"frequency of class {class_index}")}
    ax.plot([], [], "o", color="0.45", markerfacecolor="white", markersize=4, label=f"bin of < {SPARSE_BIN} samples")
    title = f"reliability, {kind}" + (f" {class_index}" if kind == "class" else "") + f" ({len(bins.counts)} bins)"
    _finish_unit_square(ax, *what.get(kind, ("mean predicted probability", "observed frequency")), title)
    return fig, ax


def _finish_unit_square(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axes, title and legend of a reliability-type plot on [0, 1] x [0, 1]."""
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize="medium")
    ax.legend(loc="upper left", fontsize="small", frameon=False)


def _style_histogram(ax: Axes, largest: float) -> None:
    """Log-scale counts filling the bottom third of the axes."""
    ax.set_yscale("log")
    bottom = 0.5
    ax.set_ylim(bottom, bottom * (largest / bottom) ** 3)
    ax.set_yticks([10.0**e for e in range(int(math.log10(largest)) + 1)])
    ax.minorticks_off()
    ax.set_ylabel("samples per bin", color="0.45", fontsize="small")
    ax.tick_params(axis="y", colors="0.45", labelsize="x-small")


def classwise_reliability(
    logits: Systems,
    labels: Tensor,
    *,
    classes: Sequence[int] | None = None,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    max_panels: int = 10,
) -> tuple[Figure, Any]:
    """One reliability diagram per class (``kind="class"``), in a grid.

    Args:
        classes: which classes to draw; the first ``max_panels`` classes by default.

    Returns:
        ``(fig, axes)`` with ``axes`` the array of subplot axes.
    """
    num_classes, labels = _classes_and_labels(_systems(logits), labels)
    chosen = classes is not None
    classes = list(range(min(num_classes, max_panels))) if classes is None else list(classes)
    fig, axes = _grid(len(classes))
    for ax, k in zip(axes.flat, classes):
        reliability_diagram(logits, labels, kind="class", class_index=k, n_bins=n_bins, strategy=strategy, ax=ax)
    _tidy_grid(axes, len(classes))
    fig.suptitle(f"Reliability per class: {_which_classes(classes, num_classes, chosen)}", fontsize="medium")
    return fig, axes


def _which_classes(classes: list[int], num_classes: int, chosen: bool) -> str:
    """Which of the ``num_classes`` classes a per-class figure shows, in words.

    Example:
        >>> _which_classes(list(range(10)), 100, chosen=False)
        'classes 0-9 of 100 (the first 10; classes= picks others)'
    """
    if classes == list(range(num_classes)):
        return f"all {num_classes} classes"
    if not chosen:
        return f"classes 0-{len(classes) - 1} of {num_classes} (the first {len(classes)}; classes= picks others)"
    return f"classes {', '.join(map(str, classes))} of {num_classes}"


def _grid(panels: int):
    if panels < 1:
        raise ValueError("no panel to draw: classes= must name at least one class, and max_panels be >= 1.")
    columns = min(panels, 5)
    rows = math.ceil(panels / columns)
    size = (5.4, 4.2) if panels == 1 else (3.6 * columns, 3.3 * rows)
    return pyplot().subplots(rows, columns, figsize=size, layout="constrained", squeeze=False)


def _tidy_grid(axes, panels: int) -> None:
    """Keep one legend, drop unused panels, shrink the labels of a grid."""
    for i, ax in enumerate(axes.flat):
        if i >= panels:
            ax.set_visible(False)
            continue
        ax.xaxis.label.set_fontsize("small")
        ax.yaxis.label.set_fontsize("small")
        if i and ax.get_legend():
            ax.get_legend().remove()


# --- Bayes-risk curves -----------------------------------------------------------------------------

def bayes_risk_sweep(
    logits: Tensor,
    labels: Tensor,
    class_index: int = 1,
    log_odds: Tensor | None = None,
    priors: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """NEC of the Bayes decisions as the effective prior of one class sweeps ``(0, 1)``.

    The operating point ``t`` (a prior log-odds) sets the effective priors
    ``pi_k = sigmoid(t)`` for ``k = class_index`` and ``pi_j = (1 - pi_k) P_j / (1 - P_k)`` for the
    other classes, and the cost matrix ``c_ij = pi_i / P_i`` for ``i != j`` (0 on the diagonal),
    with ``P`` the evaluation priors (``priors``, or the class frequencies). So

    - ``EC(t) = sum_i pi_i * err_i``, with ``err_i`` the error rate on class i, and the Bayes
      decisions are ``argmax_j pi_j / P_j * q_j``: the posteriors re-weighted to the priors pi;
    - ``NEC(t) = EC(t) / (1 - max_i pi_i)``, the cost of the best decision made without looking at
      the input is 1 (values above 1 are worse than ignoring the classifier);
    - at ``t = logit(P_k)`` the costs are 0-1 and EC is the error rate.

    A class other than k with ``P_j = 0`` (e.g. absent from the labels) has ``pi_j = 0`` and adds
    no cost; its posterior is weighed as the other classes' are, by the limit ``(1 - pi_k) / (1 - P_k)``.

    For K = 2 and ``class_index = 1`` this is the binary effective-prior curve (an APE-style normalised
    DCF curve): the decisions threshold the posterior log-odds ``log(q_1/q_0)`` at ``logit(P_1) - t``,
    and up to normalisation it is Ferrer & Ramos' eq.-34 family re-parameterised.

    Args:
        logits: (N, K) scores. labels: (N,) class indices.
        class_index: the class whose effective prior is swept.
        log_odds: (T,) operating points ``t``. The default, 201 points, spans the range the data
            can measure: from ``-log(N_rest / 10)`` to ``log(N_k / 10)``, where one more error
            moves the NEC by at most about 0.1 (beyond it the curve is a few samples' noise), and
            at least half a unit past the 0-1 costs' point ``log(P_k / (1 - P_k))``.
        priors: (K,) evaluation priors P; a class with a positive prior needs samples in ``labels``.

    Returns:
        ``(log_odds, nec)``, both (T,) float64.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> labels = torch.tensor([0, 1, 1, 1])
        >>> bayes_risk_sweep(probs.log(), labels, log_odds=torch.tensor([0.0, 1.0986]))[1]
        tensor([0.6667, 1.0000], dtype=torch.float64)
    """
    logits, labels = check_logits_and_labels(logits, labels)
    num_classes = logits.shape[1]
    if not 0 <= class_index < num_classes:
        raise ValueError(f"class_index must lie in [0, {num_classes}), got {class_index}.")
    p = class_frequencies(labels, num_classes) if priors is None else check_priors(priors, num_classes)
    if not 0 < float(p[class_index]) < 1:
        raise ValueError(
            f"class {class_index} has prior {float(p[class_index]):.3g}: its effective prior can be swept only when "
            f"it and another class have positive priors (with the class frequencies: samples in the labels)."
        )
    if log_odds is None:
        t = _measurable_log_odds(labels, class_index, _zero_one_log_odds(p, class_index))
    else:
        t = torch.atleast_1d(torch.as_tensor(log_odds, dtype=torch.float64))  # one operating point as a float too
        if t.ndim > 1:
            raise ValueError(f"log_odds must have shape (T,), one operating point each, got {tuple(t.shape)}; flatten them.")
    t = t.to(labels.device)
    if t.numel() == 0 or not bool(torch.isfinite(t).all()):
        raise ValueError(f"log_odds must be finite operating points, at least one; got {t.numel()}, of which "
                         f"{int((~torch.isfinite(t)).sum())} not finite.")
    log_odds, t = t, t.reshape(-1, 1)
    # 1 - pi_k as sigmoid(-t), and 1 - max_i pi_i from such complements, below: 1 - sigmoid(t)
    # rounds to 0 from t = 37 (NaN or inf where NEC is 1: every decision k, or none)
    pi_k, rest = torch.sigmoid(t), torch.sigmoid(-t)
    pi = rest * p / (1 - p[class_index])
    pi[:, class_index] = pi_k[:, 0]
    largest_other = int(p.index_fill(0, torch.tensor([class_index], device=p.device), -1.0).argmax())
    neither = float(p.index_fill(0, torch.tensor([class_index, largest_other], device=p.device), 0.0).sum())  # (not 1 - P_k - P_j: round-off)
    unit = torch.where(pi_k >= pi[:, largest_other : largest_other + 1], rest,
                       pi_k + rest * neither / (1 - p[class_index]))[:, 0]  # 1 - max_i pi_i
    # The re-weighting only raises or lowers class k against all the others, so each sample's
    # decision is either k or its best other class, whichever wins by the margin below: a
    # difference of two scores, which the log-softmax's per-row constant leaves as it is.
    others = logits.index_fill(1, torch.tensor([class_index], device=logits.device), -math.inf)
    best_other_score, best_other = others.max(dim=1)
    margin = logits[:, class_index].to(torch.float64) - best_other_score.to(torch.float64)
    threshold = math.log(p[class_index] / (1 - p[class_index])) - t  # (T, 1)
    counts = torch.zeros(num_classes, dtype=torch.float64, device=labels.device).index_add_(0, labels, torch.ones_like(margin))
    _check_classes_present(counts, p)  # their error rate is unknown: not 0
    errors = torch.zeros(len(t), num_classes, dtype=torch.float64, device=labels.device)
    step = max(1, _SWEEP_ELEMENTS // len(t))  # (T, step) at a time: (T, N) took 2 GB per million samples
    for margins, others_chosen, y in zip(margin.split(step), best_other.split(step), labels.split(step)):
        # (a tie goes to the lower class index, as in bayes_decisions: at 0-1 costs, the error rate's)
        decide_k = (margins > threshold) | ((margins == threshold) & (others_chosen > class_index))  # (T, step)
        wrong = torch.where(decide_k, y != class_index, others_chosen != y).to(torch.float64)
        errors.index_add_(1, y, wrong)
    return log_odds, (pi * errors / counts.clamp_min(1)).sum(1) / unit


#: Operating points times samples per step of :func:`bayes_risk_sweep` (32 MB of float64 errors).
_SWEEP_ELEMENTS = 1 << 22


def _zero_one_log_odds(priors: Tensor, class_index: int) -> float:
    """The operating point of 0-1 costs: the prior log-odds of the class against the others."""
    return math.log(float(priors[class_index]) / (1 - float(priors[class_index])))


def _measurable_log_odds(labels: Tensor, class_index: int, zero_one: float, points: int = 201) -> Tensor:
    """The default operating points of :func:`bayes_risk_sweep`: the range the data can measure,
    widened to half a unit past the 0-1 point ``zero_one`` where a class has fewer than 10 samples."""
    in_class = int((labels == class_index).sum())
    low = min(-math.log(max(labels.shape[0] - in_class, 20) / 10), zero_one - 0.5)
    high = max(math.log(max(in_class, 20) / 10), zero_one + 0.5)
    return torch.linspace(low, high, points, dtype=torch.float64)


def bayes_risk_curve(
    logits: Systems,
    labels: Tensor,
    *,
    class_index: int | None = None,
    log_odds: Tensor | None = None,
    priors: Tensor | None = None,
    ax: Axes | None = None,
) -> tuple[Figure, Axes]:
    """Plot :func:`bayes_risk_sweep` for one or several systems.

    Args:
        logits: (N, K) scores, or ``{name: (N, K) scores}``.
        class_index: the class whose effective prior is swept; class 1 for binary tasks, and
            required for K > 2 (see :func:`bayes_risk_curves` for one panel per class).
        log_odds, priors: as :func:`bayes_risk_sweep`.
        ax: draw into these axes.
    """
    systems = _systems(logits)
    num_classes, labels = _classes_and_labels(systems, labels)
    if class_index is None:
        if num_classes != 2:
            raise ValueError("for K > 2 pass the class_index whose effective prior is swept.")
        class_index = 1
    fig, ax = _figure_and_axes(ax, (5.4, 4.0))
    colors = _colors(list(systems))
    top = 1.0
    for name, scores in systems.items():
        t, nec = bayes_risk_sweep(scores, labels, class_index, log_odds, priors)
        order = t.argsort()  # (given operating points may come in any order)
        ax.plot(t[order].cpu().numpy(), nec[order].cpu().numpy(), color=colors[name], linewidth=1.5, label=name or None,
                marker="o" if t.numel() == 1 else None)  # (one operating point: no line to draw)
        top = max(top, float(nec.max()))
    p = class_frequencies(labels, num_classes) if priors is None else check_priors(priors, num_classes)
    ax.axhline(1.0, color="0.6", linestyle="--", linewidth=1, label="prior-only system")
    zero_one = _zero_one_log_odds(p, class_index)
    if float(t.min()) <= zero_one <= float(t.max()):  # (given operating points may leave it out)
        ax.axvline(zero_one, color="0.6", linestyle=":", linewidth=1, label="0-1 costs")
    low, high = float(t.min()), float(t.max())
    ax.set(xlim=(low, high) if low < high else (low - 1, high + 1), ylim=(0, min(top * 1.05, 2.0)),
           xlabel=f"prior log-odds of class {class_index} (operating point)", ylabel="normalised expected cost")
    ax.set_title(f"Bayes risk, effective prior of class {class_index}", fontsize="medium")
    ax.legend(loc="best", fontsize="small", frameon=False)
    return fig, ax


def bayes_risk_curves(
    logits: Systems,
    labels: Tensor,
    *,
    classes: Sequence[int] | None = None,
    priors: Tensor | None = None,
    max_panels: int = 10,
) -> tuple[Figure, Any]:
    """:func:`bayes_risk_curve` for each class's effective prior: one panel for K = 2 (class 1),
    else one per class in ``classes`` (by default the first ``max_panels`` classes with a positive
    prior). Returns ``(fig, axes)``."""
    num_classes, labels = _classes_and_labels(_systems(logits), labels)
    if classes is None:
        p = class_frequencies(labels, num_classes) if priors is None else check_priors(priors, num_classes)
        present = (p > 0).nonzero().flatten().tolist()  # absent classes have no curve
        classes = [1] if num_classes == 2 else present[:max_panels]
    fig, axes = _grid(len(classes))
    for ax, k in zip(axes.flat, classes):
        bayes_risk_curve(logits, labels, class_index=k, priors=priors, ax=ax)
    _tidy_grid(axes, len(classes))
    return fig, axes


# --- smoothed reliability diagram (Błasiok & Nakkiran 2023) ----------------------------------------

def smooth_reliability_diagram(
    logits: Systems,
    labels: Tensor,
    *,
    kind: str = "top-label",
    num_replicates: int = 200,
    ax: Axes | None = None,
) -> tuple[Figure, Axes]:
    """The kernel-smoothed reliability curve with its 95 % bootstrap band and smECE in the legend.

    Args:
        logits: (N, K) scores, or ``{name: (N, K) scores}`` for several systems on one plot.
        labels: (N,) class indices.
        kind: ``"top-label"`` or ``"binary"`` (class 1 of K = 2).
        num_replicates: bootstrap replicates of the band.
        ax: draw into these axes instead of a new figure.

    Example:
        >>> import torch
        >>> fig, ax = smooth_reliability_diagram(3 * torch.randn(500, 3), torch.randint(0, 3, (500,)), num_replicates=20)
    """
    from torchcal.functional.smooth_ece import smooth_reliability_curve

    fig, ax = _figure_and_axes(ax, (5.0, 4.6))
    systems = _systems(logits)
    colors = _colors(list(systems))
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    for name, scores in systems.items():
        curve = smooth_reliability_curve(scores, labels, kind=kind, num_replicates=num_replicates)  # type: ignore[arg-type]
        shown = curve.density >= SPARSE_DENSITY * curve.density.mean()
        mesh = curve.mesh.cpu().numpy()
        frequency, lower, upper = (v.where(shown, float("nan")).cpu().numpy() for v in (curve.frequency, curve.lower, curve.upper))
        label = f"{name + ': ' if name else ''}smECE {float(curve.smooth_ece):.4f} (σ = {float(curve.bandwidth):.3f})"
        ax.plot(mesh, frequency, color=colors[name], linewidth=1.5, label=label)
        ax.fill_between(mesh, lower, upper, color=colors[name], alpha=0.2, linewidth=0)
    xlabel, ylabel = {"binary": ("predicted probability of class 1", "frequency of class 1")}.get(
        kind, ("confidence (top-label probability)", "accuracy"))
    _finish_unit_square(ax, xlabel, ylabel, f"smoothed reliability, {kind} (95 % bootstrap band)")
    return fig, ax


# --- DET curves (binary detection) ----------------------------------------------------------------

#: Error rates ticked on DET axes down to 0.1 %; below it, whole decades (closer together on probit axes).
DET_TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


def _det_axis(lowest: float) -> tuple[float, list[float]]:
    """The lower limit of DET axes on the probit scale, a little below ``lowest``, the lowest rate
    drawn (at most 10 %), and the rates ticked above it. Axes that reach below 0.1 % tick it and
    the decades below only: 0.2 % and 0.5 % would crowd it."""
    lowest = min(lowest, 0.1)
    limit = 1.05 * float(torch.special.ndtri(torch.tensor(lowest, dtype=torch.float64)))  # 5 % of the span to 50 % (0) below
    rates = list(DET_TICKS)
    if lowest < DET_TICKS[0]:
        rates = [float(f"1e-{d}") for d in range(-math.floor(math.log10(lowest)), 3, -1)] + [t for t in rates if t not in (0.002, 0.005)]
    positions = torch.special.ndtri(torch.tensor(rates, dtype=torch.float64)).tolist()
    return limit, [t for t, x in zip(rates, positions) if x >= limit]


def det_plot(logits: Systems, labels: Tensor, *, ax: Axes | None = None) -> tuple[Figure, Axes]:
    """Detection-error-tradeoff curves on probit axes, with each system's ROC-convex-hull EER; the
    axes reach down to the lowest non-zero false-alarm or miss rate drawn.

    Args:
        logits: (N, 2) scores (class 1 is the target), or ``{name: (N, 2) scores}``.
        labels: (N,) 0/1 labels.
        ax: draw into these axes instead of a new figure.

    Example:
        >>> import torch
        >>> labels = torch.randint(0, 2, (400,))
        >>> fig, ax = det_plot(torch.stack([torch.zeros(400), 2 * labels + torch.randn(400)], 1), labels)
    """
    from torchcal.functional.detection import det_curve, equal_error_rate

    fig, ax = _figure_and_axes(ax, (5.0, 4.6))
    systems = _systems(logits)
    colors = _colors(list(systems))
    probit = torch.special.ndtri
    lowest = 1.0
    for name, scores in systems.items():
        false_alarm, miss = det_curve(scores, labels)
        inside = (false_alarm > 0) & (miss > 0)
        eer = float(equal_error_rate(scores, labels))
        ax.plot(probit(false_alarm[inside]).cpu().numpy(), probit(miss[inside]).cpu().numpy(), color=colors[name],
                linewidth=1.5, label=f"{name + ': ' if name else ''}EER {100 * eer:.2f} %")
        if eer > 0:
            ax.plot([float(probit(torch.tensor(eer)))] * 2, [float(probit(torch.tensor(eer)))] * 2, "o",
                    color=colors[name], markersize=5)
        if bool(inside.any()):  # not for separated classes: no point has both rates > 0
            lowest = min(lowest, float(false_alarm[inside].min()), float(miss[inside].min()))
    lower, ticks = _det_axis(lowest)
    positions = probit(torch.tensor(ticks, dtype=torch.float64)).tolist()
    labels_text = [f"{100 * t:g}" for t in ticks]
    ax.set_xticks(positions, labels_text)
    ax.set_yticks(positions, labels_text)
    limits = (lower, float(probit(torch.tensor(0.5))))
    ax.plot(limits, limits, color="0.6", linestyle="--", linewidth=1)
    ax.set(xlim=limits, ylim=limits, xlabel="false-alarm rate (%)", ylabel="miss rate (%)")
    ax.set_title("detection error tradeoff", fontsize="medium")
    ax.legend(loc="upper right", fontsize="small", frameon=False)
    return fig, ax


# --- CORP reliability diagram (Dimitriadis, Gneiting & Jordan 2021) -------------------------------

def corp_reliability_diagram(
    logits: Systems, labels: Tensor, *, kind: str = "top-label", ax: Axes | None = None
) -> tuple[Figure, Axes]:
    """The PAV-recalibrated probabilities against the scores, with the CORP Brier decomposition
    (miscalibration MCB, discrimination DSC, uncertainty UNC) in the legend.

    Args:
        logits: (N, K) scores, or ``{name: (N, K) scores}`` for several systems on one plot.
        labels: (N,) class indices.
        kind: ``"top-label"`` or ``"binary"`` (class 1 of K = 2).
        ax: draw into these axes instead of a new figure.

    Example:
        >>> import torch
        >>> fig, ax = corp_reliability_diagram(3 * torch.randn(500, 3), torch.randint(0, 3, (500,)))
    """
    from torchcal.functional.score_decomposition import corp_decomposition, corp_reliability_curve

    fig, ax = _figure_and_axes(ax, (5.0, 4.6))
    systems = _systems(logits)
    colors = _colors(list(systems))
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    for name, scores in systems.items():
        x, recalibrated = corp_reliability_curve(scores, labels, kind=kind)  # type: ignore[arg-type]
        parts = corp_decomposition(scores, labels, kind=kind)  # type: ignore[arg-type]
        label = (f"{name + ': ' if name else ''}MCB {float(parts.miscalibration):.4f}, DSC "
                 f"{float(parts.discrimination):.4f}, UNC {float(parts.uncertainty):.4f}")
        ax.step(x.cpu().numpy(), recalibrated.cpu().numpy(), where="post", color=colors[name], linewidth=1.5,
                label=label)
    xlabel, ylabel = {"binary": ("predicted probability of class 1", "CORP recalibrated probability")}.get(
        kind, ("confidence (top-label probability)", "CORP recalibrated accuracy"))
    _finish_unit_square(ax, xlabel, ylabel, f"CORP reliability, {kind} (Brier decomposition)")
    return fig, ax
