"""torchcal: measure and fix the quality of classifier posteriors in PyTorch.

Scores are logits in the wide sense throughout: any unnormalised log-posteriors of shape (N, K),
so ``log(probs)`` works too. Calibrators return calibrated log-posteriors.
"""

from torchcal import functional
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
)
from torchcal.fit import ConvergenceWarning, FitRecord, cross_validate
from torchcal.heads import CalibratedModel, attach

__version__ = "0.1.0"

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
    "attach",
    "cross_validate",
    "functional",
]
