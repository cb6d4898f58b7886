"""The diagnose-and-fix workflow: how good are the posteriors, how much of their loss is
miscalibration, and which calibration stage removes it (Ferrer & Ramos; the CalibrationTutorial).

:func:`evaluate` measures the raw posteriors with expected proper scoring rules (normalised
cross-entropy NCE, normalised Brier NBS), the error rate and the normalised Bayes risk (NEC) for a
cost matrix, with percentile-bootstrap intervals. It then fits every requested calibrator on data
other than the samples it scores -- a separate calibration set, or cross-validation on the
evaluated set -- and reports the same metrics after calibration, the calibration loss (absolute,
in NCE units, and relative, in %) and ECE/ECD as diagnostics. The method with the lowest calibrated
NCE wins; it is refitted on all the calibration data and returned for reuse.

The command line (``torchcal evaluate``) prints :meth:`Report.table` and writes
:meth:`Report.save`; notebooks get the same :class:`Report` object.

Example:
    >>> from torchcal.data import EXAMPLE_PATH, load_scores
    >>> test, heldout = load_scores(EXAMPLE_PATH), load_scores(EXAMPLE_PATH, split="val")
    >>> report = evaluate(test, methods=["temperature"], calibration=heldout, bootstrap=0)
    >>> report.best, round(report.raw.nce.value, 3), round(report.methods[0].quality.nce.value, 3)
    ('temperature', 0.156, 0.091)
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from torchcal import (
    AffineCalibration,
    BetaCalibration,
    Calibrator,
    DirichletCalibration,
    HistogramBinning,
    IsotonicCalibration,
    MatrixScaling,
    PlattScaling,
    TemperatureScaling,
    VectorScaling,
    VennAbersCalibration,
    cross_validate,
)
from torchcal._validation import check_costs, check_logits_and_labels, check_priors
from torchcal.data import Scores
from torchcal.functional import (
    bayes_risk,
    brier_score,
    calibration_loss,
    cross_entropy,
    entropic_calibration_difference,
    error_rate,
    expected_calibration_error,
    zero_one_costs,
)
from torchcal.functional import (
    bootstrap as bootstrap_metric,
)

__all__ = [
    "METHODS",
    "Estimate",
    "MethodResult",
    "Quality",
    "Report",
    "evaluate",
    "load_calibrator",
    "make_calibrator",
    "save_calibrator",
]

#: The calibration methods by their command-line names: the one place that maps them.
METHODS: dict[str, Callable[..., Calibrator]] = {
    "temperature": TemperatureScaling,
    "affine": AffineCalibration,
    "vector": VectorScaling,
    "matrix-odir": partial(MatrixScaling, reg="odir"),
    "dirichlet-odir": partial(DirichletCalibration, reg="odir"),
    "dirichlet-l2": partial(DirichletCalibration, reg="l2"),
    "platt": PlattScaling,
    "beta": BetaCalibration,
    "histogram": HistogramBinning,
    "isotonic": IsotonicCalibration,
    "venn-abers": VennAbersCalibration,
}

ECE_BINS = 15


def make_calibrator(method: str, **options: Any) -> Calibrator:
    """A fresh calibrator for a method name of :data:`METHODS`, with constructor ``options``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}.")
    try:
        return METHODS[method](**options)
    except TypeError as err:
        raise ValueError(f"bad options for method {method!r}: {err}.") from None


# --- results ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """A metric's value and, when bootstrapped, its percentile interval."""

    value: float
    lower: float | None = None
    upper: float | None = None


@dataclass(frozen=True)
class Quality:
    """Metrics of one set of posteriors on the evaluated samples.

    ``nce``/``nbs``: cross-entropy / Brier score divided by those of the prior-only system;
    ``error_rate``; ``nec``: normalised expected cost of the Bayes decisions for the cost matrix;
    ``ece``: top-label ECE in %, 15 equal-width bins; ``ecd``: entropic calibration difference
    (> 0 over-confident, < 0 under-confident).
    """

    nce: Estimate
    nbs: Estimate
    error_rate: Estimate
    nec: Estimate
    ece: float
    ecd: float


@dataclass(frozen=True)
class MethodResult:
    """One calibration method: its metrics after calibration and its calibration loss.

    ``calibration_loss`` = NCE(raw) - NCE(calibrated); ``relative_calibration_loss`` = that in %
    of NCE(raw) (RCL); ``relative_calibration_loss_brier`` the same with NBS. ``parameters``
    summarises the calibrator fitted on all calibration data.
    """

    method: str
    quality: Quality
    calibration_loss: float
    relative_calibration_loss: float
    relative_calibration_loss_brier: float
    parameters: dict[str, Any]
    seconds: float


