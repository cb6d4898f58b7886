"""torchcal: measure and fix the quality of classifier posteriors in PyTorch.

Scores are logits in the wide sense throughout: any unnormalised log-posteriors of shape (N, K),
so ``log(probs)`` works too. Calibrators return calibrated log-posteriors.

``torchcal.metrics``, ``torchcal.report``, ``torchcal.plots``, ``torchcal.lightning`` and
``torchcal.data`` are attributes of the package, imported on first use: they pull in torchmetrics,
Lightning or matplotlib, which ``import torchcal`` does not need.
"""

import importlib
from typing import TYPE_CHECKING, Any

from torchcal import functional, label_shift
from torchcal.calibrators import (
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
)
from torchcal.fit import ConvergenceWarning, FitRecord, cross_validate
from torchcal.heads import CalibratedModel, attach

if TYPE_CHECKING:
    # for type checkers and IDEs; the redundant aliases mark them as re-exported
    from torchcal import data as data
    from torchcal import lightning as lightning
    from torchcal import metrics as metrics
    from torchcal import plots as plots
    from torchcal import report as report

__version__ = "0.1.0"

_LAZY_SUBMODULES = frozenset({"data", "lightning", "metrics", "plots", "report"})

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
    "TemperatureScaling",
    "VectorScaling",
    "VennAbersCalibration",
    "attach",
    "cross_validate",
    "functional",
    "label_shift",
]


def __getattr__(name: str) -> Any:
    """Import a lazy submodule on first access (``torchcal.metrics.CrossEntropy`` after ``import torchcal``)."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"torchcal.{name}")  # also binds it on the package
    raise AttributeError(f"module 'torchcal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
