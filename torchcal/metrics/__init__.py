"""torchmetrics ``Metric`` classes: streaming, mergeable versions of ``torchcal.functional``."""

from torchcal.metrics.calibration_loss import CalibrationLoss
from torchcal.metrics.debiased_ece import DebiasedCalibrationError
from torchcal.metrics.decisions import BayesRisk, ExpectedCost
from torchcal.metrics.diagnostics import ECD, CalibrationError
from torchcal.metrics.fused import PosteriorQuality
from torchcal.metrics.score_decomposition import BrierDecomposition
from torchcal.metrics.scoring import BrierScore, CrossEntropy
from torchcal.metrics.smooth_ece import SmoothCalibrationError

__all__ = [
    "ECD",
    "BayesRisk",
    "BrierDecomposition",
    "BrierScore",
    "CalibrationError",
    "CalibrationLoss",
    "CrossEntropy",
    "DebiasedCalibrationError",
    "ExpectedCost",
    "PosteriorQuality",
    "SmoothCalibrationError",
]