@dataclass
class Report:
    """Everything :func:`evaluate` found; :meth:`table` prints it, :meth:`save` writes it.

    ``costs`` is None for 0-1 costs. The last fields hold tensors for notebooks and figures and
    are left out of :meth:`to_dict`: the winning ``calibrator`` (fitted on all calibration data),
    the evaluated ``logits``/``labels`` and each method's ``calibrated`` log-posteriors.
    """

    source: str
    read_as: str
    num_samples: int
    num_classes: int
    protocol: str
    priors: list[float] | None
    costs_name: str
    costs: list[list[float]] | None
    bootstrap: int
    raw: Quality
    methods: list[MethodResult]
    best: str | None
    calibrator: Calibrator | None = field(default=None, repr=False)
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    logits: Tensor | None = field(default=None, repr=False)
    labels: Tensor | None = field(default=None, repr=False)
    calibrated: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def best_result(self) -> MethodResult | None:
        return next((m for m in self.methods if m.method == self.best), None)

    def to_dict(self) -> dict[str, Any]:
        """The numbers, JSON-ready (no tensors); ``options`` are the methods' constructor options."""
        skip = {"calibrator", "method_options", "logits", "labels", "calibrated"}
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        data |= {"raw": asdict(self.raw), "methods": [asdict(m) for m in self.methods]}
        return data | {"options": self.method_options}

    def table(self) -> str:
        """The aligned text report printed by the command line."""
        return "\n".join(_header(self) + _raw_section(self) + _methods_section(self) + _verdict(self))

    def save(self, folder: str | Path, figures: bool = True, progress: bool = False) -> list[Path]:
        """Write report.txt/.json/.csv, the winning calibrator (calibrator.pt) and PNG figures
        (top-label reliability of every method; per-class reliability and Bayes-risk curves of
        the raw and the best posteriors). ``progress`` shows a bar while the figures render."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / "report.txt", folder / "report.json", folder / "report.csv"]
        written[0].write_text(self.table() + "\n")
        written[1].write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        written[2].write_text(self.csv())
        if self.calibrator is not None and self.best is not None:
            written.append(save_calibrator(folder / "calibrator.pt", self.best, self.calibrator,
                                           self.method_options.get(self.best, {})))
        if figures and self.logits is not None:
            written += self._figures(folder, progress)
        return written

    def csv(self) -> str:
        """One row per system (raw, then each method) with every metric and interval."""
        header = ["system", "nce", "nce_lower", "nce_upper", "nbs", "nbs_lower", "nbs_upper",
                  "error_rate", "error_rate_lower", "error_rate_upper", "nec", "nec_lower", "nec_upper",
                  "ece_percent", "ecd", "calibration_loss_nce", "rcl_percent", "rcl_brier_percent"]
        rows = [_csv_row("raw", self.raw, None)] + [_csv_row(m.method, m.quality, m) for m in self.methods]
        return "\n".join(",".join(map(str, row)) for row in [header, *rows]) + "\n"

    def _figures(self, folder: Path, progress: bool) -> list[Path]:
        from torchcal import plots

        systems = {"raw": self.logits} | self.calibrated
        best = {"raw": self.logits} | ({self.best: self.calibrated[self.best]} if self.best else {})
        drawings = {
            "reliability_top_label.png": lambda: plots.reliability_diagram(systems, self.labels),
            "reliability_per_class.png": lambda: plots.classwise_reliability(best, self.labels),
            "bayes_risk.png": lambda: plots.bayes_risk_curves(best, self.labels, priors=self._priors_tensor()),
        }
        written = []
        for name, draw in tqdm(drawings.items(), desc="figures", disable=None if progress else True, leave=False):
            fig, _ = draw()
            fig.savefig(folder / name, dpi=110)
            plots.pyplot().close(fig)
            written.append(folder / name)
        return written

    def _priors_tensor(self) -> Tensor | None:
        return None if self.priors is None else torch.tensor(self.priors, dtype=torch.float64)


def _header(r: Report) -> list[str]:
    priors = "class frequencies of the data" if r.priors is None else ", ".join(f"{p:.3g}" for p in r.priors)
    return [
        f"torchcal evaluate: {r.source}",
        f"  {r.num_samples} samples, {r.num_classes} classes; scores read as {r.read_as}",
        f"  priors: {priors}; costs: {r.costs_name}",
        "",
    ]


def _raw_section(r: Report) -> list[str]:
    title = "1. Raw posteriors" + (f" (95 % bootstrap intervals, {r.bootstrap} replicates)" if r.bootstrap else "")
    rows = [("NCE", r.raw.nce), ("NBS", r.raw.nbs), ("error rate", r.raw.error_rate), (f"NEC ({r.costs_name})", r.raw.nec)]
    lines = [title]
    for name, e in rows:
        interval = "" if e.lower is None else f"  [{e.lower:.3f}, {e.upper:.3f}]"
        lines.append(f"   {name:<{max(len(n) for n, _ in rows)}}  {e.value:.3f}{interval}")
    return [*lines, f"   ECE {r.raw.ece:.1f} %, ECD {r.raw.ecd:+.3f} (diagnostics; ECD > 0: over-confident)", ""]


def _methods_section(r: Report) -> list[str]:
    if not r.methods:
        return []
    header = ["system", "NCE", "NBS", "error", "NEC", "CalLoss", "RCL %", "RCL-BS %", "ECE %", "ECD"]
    rows = [["raw", *_scores_cells(r.raw), "", "", "", *_diagnostic_cells(r.raw)]]
    for m in r.methods:
        losses = [f"{m.calibration_loss:.3f}", f"{m.relative_calibration_loss:.1f}", f"{m.relative_calibration_loss_brier:.1f}"]
        rows.append([m.method, *_scores_cells(m.quality), *losses, *_diagnostic_cells(m.quality)])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "   " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [f"2. Calibration: {r.protocol}", line(header)] + [line(row) for row in rows] + [""]


def _scores_cells(q: Quality) -> list[str]:
    return [f"{q.nce.value:.3f}", f"{q.nbs.value:.3f}", f"{q.error_rate.value:.3f}", f"{q.nec.value:.3f}"]


def _diagnostic_cells(q: Quality) -> list[str]:
    return [f"{q.ece:.1f}", f"{q.ecd:+.3f}"]


def _verdict(r: Report) -> list[str]:
    best = r.best_result
    if best is None:
        return []
    change = f"NCE {r.raw.nce.value:.3f} -> {best.quality.nce.value:.3f}"
    if best.relative_calibration_loss <= 0:
        return [f"3. No method improves the raw posteriors ({best.method}: {change}, RCL "
                f"{best.relative_calibration_loss:.1f} %): calibration would not help."]
    return [f"3. Best: {best.method}, {change}: RCL {best.relative_calibration_loss:.1f} % of the raw "
            f"cross-entropy is miscalibration that {best.method} removes."]


def _csv_row(name: str, q: Quality, m: MethodResult | None) -> list[Any]:
    def triple(e: Estimate) -> list[Any]:
        return [e.value, "" if e.lower is None else e.lower, "" if e.upper is None else e.upper]

    losses = ["", "", ""] if m is None else [m.calibration_loss, m.relative_calibration_loss,
                                             m.relative_calibration_loss_brier]
    return [name, *triple(q.nce), *triple(q.nbs), *triple(q.error_rate), *triple(q.nec), q.ece, q.ecd, *losses]


# --- the workflow ----------------------------------------------------------------------------------

def evaluate(
    scores: Scores | tuple[Tensor, Tensor],
    methods: Sequence[str] = ("temperature", "affine"),
    *,
    calibration: Scores | tuple[Tensor, Tensor] | None = None,
    folds: int = 5,
    priors: Tensor | None = None,
    costs: Tensor | None = None,
    costs_name: str | None = None,
    bootstrap: int = 1000,
    seed: int = 0,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool = False,
) -> Report:
    """Measure the raw posteriors, calibrate them with each method, and pick the best.

    Args:
        scores: the evaluated data, a :class:`~torchcal.data.Scores` or ``(logits (N, K), labels (N,))``.
        methods: names from :data:`METHODS`.
        calibration: separate calibration data (held-out). If omitted, each method is
            evaluated by ``folds``-fold stratified cross-validation on ``scores``: every sample is
            calibrated by a model fitted on the other folds.
        folds: cross-validation folds (ignored with ``calibration``).
        priors: (K,) deployment priors for every metric and fit (default: the class frequencies).
        costs: (K, M) cost matrix of the Bayes risk (default: 0-1 costs).
        costs_name: how to call the cost matrix in the report.
        bootstrap: bootstrap replicates for the intervals (0: none). Intervals are given for the
            raw metrics, and for calibrated ones when the calibrator is fixed (held-out data); with
            cross-validation the calibrator would have to be refitted per replicate
            (Ferrer & Ramos, App. E), so calibrated metrics carry no interval.
        seed: seed of the folds and of the bootstrap.
        method_options: constructor options per method, e.g. ``{"dirichlet-odir": {"reg_grid": [...]}}``.
        progress: show a tqdm progress bar.

    Returns:
        a :class:`Report`; ``report.calibrator`` is the winning method refitted on all calibration
        data (the calibration set, or all of ``scores`` with cross-validation).
    """
    logits, labels, source, read_as = _unpack(scores, "scores")
    num_classes = logits.shape[1]
    methods = list(dict.fromkeys(methods))
    method_options = {name: dict(opts) for name, opts in (method_options or {}).items()}
    for method in methods:  # fail early on bad names, options or class counts
        supported = make_calibrator(method, **method_options.get(method, {})).supported_num_classes
        if supported is not None and supported != num_classes:
            raise ValueError(f"method {method!r} is for K = {supported} classes, but the scores have K = {num_classes}.")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise ValueError(f"bootstrap must be a number of replicates >= 0, got {bootstrap!r}.")
    if calibration is None and folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}.")
    if priors is not None:
        priors = check_priors(priors, num_classes)
    costs = zero_one_costs(num_classes) if costs is None else check_costs(costs, num_classes)
    if calibration is not None:
        cal_logits, cal_labels, cal_source, _ = _unpack(calibration, "calibration scores")
        if cal_logits.shape[1] != num_classes:
            raise ValueError(f"the calibration scores have K = {cal_logits.shape[1]} classes, the evaluated scores K = {num_classes}.")
        protocol = f"fitted on separate calibration data ({cal_source}, N = {cal_logits.shape[0]})"
    else:
        cal_logits, cal_labels = logits, labels
        protocol = (f"{folds}-fold stratified cross-validation on the evaluated data (each sample "
                    f"calibrated by a model fitted on the other folds)")

    metrics = _Metrics(labels, priors, costs, bootstrap, seed)
    steps = 1 + len(methods)
    with tqdm(total=steps, disable=None if progress else True, desc="torchcal", unit="step", leave=False) as bar:
        bar.set_postfix_str("raw posteriors" + (f", bootstrap x{bootstrap}" if bootstrap else ""))
        raw = metrics.quality(logits, with_intervals=True)
        bar.update()
        results, fitted, calibrated = [], {}, {}
        for method in methods:
            bar.set_postfix_str(f"{method}: " + ("fitting" if calibration is not None else f"{folds}-fold CV"))
            start = time.perf_counter()
            options = method_options.get(method, {})
            model = make_calibrator(method, **options).fit(cal_logits, cal_labels, priors=priors).requires_grad_(False)
            with torch.no_grad():
                if calibration is not None:
                    out = model(logits)
                else:
                    out = cross_validate(make_calibrator(method, **options), logits, labels, folds=folds,
                                         seed=seed, priors=priors)
            quality = metrics.quality(out, with_intervals=calibration is not None)
            results.append(_method_result(method, raw, quality, model, logits, out, labels, priors,
                                          time.perf_counter() - start))
            fitted[method], calibrated[method] = model, out.detach()
            bar.update()
    best = min(results, key=lambda r: r.quality.nce.value).method if results else None
    is_zero_one = costs.shape == (num_classes, num_classes) and torch.equal(costs, zero_one_costs(num_classes))
    return Report(
        source=source, read_as=read_as, num_samples=logits.shape[0], num_classes=num_classes,
        protocol=protocol, priors=None if priors is None else priors.tolist(),
        costs_name=costs_name or ("0-1" if is_zero_one else "custom"),
        costs=None if is_zero_one else costs.tolist(), bootstrap=bootstrap, raw=raw, methods=results, best=best,
        calibrator=fitted.get(best), method_options={m: method_options.get(m, {}) for m in methods},
        logits=logits, labels=labels, calibrated=calibrated,
    )


def _unpack(scores: Scores | tuple[Tensor, Tensor], name: str) -> tuple[Tensor, Tensor, str, str]:
    if isinstance(scores, Scores):
        if scores.labels is None:
            raise ValueError(f"{scores.source}: evaluating needs labels.")
        return scores.logits, scores.labels, scores.source, scores.read_as
    logits, labels = check_logits_and_labels(*scores)
    return logits, labels, "in-memory tensors", "logits"


class _Metrics:
    """The metrics of :class:`Quality`, with the evaluation's priors, costs and bootstrap."""

    def __init__(self, labels: Tensor, priors: Tensor | None, costs: Tensor, replicates: int, seed: int):
        self.labels, self.priors, self.costs = labels, priors, costs
        self.replicates, self.seed = replicates, seed

    def quality(self, logits: Tensor, with_intervals: bool) -> Quality:
        p = self.priors
        return Quality(
            nce=self._estimate(cross_entropy, logits, with_intervals, priors=p, normalize=True),
            nbs=self._estimate(brier_score, logits, with_intervals, priors=p, normalize=True),
            error_rate=self._estimate(error_rate, logits, with_intervals),
            nec=self._estimate(bayes_risk, logits, with_intervals, costs=self.costs, priors=p, normalize=True),
            ece=100 * float(expected_calibration_error(logits, self.labels, n_bins=ECE_BINS)),
            ecd=float(entropic_calibration_difference(logits, self.labels)),
        )

    def _estimate(self, metric: Callable[..., Tensor], logits: Tensor, with_interval: bool, **kwargs: Any) -> Estimate:
        if not (with_interval and self.replicates):
            return Estimate(float(metric(logits, self.labels, **kwargs)))
        result = bootstrap_metric(metric, logits, self.labels, num_replicates=self.replicates, seed=self.seed, **kwargs)
        return Estimate(float(result.estimate), float(result.lower), float(result.upper))


