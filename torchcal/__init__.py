"""torchcal: measure and fix the quality of classifier posteriors in PyTorch.

Scores are logits in the wide sense throughout: any unnormalised log-posteriors of shape (N, K),
so ``log(probs)`` works too, unless a probability is exactly 0: its log, -inf, is refused
everywhere; clamp first (``probs.clamp_min(1e-20).log()``) or declare the probabilities
(``input="probs"`` on the metric classes, ``--input probs`` on the command line), which floors them.
Calibrators return calibrated log-posteriors.

Every name, and the submodules (``torchcal.calibrators``, ``torchcal.functional``,
``torchcal.metrics``, ``torchcal.fit``, ``torchcal.report``, ``torchcal.plots``,
``torchcal.lightning``, ``torchcal.data``, ...), is an attribute of the package imported on first
use, so ``import torchcal`` (and ``torchcal --help``) costs nothing until something is used.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; names in __all__ count as re-exported
    from torchcal import calibrators, data, fit, functional, heads, label_shift, lightning, metrics, plots, report
    from torchcal.calibrators import (
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
    )
    from torchcal.fit import ConvergenceWarning, FitRecord, cross_validate
    from torchcal.heads import CalibratedModel, attach

__version__ = "0.1.0"

# Everything is imported on first access (PEP 562), so that ``import torchcal`` and the command
# line's ``--help`` do not pay for torch, torchmetrics, Lightning or matplotlib.
_SUBMODULES = frozenset(
    {"calibrators", "data", "fit", "functional", "heads", "label_shift", "lightning", "metrics", "plots", "report"}
)
_EXPORTS = {
    **dict.fromkeys(
        [
            "AffineCalibration",
            "BetaCalibration",
            "Calibrator",
            "DirichletCalibration",
            "HistogramBinning",
            "IsotonicCalibration",
            "MatrixScaling",
            "PlattScaling",
            "QuadraticScaling",
            "StructuredMatrixScaling",
            "StructuredVectorScaling",
            "TemperatureScaling",
            "VectorScaling",
            "VennAbersCalibration",
        ],
        "torchcal.calibrators",
    ),
    **dict.fromkeys(["ConvergenceWarning", "FitRecord", "cross_validate"], "torchcal.fit"),
    **dict.fromkeys(["CalibratedModel", "attach"], "torchcal.heads"),
}

__all__ = [
    "AffineCalibration",
    "BetaCalibration",
    "CalibratedModel",
    "Calibrator",
    "ConvergenceWarning",
    "DirichletCalibration",
    "FitRecord",
    "HistogramBinning",
    "IsotonicCalibration",
    "MatrixScaling",
    "PlattScaling",
    "QuadraticScaling",
    "StructuredMatrixScaling",
    "StructuredVectorScaling",
    "TemperatureScaling",
    "VectorScaling",
    "VennAbersCalibration",
    "attach",
    "calibrators",
    "cross_validate",
    "data",
    "fit",
    "functional",
    "heads",
    "label_shift",
    "lightning",
    "metrics",
    "plots",
    "report",
]


def __getattr__(name: str) -> Any:
    """Import an exported name or a submodule on first access (``torchcal.TemperatureScaling``,
    ``torchcal.metrics.CrossEntropy`` after ``import torchcal``)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"torchcal.{name}")  # also binds it on the package
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchcal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_EXPORTS})
