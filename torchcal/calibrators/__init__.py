"""Calibration layers: ``nn.Module``s mapping scores to calibrated log-posteriors."""

from torchcal.calibrators.affine import AffineCalibration, PlattScaling, VectorScaling
from torchcal.calibrators.base import Calibrator
from torchcal.calibrators.beta import BetaCalibration
from torchcal.calibrators.matrix import DirichletCalibration, MatrixScaling
from torchcal.calibrators.nonparametric import HistogramBinning, IsotonicCalibration
from torchcal.calibrators.structured import QuadraticScaling, StructuredMatrixScaling, StructuredVectorScaling
from torchcal.calibrators.temperature import TemperatureScaling
from torchcal.calibrators.venn_abers import VennAbersCalibration

__all__ = [
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
]