def _method_result(method: str, raw: Quality, quality: Quality, model: Calibrator, raw_logits: Tensor,
                   calibrated: Tensor, labels: Tensor, priors: Tensor | None, seconds: float) -> MethodResult:
    nce = partial(cross_entropy, normalize=True)
    nbs = partial(brier_score, normalize=True)
    absolute, relative = calibration_loss(raw_logits, calibrated, labels, score=nce, priors=priors)
    _, relative_brier = calibration_loss(raw_logits, calibrated, labels, score=nbs, priors=priors)
    return MethodResult(method, quality, float(absolute), float(relative), float(relative_brier),
                        _parameters(model), seconds)


def _parameters(model: Calibrator, max_size: int = 20) -> dict[str, Any]:
    """Small fitted tensors as lists (larger ones by shape), plus selected regularisation."""
    summary: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, Tensor):
            summary[name] = tensor.tolist() if tensor.numel() <= max_size else f"tensor of shape {list(tensor.shape)}"
    for name in ("temperature", "alpha", "reg_lambda_", "reg_mu_"):
        value = getattr(model, name, None)
        if isinstance(value, (int, float)):
            summary[name.rstrip("_")] = value
    return summary


# --- fitted calibrators on disk --------------------------------------------------------------------

_FORMAT = "torchcal-calibrator/1"


