"""Pure functions: scoring rules, expected cost and Bayes decisions, calibration diagnostics."""

from torchcal.functional.bootstrap import BootstrapResult, bootstrap
from torchcal.functional.calibration_loss import (
    CalibrationLossResult,
    calibration_loss,
    cross_validated_calibration_loss,
)
from torchcal.functional.decisions import (
    balanced_error_rate,
    bayes_decisions,
    bayes_risk,
    error_rate,
    expected_cost,
    zero_one_costs,
)
from torchcal.functional.diagnostics import (
    ReliabilityBins,
    entropic_calibration_difference,
    expected_calibration_error,
    reliability_bins,
    signed_calibration_error,
)
from torchcal.functional.posterior_quality import PosteriorQualityResult, posterior_quality
from torchcal.functional.refinement import refinement_loss
from torchcal.functional.scoring import (
    brier_score,
    class_frequencies,
    cross_entropy,
)

__all__ = [
    "BootstrapResult",
    "CalibrationLossResult",
    "PosteriorQualityResult",
    "ReliabilityBins",
    "balanced_error_rate",
    "bayes_decisions",
    "bayes_risk",
    "bootstrap",
    "brier_score",
    "calibration_loss",
    "class_frequencies",
    "cross_entropy",
    "cross_validated_calibration_loss",
    "entropic_calibration_difference",
    "error_rate",
    "expected_calibration_error",
    "expected_cost",
    "posterior_quality",
    "refinement_loss",
    "reliability_bins",
    "signed_calibration_error",
    "zero_one_costs",
]
