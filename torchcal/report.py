"""The diagnose-and-fix workflow: how good are the posteriors, how much of their loss is
miscalibration, and which calibration stage removes it (Ferrer & Ramos; the CalibrationTutorial).

:func:`evaluate` measures the raw posteriors with expected proper scoring rules (normalised
cross-entropy NCE, normalised Brier NBS), the error rate and the normalised Bayes risk (NEC) for a
cost matrix, with percentile-bootstrap intervals. It then fits every requested calibrator on data
other than the samples it scores -- a separate calibration set, or cross-validation on the
evaluated set -- and reports the same metrics after calibration, the calibration loss (absolute,
in NCE units, and relative, in %) and ECE/ECD as diagnostics. The method with the lowest calibrated
NCE wins, unless temperature scaling was also run and the winner is not significantly better than
it (the paired-bootstrap interval of their NCE difference contains 0) and temperature scaling
itself improves the raw posteriors: then the simpler temperature scaling is kept, and the report
says so. Under cross-validation the interval of the fixed out-of-fold outputs leaves out how the
calibrators vary with their training data, which Ferrer & Ramos ask to include (App. E) by
refitting them in each replicate: refitted intervals were up to twice as wide on the real logits.
So a difference whose fixed interval excludes 0 by less than its half-width (its upper end above
half the difference) is checked again by replicates that refit both calibrators; a clearer one
stands, and one whose interval holds 0 is not significant either way. The winner is refitted on
all the calibration data and returned for reuse. The diagnostics (ECE, ECD, smooth ECE, the
calibration test) describe the samples at their own class frequencies; the scores and the fits
use the given priors.

Long runs show a progress bar counting fits (every fold of every method), refreshed every second;
a method's repeated solver warnings are collapsed into one line that names it.

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

import contextlib
import copy
import inspect
import json
import math
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
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
    QuadraticScaling,
    StructuredMatrixScaling,
    StructuredVectorScaling,
    TemperatureScaling,
    VectorScaling,
    VennAbersCalibration,
    cross_validate,
)
from torchcal._validation import check_costs, check_logits_and_labels, check_priors, stacklevel_outside_package
from torchcal.data import Scores
from torchcal.data.loading import ROUNDED_READ_AS_LOGITS
from torchcal.fit import ConvergenceWarning, FitRecord, content_keys, order_by_content, shared_samples
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
from torchcal.functional.bootstrap import normalised_resampling_is_stratified
from torchcal.functional.consistency_resampling import consistency_resampling_test
from torchcal.functional.decisions import is_zero_one_costs
from torchcal.functional.detection import cllr, equal_error_rate, min_cllr
from torchcal.functional.scoring import (
    class_frequencies,
    class_sums,
    log_loss_per_sample,
    naive_cross_entropy,
    prior_weighted_mean,
    to_log_probs,
)
from torchcal.functional.smooth_ece import smooth_calibration_error

__all__ = [
    "METHODS",
    "Estimate",
    "MethodResult",
    "Quality",
    "Report",
    "SavedCalibrator",
    "check_read_alike",
    "evaluate",
    "fit_calibrator",
    "load_calibrator",
    "load_label_shift",
    "load_llr_priors",
    "load_saved_calibrator",
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
    "svs": StructuredVectorScaling,
    "sms": StructuredMatrixScaling,
    "platt": PlattScaling,
    "quadratic": QuadraticScaling,
    "beta": BetaCalibration,
    "histogram": HistogramBinning,
    "isotonic": IsotonicCalibration,
    "venn-abers": VennAbersCalibration,
}

ECE_BINS = 15
#: Bootstrap replicates that refit both cross-validated calibrators to confirm a narrowly
#: significant NCE difference from temperature scaling (each costs two cross-validations; Ferrer &
#: Ramos use 100 for a figure); their standard deviation makes a normal interval, as their
#: percentiles would be their extremes.
REFITTED_REPLICATES = 20
#: Label resamples of the calibration test in the report (p-values in steps of 1/200, the smallest 0.005).
CALIBRATION_TEST_RESAMPLES = 199
_TEXT_FILES = ("report.txt", "report.json", "report.csv")
#: The shares of evaluated samples with scores of their own from which all of them found in the
#: calibration data beyond chance are refused, and some of them warned of (:func:`_check_held_out`).
_MOSTLY_DISTINCT_SCORES = 0.9
_DISTINCT_SCORES = 0.99
#: Every name :meth:`Report.save` may write: the files :meth:`Report.stale_files` may name for removal.
REPORT_FILES = (*_TEXT_FILES, "calibrator.pt", "reliability_top_label.png", "reliability_smooth.png",
                "reliability_per_class.png", "bayes_risk.png", "det.png")


def make_calibrator(method: str, **options: Any) -> Calibrator:
    """A fresh calibrator for a method name of :data:`METHODS`, with constructor ``options``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}.")
    make = METHODS[method]
    # (the constructor's own TypeError can name a parent class: MatrixScaling for dirichlet-odir)
    parameters = inspect.signature(make).parameters
    accepted = [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    unknown = [] if takes_any else [name for name in options if name not in accepted]
    if unknown:
        built = getattr(make, "func", make)
        raise ValueError(f"bad options for method {method!r} ({getattr(built, '__name__', built)}): unknown "
                         f"{', '.join(map(repr, unknown))}; it takes {', '.join(accepted) or 'none'}.")
    try:
        return make(**options)
    except TypeError as err:
        raise ValueError(f"bad options for method {method!r}: {err}.") from None


def _seeded(method: str, seed: int) -> dict[str, int]:
    """``{"cv_seed": seed}`` for a method whose calibrator cross-validates with a seed of its own
    (none for the calibrators' default seed, 0)."""
    return {"cv_seed": seed} if seed and "cv_seed" in inspect.signature(METHODS[method]).parameters else {}


def fit_calibrator(method: str, options: Mapping[str, Any], logits: Tensor, labels: Tensor, *,
                   priors: Tensor | None = None) -> Calibrator:
    """A calibrator of ``method`` with ``options`` fitted on ``logits: (N, K)``, ``labels: (N,)``,
    frozen for inference; its solver warnings come as one line that names it."""
    with _solver_warnings(method, fits=1):
        return make_calibrator(method, **options).fit(logits, labels, priors=priors).requires_grad_(False)


@contextlib.contextmanager
def _solver_warnings(what: str, fits: int) -> Iterator[None]:
    """Issue each distinct warning of the block once, naming ``what`` was fitted; the
    ConvergenceWarnings of its ``fits`` fits become one line that says what to do."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    stopped = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    if stopped:
        simpler = {"temperature": [], "vector": ["temperature"]}.get(what.split()[0], ["temperature", "vector"])
        advice = (f"A simpler method ({', '.join(simpler)}) or a" if simpler else "A") + " stronger regulariser"
        warnings.warn(
            f"{what}: {len(stopped)} convergence warning{'s' * (len(stopped) > 1)} in {fits} fit{'s' * (fits > 1)} (first: "
            f"{stopped[0]}); its numbers come from where the solver stopped. {advice} (method options, e.g. "
            f"reg_lambda in a --config file) usually converges; the final fit's fit_record_ (saved with the calibrator) "
            f"says where it stopped.",
            ConvergenceWarning,
            stacklevel=3,
        )
    # The others once per kind: the folds' fits of a small data set each warned of their own missing
    # classes (34 lines for four methods on 300 CIFAR-100 rows, 75 for six)
    kinds: dict[tuple[type[Warning], str], list[str]] = {}
    for w in caught:
        if not issubclass(w.category, ConvergenceWarning):
            kinds.setdefault((w.category, re.sub(r"\[[^\]]*\]", "[...]", str(w.message))), []).append(str(w.message))
    for (category, _), messages in kinds.items():
        others = len(set(messages)) - 1
        more = f"; {others} more like it with other classes" if others else ""
        warnings.warn(f"{messages[0]} ({what}{f', {len(messages)} times' if len(messages) > 1 else ''}{more})", category, stacklevel=3)


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
    ``error_rate`` (prior-weighted under the evaluation's priors, as are NCE, NBS, NEC, the
    cross-entropy and the Brier score); ``nec``: normalised expected cost of the Bayes decisions for the cost matrix;
    ``ece``: top-label ECE in %, 15 equal-width bins; ``ecd``: entropic calibration difference
    (> 0 over-confident, < 0 under-confident); ``cross_entropy`` (nats) and ``brier`` (summed
    over classes, 0 to 2) unnormalised, in the units papers report; ``smooth_ece``: top-label smooth
    ECE in %; ``calibration_p_value``: p-value of the consistency-resampling test of calibration with
    the top-label ECE (small: the posteriors are not calibrated). The diagnostics (ECE, ECD, smooth
    ECE, the test) describe the samples as they are, not reweighted to the priors; for K = 2 only, ``cllr`` and
    ``min_cllr`` in bits and the ROC-convex-hull ``eer`` in % (else None).
    """

    nce: Estimate
    nbs: Estimate
    error_rate: Estimate
    nec: Estimate
    ece: float
    ecd: float
    cross_entropy: float
    brier: float
    smooth_ece: float = float("nan")
    calibration_p_value: float = float("nan")
    cllr: float | None = None
    min_cllr: float | None = None
    eer: float | None = None


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

    ``costs`` is None for 0-1 costs. ``lowest`` is the method with the lowest NCE and
    ``lowest_vs_temperature`` its NCE minus temperature scaling's with the paired-bootstrap
    interval, when both were run and differ (``best`` is then temperature unless the difference is
    significant); ``lowest_vs_temperature_refits`` is the number of replicates that refitted both
    calibrators for that interval (0: the calibrators' outputs were held fixed). The last fields
    hold tensors for notebooks and figures and are left out of :meth:`to_dict`: the winning
    ``calibrator`` (fitted on all calibration data), the evaluated ``logits``/``labels``, each
    method's ``calibrated`` log-posteriors, and ``llr_priors``, the priors that turned the binary
    LLRs the calibrator was fitted on into posteriors (saved with it).
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
    lowest: str | None = None
    lowest_vs_temperature: Estimate | None = None
    lowest_vs_temperature_refits: int = 0
    calibrator: Calibrator | None = field(default=None, repr=False)
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    logits: Tensor | None = field(default=None, repr=False)
    labels: Tensor | None = field(default=None, repr=False)
    calibrated: dict[str, Tensor] = field(default_factory=dict, repr=False)
    llr_priors: Tensor | None = field(default=None, repr=False)

    @property
    def best_result(self) -> MethodResult | None:
        return next((m for m in self.methods if m.method == self.best), None)

    def to_dict(self) -> dict[str, Any]:
        """The numbers, JSON-ready (no tensors); ``options`` are the methods' constructor options."""
        skip = {"calibrator", "method_options", "logits", "labels", "calibrated", "llr_priors"}
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        data |= {"raw": asdict(self.raw), "methods": [asdict(m) for m in self.methods]}
        if self.lowest_vs_temperature is not None:
            data["lowest_vs_temperature"] = asdict(self.lowest_vs_temperature)
        return data | {"options": self.method_options}

    def table(self) -> str:
        """The aligned text report printed by the command line."""
        return "\n".join(_header(self) + _raw_section(self) + _methods_section(self) + _legend(self) + _verdict(self))

    def save(self, folder: str | Path, figures: bool = True, progress: bool = False, input_kind: str | None = None) -> list[Path]:
        """Write report.txt/.json/.csv, the winning calibrator (calibrator.pt, with its ``llr_priors``) and PNG figures
        (top-label reliability of every method; the smoothed and per-class reliability diagrams,
        the Bayes-risk curves and, for K = 2, the DET plot of the raw and the best posteriors).
        ``progress`` shows a bar while the figures render; ``input_kind``: how new scores are to be
        read (the command line's ``--input``, or ``"probs"`` where the fit's were detected as
        probabilities), saved with the calibrator (:func:`save_calibrator`). In report.json an undefined number (NaN, e.g. the relative
        calibration loss of a perfect raw system) is ``null``. Returns the paths written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / name for name in _TEXT_FILES]
        written[0].write_text(self.table() + "\n")
        written[1].write_text(json.dumps(_json_ready(self.to_dict()), indent=2, allow_nan=False) + "\n")
        written[2].write_text(self.csv())
        if self.calibrator is not None and self.best is not None:
            written.append(save_calibrator(folder / "calibrator.pt", self.best, self.calibrator,
                                           self.method_options.get(self.best, {}), llr_priors=self.llr_priors,
                                           input_kind=input_kind))
        if figures and self.logits is not None:
            written += self._figures(folder, progress)
        return written

    def stale_files(self, folder: str | Path, figures: bool = True) -> list[Path]:
        """The files of an earlier report in ``folder`` (by the names in :data:`REPORT_FILES`, no
        others) that :meth:`save` with these arguments would leave beside the new one."""
        keep = set(self._file_names(figures))
        return [p for p in (Path(folder) / name for name in REPORT_FILES if name not in keep) if p.is_file()]

    def _file_names(self, figures: bool) -> list[str]:
        """The names :meth:`save` writes, in order."""
        names = [*_TEXT_FILES, *(["calibrator.pt"] if self.calibrator is not None and self.best is not None else [])]
        return names + (list(self._drawings()) if figures and self.logits is not None else [])

    def csv(self) -> str:
        """One row per system (raw, then each method) with every metric and interval."""
        header = ["system", "nce", "nce_lower", "nce_upper", "nbs", "nbs_lower", "nbs_upper",
                  "error_rate", "error_rate_lower", "error_rate_upper", "nec", "nec_lower", "nec_upper",
                  "ece_percent", "ecd", "calibration_loss_nce", "rcl_percent", "rcl_brier_percent",
                  "cross_entropy_nats", "brier",
                  "smooth_ece_percent", "calibration_p_value", "cllr", "min_cllr", "eer_percent"]
        rows = [_csv_row("raw", self.raw, None)] + [_csv_row(m.method, m.quality, m) for m in self.methods]
        return "\n".join(",".join(map(str, row)) for row in [header, *rows]) + "\n"

    def _drawings(self) -> dict[str, Callable[[], tuple[Any, Any]]]:
        """The figures by file name, each drawn when called."""
        from torchcal import plots

        logits, labels = self.logits, self.labels
        assert logits is not None and labels is not None  # save() draws only then
        systems = {"raw": logits} | self.calibrated
        best = {"raw": logits} | ({self.best: self.calibrated[self.best]} if self.best else {})
        drawings = {
            "reliability_top_label.png": lambda: plots.reliability_diagram(systems, labels, intervals="clopper-pearson"),
            "reliability_smooth.png": lambda: plots.smooth_reliability_diagram(best, labels),
            "reliability_per_class.png": lambda: plots.classwise_reliability(best, labels),
            "bayes_risk.png": lambda: plots.bayes_risk_curves(best, labels, priors=self._priors_tensor()),
        }
        if self.num_classes == 2:
            drawings["det.png"] = lambda: plots.det_plot(best, labels)
        return drawings

    def _figures(self, folder: Path, progress: bool) -> list[Path]:
        from torchcal import plots

        written = []
        bar = tqdm(self._drawings().items(), desc="figures", disable=None if progress else True, leave=False)
        for name, draw in bar:
            if progress and bar.disable:  # no bar on a non-terminal: a line per figure
                print(f"torchcal: drawing {name}", file=sys.stderr, flush=True)
            fig, _ = draw()
            fig.savefig(folder / name, dpi=110)
            plots.pyplot().close(fig)
            written.append(folder / name)
        return written

    def _priors_tensor(self) -> Tensor | None:
        return None if self.priors is None else torch.tensor(self.priors, dtype=torch.float64)


def _plain(value: Any) -> Any:
    """``value`` with NumPy numbers and arrays and tensors (a method's options, such as
    ``reg_grid=np.logspace(...)``) as Python numbers and lists, which JSON and
    ``torch.load(weights_only=True)`` take."""
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):  # ((lambda, mu) pairs stay pairs)
        return tuple(_plain(item) for item in value)
    return value


def _json_ready(value: Any) -> Any:
    """``value`` as :func:`_plain` makes it, with every float that is not finite as None: JSON has
    no NaN (``json.dumps`` writes a bare ``NaN``, which strict parsers refuse)."""

    def finite_or_none(item: Any) -> Any:
        if isinstance(item, float):
            return item if math.isfinite(item) else None
        if isinstance(item, dict):
            return {key: finite_or_none(part) for key, part in item.items()}
        if isinstance(item, (list, tuple)):
            return [finite_or_none(part) for part in item]
        return item

    return finite_or_none(_plain(value))  # (converted once, not at every level)


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
    lines += [
        f"   cross-entropy {r.raw.cross_entropy:.4f} nats, Brier {r.raw.brier:.4f} (summed over classes, 0-2): "
        f"unnormalised, as papers report them",
        f"   ECE {r.raw.ece:.2f} % (top label, {ECE_BINS} equal-width bins), smooth ECE {r.raw.smooth_ece:.2f} %, "
        f"ECD {r.raw.ecd:+.3f} (diagnostics; ECD > 0: over-confident)",
        f"   calibration test (ECE, label resampling): p = {r.raw.calibration_p_value:.3g}",
    ]
    if r.raw.cllr is not None:
        lines.append(f"   Cllr {r.raw.cllr:.3f} bits, minCllr {r.raw.min_cllr:.3f} bits, EER {r.raw.eer:.2f} % (detection)")
    return [*lines, ""]


def _methods_section(r: Report) -> list[str]:
    if not r.methods:
        return []
    header = ["system", "NCE", "NBS", "error", "NEC", "CalLoss", "RCL %", "RCL-BS %", "ECE %", "smECE %", "ECD", "p cal"]
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
    return [f"{q.ece:.1f}", f"{q.smooth_ece:.1f}", f"{q.ecd:+.3f}", f"{q.calibration_p_value:.3g}"]


def _legend(r: Report) -> list[str]:
    if not r.methods:
        return []
    return [
        "   NCE, NBS: cross-entropy and Brier score divided by those of a system that always outputs the priors",
        "     (1: no better than the priors; lower is better). NEC: expected cost of the Bayes decisions divided",
        "     by that of the best decision made without looking at the input. CalLoss: NCE(raw) - NCE(calibrated),",
        "     the part of the raw cross-entropy that the method removes; RCL: CalLoss in % of NCE(raw) (RCL-BS: the",
        f"     same with NBS). ECE: top-label expected calibration error, {ECE_BINS} bins, in %; smECE: smooth ECE",
        "     (kernel-smoothed, no bins), in %. ECD > 0: over-confident. p cal: p-value of a test of calibration",
        "     (label resampling, ECE); small means miscalibrated.",
        *([] if r.priors is None else [
            "     Under the given priors NCE, NBS, error, NEC, the cross-entropy and the Brier score weigh each class's",
            "     samples to its prior; ECE, smECE, ECD and p cal do not (they describe the samples at the data's own",
            "     class frequencies).",
        ]),
        "",
    ]


def _verdict(r: Report) -> list[str]:
    best = r.best_result
    if best is None:
        return []
    change = f"NCE {r.raw.nce.value:.3f} -> {best.quality.nce.value:.3f}"
    lines = []
    if r.lowest_vs_temperature is not None and r.best != r.lowest:
        d = r.lowest_vs_temperature
        lines.append(f"3. Lowest NCE: {r.lowest}, but not significantly better than temperature (NCE difference "
                     f"{d.value:+.4f}, {_interval_name(r)} [{d.lower:+.4f}, {d.upper:+.4f}] contains 0):")
        lines.append("   keeping temperature scaling, the simpler method (one parameter).")
        prefix = "   "
    else:
        prefix = "3. "
    if not best.calibration_loss > 0:  # (the absolute loss: the relative one is NaN for a perfect raw system)
        return [*lines, f"{prefix}No method improves the raw posteriors ({best.method}: {change}, RCL "
                        f"{best.relative_calibration_loss:.1f} %): calibration would not help."]
    significance = ""
    if r.lowest_vs_temperature is not None and r.best == r.lowest:
        d = r.lowest_vs_temperature
        interval = f"NCE difference {d.value:+.4f}, {_interval_name(r)} [{d.lower:+.4f}, {d.upper:+.4f}]"
        significance = (f" It beats temperature significantly ({interval})." if d.upper is not None and d.upper < 0 else
                        f" It is not significantly better than temperature ({interval}), which does not improve the raw "
                        f"posteriors.")
    return [*lines, f"{prefix}Best: {best.method}, {change}: RCL {best.relative_calibration_loss:.1f} % of the raw "
                    f"cross-entropy is miscalibration that {best.method} removes.{significance}"]


def _interval_name(r: Report) -> str:
    refits = r.lowest_vs_temperature_refits
    return (f"95 % paired-bootstrap interval of {refits} replicates refitting both calibrators" if refits else
            "95 % paired-bootstrap interval")


def _csv_row(name: str, q: Quality, m: MethodResult | None) -> list[Any]:
    def triple(e: Estimate) -> list[Any]:
        return [e.value, "" if e.lower is None else e.lower, "" if e.upper is None else e.upper]

    losses = ["", "", ""] if m is None else [m.calibration_loss, m.relative_calibration_loss,
                                             m.relative_calibration_loss_brier]
    detection = ["" if v is None else v for v in (q.cllr, q.min_cllr, q.eer)]
    return [name, *triple(q.nce), *triple(q.nbs), *triple(q.error_rate), *triple(q.nec), q.ece, q.ecd, *losses,
            q.cross_entropy, q.brier, q.smooth_ece, q.calibration_p_value, *detection]


# --- the workflow ----------------------------------------------------------------------------------

def _same_rows_in_any_order(logits: Tensor, labels: Tensor, cal_logits: Tensor, cal_labels: Tensor) -> bool:
    """Whether the calibration data are the evaluated data with the rows perhaps reordered: the
    same multiset of (label, scores) rows (rows equal bit for bit)."""
    if cal_logits.shape != logits.shape or cal_logits.dtype != logits.dtype:
        return False
    labels, cal_labels = labels.cpu(), cal_labels.cpu()
    mine, theirs = order_by_content(logits, labels), order_by_content(cal_logits, cal_labels)
    return torch.equal(labels[mine], cal_labels[theirs]) and torch.equal(logits.cpu()[mine], cal_logits.cpu()[theirs])


def _check_held_out(logits: Tensor, labels: Tensor, cal_logits: Tensor, cal_labels: Tensor) -> None:
    """Refuse calibration data that are the evaluated data, and warn of calibration data that hold
    some of the evaluated samples: a calibrator is never scored on the samples it was fitted on
    (Ferrer & Ramos; the evaluated file given as its own calibration data raised the affine RCL of
    CIFAR-10 ResNet-20 from 17.28 % by cross-validation to 17.65 %).

    The evaluated data given again, in any row order, are refused. Otherwise samples count as the
    same where :func:`~torchcal.fit.shared_samples` finds them (their labels agree, their
    log-posteriors within round-off), which tells samples apart only where the scores do, and the
    matches are weighed against chance: a calibration sample of class k has a twin within
    round-off among the other calibration samples of its class with probability ``c_k`` (17 % for
    20,000 binary float32 log-posteriors of FVCAUS, where 852 of 5,000 disjoint samples matched
    one), so ``sum_k n_k c_k`` of the evaluated samples are expected to match by chance, give or
    take its binomial standard deviation. All of them matching beyond 4 standard deviations (and
    one sample) above that is refused where at least ``_MOSTLY_DISTINCT_SCORES`` of the evaluated
    samples have scores of their own (10,000 FVCAUS trials, 98.7 % distinct, given again inside
    their calibration data had gone through below 99 %); some of them are warned of from
    ``_DISTINCT_SCORES``. Among more ties, samples of one score match or miss together, which the
    binomial spread leaves out (FVCAUS rounded to two decimals: a disjoint split, 108,368 matching
    where 108,347 were expected, was refused on a spread of 4.6), and weighing each cluster of equal
    scores by its size overshot tenfold (complete leaks went through); and the twin share of a small
    calibration set misjudges chance (94 SST-2 trials of four decimals, none twinned, while 27-32
    of 1,729 disjoint samples matched). (Duplicated calibration
    rows, oversampling say, raise ``c_k``: there a few leaked samples can go unnoticed; all of
    them are still refused. With scores of a few distinct values nearly every sample has a twin,
    and only the same data are told apart.)"""
    advice = "pass held-out calibration data, or none: then every sample is calibrated by cross-validation"
    n = labels.shape[0]
    expected = 0.0  # of the evaluated samples, matching by chance
    distinct = content_keys(logits).unique().numel() / n
    if _same_rows_in_any_order(logits, labels, cal_logits, cal_labels):
        shared = n
    elif distinct < _MOSTLY_DISTINCT_SCORES:
        return
    else:
        shared = int(shared_samples(logits, labels, cal_logits, cal_labels).sum())
        if not shared:
            return
        num_classes = max(int(labels.max()), int(cal_labels.max())) + 1
        twins = shared_samples(cal_logits, cal_labels, cal_logits, cal_labels, exclude_self=True).double()
        sums, counts = class_sums(twins, cal_labels.cpu(), num_classes)
        chance = sums / counts.clamp_min(1)
        evaluated = torch.bincount(labels.cpu(), minlength=num_classes).double()
        expected, spread = float(evaluated @ chance), math.sqrt(float(evaluated @ (chance * (1 - chance))))
        if shared <= expected + 4 * spread + 1:  # (+ 1: a coincidence the twin share, estimated from finite data, can miss)
            return
    if shared == n:
        raise ValueError(f"every evaluated sample ({n}) is in the calibration data too: the calibrators would be scored on "
                         f"the samples they were fitted on, which flatters them; {advice}.")
    if distinct < _DISTINCT_SCORES:
        return  # (some shared samples among tied scores: the twin share of a small calibration set misjudges chance)
    by_chance = f" (about {expected:.0f} would match by chance: these scores are dense)" if expected >= 1 else ""
    warnings.warn(f"{shared} of the {n} evaluated samples are in the calibration data too{by_chance}: their calibrated scores "
                  f"were fitted on themselves, which flatters the calibrators; {advice}.", stacklevel=stacklevel_outside_package())


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
            (Ferrer & Ramos, App. E), so calibrated metrics carry no interval. The same replicates
            decide whether the lowest NCE is significantly below temperature scaling's; with
            cross-validation a narrowly significant difference is checked again by
            ``min(bootstrap, REFITTED_REPLICATES)`` replicates that refit both calibrators (see the
            module docs). With 0 there is no such test, and the method of the lowest NCE wins.
        seed: seed of the folds and of the bootstrap, and of the calibrators' own folds where they
            cross-validate a regularisation (``cv_seed``, unless ``method_options`` set it).
        method_options: constructor options per method, e.g. ``{"dirichlet-odir": {"reg_grid": [...]}}``;
            a name that is no method of :data:`METHODS` is refused, options of a method not in
            ``methods`` are not used.
        progress: show a tqdm progress bar.

    Returns:
        a :class:`Report`; ``report.calibrator`` is the winning method refitted on all calibration
        data (the calibration set, or all of ``scores`` with cross-validation).
    """
    if priors is not None and isinstance(scores, Scores):  # (binary LLRs: their posteriors under these priors)
        scores = scores.with_llr_priors(priors)
    if priors is not None and isinstance(calibration, Scores):
        calibration = calibration.with_llr_priors(priors)
    logits, labels, source, read_as = _unpack(scores, "scores")
    num_classes = logits.shape[1]
    if labels.unique().numel() < 2:
        raise ValueError(f"every label is class {int(labels[0])}; the normalised scores (NCE, NBS, calibration loss), which "
                         "compare with the naive system of the class priors, and calibration need two classes present.")
    methods = list(dict.fromkeys([methods] if isinstance(methods, str) else methods))  # (a name is a sequence of letters)
    method_options = {name: dict(opts) for name, opts in (method_options or {}).items()}
    unknown = [name for name in method_options if name not in METHODS]
    if unknown:  # a misspelt name would leave its method on the default options, silently
        raise ValueError(f"method_options for unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}.")
    for method in methods:  # fail early on bad names, options or class counts
        supported = make_calibrator(method, **method_options.get(method, {})).supported_num_classes
        if supported is not None and supported != num_classes:
            raise ValueError(f"method {method!r} is for K = {supported} classes, but the scores have K = {num_classes}.")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0 or bootstrap == 1:
        raise ValueError(f"bootstrap must be 0 (no intervals) or a number of replicates >= 2, got {bootstrap!r}.")
    if calibration is None and folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}.")
    if priors is not None:
        priors = check_priors(priors, num_classes)
    costs = zero_one_costs(num_classes) if costs is None else check_costs(costs, num_classes)
    if calibration is not None:
        cal_logits, cal_labels, cal_source, cal_read_as = _unpack(calibration, "calibration scores")
        if cal_logits.shape[1] != num_classes:
            raise ValueError(f"the calibration scores have K = {cal_logits.shape[1]} classes, the evaluated scores K = {num_classes}.")
        if cal_labels.unique().numel() < 2:  # (the calibrators' degenerate maps would be reported as methods)
            raise ValueError(f"every label of the calibration scores is class {int(cal_labels[0])}; calibration needs two "
                             f"classes present.")
        _check_held_out(logits, labels, cal_logits, cal_labels)
        if isinstance(scores, Scores) and isinstance(calibration, Scores):
            check_read_alike(scores, calibration, "the evaluated scores", "the calibration scores")
        protocol = f"fitted on separate calibration data ({cal_source}, N = {cal_logits.shape[0]}, read as {cal_read_as})"
    else:
        cal_logits, cal_labels = logits, labels
        protocol = (f"{folds}-fold stratified cross-validation on the evaluated data (each sample "
                    f"calibrated by a model fitted on the other folds)")

    metrics = _Metrics(labels, priors, costs, bootstrap, seed, progress)
    # (as fitted, and so saved with the calibrator and in report.json)
    seeded_options = {method: {**_seeded(method, seed), **method_options.get(method, {})} for method in methods}
    fits = 1 if calibration is not None else folds + 1  # per method: the final fit, and one per fold
    bar_format = "{desc}: {n_fmt}/{total_fmt} steps |{bar}| {elapsed} elapsed{postfix}"  # no ETA: fits differ a lot
    with tqdm(total=1 + fits * len(methods), disable=None if progress else True, desc="torchcal", leave=False,
              bar_format=bar_format) as bar, _refreshed_every_second(bar):
        started = time.perf_counter()

        def status(text: str) -> None:
            """The bar's status; where there is no bar (not a terminal), a line on stderr instead."""
            bar.set_postfix_str(text)
            if progress and bar.disable:
                print(f"torchcal: {text} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

        status("raw posteriors" + (f", bootstrap x{bootstrap}" if bootstrap else ""))
        raw = metrics.quality(logits, with_intervals=True)
        bar.update()
        results, fitted, calibrated = [], {}, {}
        for method in methods:
            start = time.perf_counter()
            options = seeded_options[method]
            where = "fit on the calibration data" if calibration is not None else f"{folds}-fold CV and the final fit"
            with _solver_warnings(f"{method} ({where})", fits):
                status(f"{method}: fit on all calibration data")
                model = make_calibrator(method, **options).fit(cal_logits, cal_labels, priors=priors).requires_grad_(False)
                bar.update()
                with torch.no_grad():
                    if calibration is not None:
                        out = model(logits)
                    else:
                        def fold_started(fold: int, method: str = method) -> None:
                            bar.update(fold > 0)
                            status(f"{method}: fold {fold + 1}/{folds}")

                        out = cross_validate(make_calibrator(method, **options), logits, labels, folds=folds,
                                             seed=seed, priors=priors, on_fold=fold_started)
                        bar.update()
            quality = metrics.quality(out, with_intervals=calibration is not None)
            results.append(_method_result(method, raw, quality, model, logits, out, labels, priors,
                                          time.perf_counter() - start))
            fitted[method], calibrated[method] = model, out.detach()
        lowest = min(results, key=lambda r: r.quality.nce.value).method if results else None
        best, versus, refits = lowest, None, 0
        if bootstrap and lowest is not None and lowest != "temperature" and "temperature" in calibrated:
            versus = metrics.nce_difference(calibrated[lowest], calibrated["temperature"])
            if calibration is None and versus.upper is not None and versus.value / 2 <= versus.upper < 0:
                refits = min(bootstrap, REFITTED_REPLICATES)
                status(f"{lowest} against temperature: {refits} replicates refitting both")
                with _solver_warnings(f"{lowest} and temperature refitted in {refits} bootstrap replicates", 2 * folds * refits):
                    versus = metrics.refitted_nce_difference(versus.value, logits, (fitted[lowest], fitted["temperature"]),
                                                             folds, refits)
            temperature_helps = next(r for r in results if r.method == "temperature").calibration_loss > 0
            if versus.upper is not None and versus.upper >= 0 and temperature_helps:  # not significantly lower: the simpler method
                best = "temperature"
    is_zero_one = is_zero_one_costs(costs)
    return Report(
        source=source, read_as=read_as, num_samples=logits.shape[0], num_classes=num_classes,
        protocol=protocol, priors=None if priors is None else priors.tolist(),
        costs_name=costs_name or ("0-1" if is_zero_one else "custom"),
        costs=None if is_zero_one else costs.tolist(), bootstrap=bootstrap, raw=raw, methods=results, best=best,
        lowest=lowest if versus is not None else None, lowest_vs_temperature=versus, lowest_vs_temperature_refits=refits,
        calibrator=None if best is None else fitted[best], method_options=seeded_options,
        logits=logits, labels=labels, calibrated=calibrated,
        llr_priors=_llr_priors(calibration if calibration is not None else scores),
    )


@contextlib.contextmanager
def _refreshed_every_second(bar: tqdm) -> Iterator[None]:
    """Redraw ``bar`` every second while the block runs, so its clock and status move during a long
    fit instead of freezing until the fit ends."""
    if bar.disable:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


def _llr_priors(scores: Scores | tuple[Tensor, Tensor]) -> Tensor | None:
    """The priors that turned the binary LLRs of ``scores`` into posteriors; None for other scores."""
    return scores.llr_priors if isinstance(scores, Scores) else None


def check_read_alike(first: Scores, second: Scores, first_name: str, second_name: str) -> None:
    """Refuse two files of scores of one system that detection read differently: one as
    probabilities (whose logs are taken), the other as logits although its rows lie in [0, 1] and
    sum to 1 roughly (rounded probabilities). Calibrators fitted on the one and applied to the
    other give wrong numbers: a LeNet-5's temperature scaling made NCE 0.586 -> 1.594 instead of
    -> 0.566. Scores declared (``input=``, ``--input``) or told by a file's key are read as said."""
    for rounded, exact, rounded_name, exact_name in ((first, second, first_name, second_name),
                                                     (second, first, second_name, first_name)):
        if rounded.read_as.startswith(ROUNDED_READ_AS_LOGITS) and exact.read_as.startswith("probabilities"):
            raise ValueError(
                f"{rounded_name} ({rounded.source}) were read as {rounded.read_as}, but {exact_name} ({exact.source}) "
                f"as {exact.read_as}: calibrators fitted on scores of one kind would be applied to another. If both "
                f"hold probabilities, say so: input='probs' (--input probs on the command line)."
            )


def _unpack(scores: Scores | tuple[Tensor, Tensor], name: str) -> tuple[Tensor, Tensor, str, str]:
    if isinstance(scores, Scores):
        if scores.labels is None:
            raise ValueError(f"{scores.source}: evaluating needs labels.")
        return scores.logits, scores.labels, scores.source, scores.read_as
    logits, labels = check_logits_and_labels(*scores)
    return logits, labels, "in-memory tensors", "logits"


class _Metrics:
    """The metrics of :class:`Quality`, with the evaluation's priors, costs and bootstrap (whose
    loops show a progress bar with ``progress``)."""

    def __init__(self, labels: Tensor, priors: Tensor | None, costs: Tensor, replicates: int, seed: int, progress: bool):
        self.labels, self.priors, self.costs = labels, priors, costs
        self.replicates, self.seed, self.progress = replicates, seed, progress

    def quality(self, logits: Tensor, with_intervals: bool) -> Quality:
        p = self.priors
        return Quality(
            nce=self._estimate(cross_entropy, logits, with_intervals, priors=p, normalize=True),
            nbs=self._estimate(brier_score, logits, with_intervals, priors=p, normalize=True),
            error_rate=self._error_rate(logits, with_intervals),
            nec=self._estimate(bayes_risk, logits, with_intervals, costs=self.costs, priors=p, normalize=True),
            ece=100 * float(expected_calibration_error(logits, self.labels, n_bins=ECE_BINS)),
            ecd=float(entropic_calibration_difference(logits, self.labels)),
            cross_entropy=float(cross_entropy(logits, self.labels, priors=p)),
            brier=float(brier_score(logits, self.labels, priors=p)),
            smooth_ece=100 * float(smooth_calibration_error(logits, self.labels)),
            calibration_p_value=float(consistency_resampling_test(
                expected_calibration_error, logits, self.labels, CALIBRATION_TEST_RESAMPLES, self.seed, n_bins=ECE_BINS
            ).p_value),
            **self._detection(logits),
        )

    def _error_rate(self, logits: Tensor, with_intervals: bool) -> Estimate:
        """The error rate, weighted by the priors like the other columns when there are any (the
        Bayes risk under 0-1 costs, without their K x K matrix)."""
        return self._estimate(error_rate, logits, with_intervals, priors=self.priors)

    def nce_difference(self, a: Tensor, b: Tensor) -> Estimate:
        """NCE(a) - NCE(b) of two systems' log-posteriors on the evaluated samples, with the
        percentile interval of a paired bootstrap (both scored on the same resamples)."""
        losses = torch.stack([log_loss_per_sample(to_log_probs(x), self.labels) for x in (a, b)], dim=1)
        num_classes = a.shape[1]

        def nce_difference(pair: Tensor, labels: Tensor) -> Tensor:  # (its name labels the progress bar)
            reference = class_frequencies(labels, num_classes) if self.priors is None else self.priors
            naive = naive_cross_entropy(reference)
            if not bool(naive > 0):  # a resample of one class: undefined, as the NCE's own replicates are
                raise ValueError("the naive system of a resample of one class scores 0: no NCE")
            sums, counts = class_sums(pair[:, 0] - pair[:, 1], labels, num_classes)
            return prior_weighted_mean(sums, counts, self.priors) / naive

        # (resampled as the NCE's own bootstrap is)
        result = bootstrap_metric(nce_difference, losses, self.labels, num_replicates=self.replicates, seed=self.seed,
                                  stratify=normalised_resampling_is_stratified(self.labels, self.priors), progress=self.progress)
        return Estimate(float(result.estimate), float(result.lower), float(result.upper))

    def refitted_nce_difference(self, value: float, logits: Tensor, fitted: Sequence[Calibrator], folds: int,
                                replicates: int) -> Estimate:
        """``value``, the NCE difference of two cross-validated calibrators on ``logits: (N, K)``,
        with a 95 % interval from ``replicates`` bootstrap replicates that resample the samples,
        deal the folds by original sample and refit both calibrators (Ferrer & Ramos, App. E):
        ``value`` plus or minus 1.96 of the replicates' standard deviation. The refits start from
        the ``fitted`` calibrators (fitted on all samples) and keep the regularisation strengths
        those selected (selecting them again in every fold of every replicate would cost a grid
        of fits each, and widens the interval further: this one is the narrower of the two)."""
        def refitted_nce_difference(logits: Tensor, labels: Tensor, calibrator: Sequence[Calibrator],
                                    groups: Tensor | None = None) -> Tensor:  # (the bootstrap passes the original rows)
            nce = [cross_entropy(cross_validate(start, logits, labels, folds=folds, seed=self.seed, groups=groups,
                                                priors=self.priors, warm_start=True), labels, priors=self.priors, normalize=True)
                   for start in calibrator]
            return nce[0] - nce[1]

        result = bootstrap_metric(refitted_nce_difference, logits, self.labels, num_replicates=replicates, seed=self.seed,
                                  calibrator=[_refit_start(model) for model in fitted],
                                  stratify=normalised_resampling_is_stratified(self.labels, self.priors), progress=self.progress)
        spread = 1.959964 * float(result.replicates.double().std())
        return Estimate(value, value - spread, value + spread)

    def _detection(self, logits: Tensor) -> dict[str, float]:
        if logits.shape[1] != 2 or bool((self.labels == 1).all()) or not bool((self.labels == 1).any()):
            return {}
        return {"cllr": float(cllr(logits, self.labels, self.priors)), "min_cllr": float(min_cllr(logits, self.labels)),
                "eer": 100 * float(equal_error_rate(logits, self.labels))}

    def _estimate(self, metric: Callable[..., Tensor], logits: Tensor, with_interval: bool, **kwargs: Any) -> Estimate:
        if not (with_interval and self.replicates):
            return Estimate(float(metric(logits, self.labels, **kwargs)))
        result = bootstrap_metric(metric, logits, self.labels, num_replicates=self.replicates, seed=self.seed,
                                  progress=self.progress, **kwargs)
        return Estimate(float(result.estimate), float(result.lower), float(result.upper))


def _refit_start(model: Calibrator) -> Calibrator:
    """A copy of a fitted calibrator that refits at the regularisation strengths it selected
    (``reg_lambda_``, ``reg_mu_``) rather than selecting them again."""
    start = copy.deepcopy(model)
    for name in ("reg_lambda", "reg_mu"):
        if getattr(model, name + "_", None) is not None:
            setattr(start, name, getattr(model, name + "_"))
    return start


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
    label_shift: Mapping[str, torch.Tensor] | None = None, llr_priors: torch.Tensor | None = None,
    input_kind: str | None = None,
) -> Path:
    """Save a fitted calibrator with what is needed to rebuild it: ``torch.save`` of a dict with the
    method name, its constructor options and the ``state_dict``; ``label_shift``, if given (the
    ``source_priors``, estimated ``target_priors`` and their ``stderr``), under that key;
    ``llr_priors``, if given: the priors that turned the binary LLRs it was fitted on into
    posteriors (``Scores.llr_priors``), which new LLRs need too; and ``input_kind``, if given: how
    its scores were declared (``--input``: ``"probs"``, ``"log_probs"``, ``"llr"``, ``"logits"``),
    how new scores are read too unless declared otherwise. The calibrator's ``fit_record_`` is
    saved with it, and set again on loading."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {} if label_shift is None else {"label_shift": dict(label_shift)}
    if calibrator.fit_record_ is not None:
        extra["fit_record"] = asdict(calibrator.fit_record_)
    if llr_priors is not None:
        extra["llr_priors"] = llr_priors
    if input_kind is not None:
        extra["input"] = input_kind
    torch.save({"format": _FORMAT, "method": method, "options": _plain(dict(options or {})),
                "state_dict": calibrator.state_dict(), **extra}, path)
    return path


def _read_saved(path: str | Path) -> dict[str, Any]:
    """The dict written by :func:`save_calibrator`, with a clear error for anything else."""
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
    return saved


class SavedCalibrator(NamedTuple):
    """A file written by :func:`save_calibrator`, read back by :func:`load_saved_calibrator`."""

    method: str  #: the method's command-line name
    calibrator: Calibrator  #: rebuilt and frozen for inference (``eval()``, no gradients)
    label_shift: dict[str, torch.Tensor] | None  #: ``source_priors``, ``target_priors``, ``stderr``
    llr_priors: torch.Tensor | None  #: (2,) priors that turned the binary LLRs it was fitted on into posteriors
    input_kind: str | None = None  #: how its scores were declared at the fit (``--input``), if they were


def load_saved_calibrator(path: str | Path) -> SavedCalibrator:
    """Everything a file written by :func:`save_calibrator` holds, from one read: the method, the
    rebuilt calibrator, and the label shift and LLR priors saved with it (``None`` when saved
    without). ``FileNotFoundError`` or ``ValueError`` for a missing file or any other file.

    Example:
        >>> import tempfile, torch
        >>> calibrator = TemperatureScaling().fit(torch.randn(200, 3), torch.randint(0, 3, (200,)))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     saved = load_saved_calibrator(save_calibrator(f"{folder}/head.pt", "temperature", calibrator))
        >>> saved.method, type(saved.calibrator).__name__, saved.label_shift, saved.llr_priors
        ('temperature', 'TemperatureScaling', None, None)
    """
    saved = _read_saved(path)
    calibrator = make_calibrator(saved["method"], **saved["options"])
    calibrator.load_state_dict(saved["state_dict"])
    if "fit_record" in saved:
        calibrator.fit_record_ = FitRecord(**saved["fit_record"])
    return SavedCalibrator(
        saved["method"], calibrator.eval().requires_grad_(False), saved.get("label_shift"), saved.get("llr_priors"),
        saved.get("input"),
    )


def load_calibrator(path: str | Path) -> tuple[str, Calibrator]:
    """Rebuild a calibrator written by :func:`save_calibrator`; returns ``(method, calibrator)``,
    the calibrator frozen for inference (``eval()``, no gradients). See :func:`load_saved_calibrator`."""
    saved = load_saved_calibrator(path)
    return saved.method, saved.calibrator


def load_label_shift(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The ``source_priors``, ``target_priors`` and ``stderr`` saved with a calibrator by
    ``torchcal calibrate --target``, or ``None`` if it was saved without. See :func:`load_saved_calibrator`."""
    return load_saved_calibrator(path).label_shift


def load_llr_priors(path: str | Path) -> torch.Tensor | None:
    """The (2,) priors that turned the binary LLRs a saved calibrator was fitted on into
    posteriors, or ``None`` if it was not fitted on LLRs. See :func:`load_saved_calibrator`."""
    return load_saved_calibrator(path).llr_priors