def save_calibrator(
    path: str | Path, method: str, calibrator: Calibrator, options: Mapping[str, Any] | None = None,
    label_shift: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Save a fitted calibrator with what is needed to rebuild it: ``torch.save`` of a dict with the
    method name, its constructor options and the ``state_dict``; ``label_shift``, if given (the
    ``source_priors``, estimated ``target_priors`` and their ``stderr``), under that key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if label_shift is None else {"label_shift": dict(label_shift)}
    torch.save({"format": _FORMAT, "method": method, "options": dict(options or {}),
                "state_dict": calibrator.state_dict(), **extra}, path)
    return path


def load_calibrator(path: str | Path) -> tuple[str, Calibrator]:
    """Rebuild a calibrator written by :func:`save_calibrator`; returns ``(method, calibrator)``,
    the calibrator frozen for inference (``eval()``, no gradients)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a bad file
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many exception types for a bad file
        raise ValueError(f"{path}: not a readable torch file ({type(err).__name__}).") from None
    if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
        raise ValueError(f"{path}: not a calibrator saved by torchcal (torchcal calibrate --save).")
    calibrator = make_calibrator(saved["method"], **saved["options"])
    calibrator.load_state_dict(saved["state_dict"])
    return saved["method"], calibrator.eval().requires_grad_(False)
