"""torchmetrics ``Metric`` classes: streaming, mergeable versions of ``torchcal.functional``."""

from torchcal.metrics.calibration_loss import CalibrationLoss
from torchcal.metrics.decisions import BayesRisk, ExpectedCost
from torchcal.metrics.diagnostics import ECD, CalibrationError
from torchcal.metrics.fused import PosteriorQuality
from torchcal.metrics.refinement import RefinementLoss
from torchcal.metrics.scoring import BrierScore, CrossEntropy

__all__ = ["ECD", "BayesRisk", "BrierScore", "CalibrationError", "CalibrationLoss", "CrossEntropy", "ExpectedCost", "PosteriorQuality", "RefinementLoss"]
