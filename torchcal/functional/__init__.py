"""Pure functions: scoring rules, expected cost and Bayes decisions, calibration diagnostics.

Five functions share the name of their module (``bootstrap``, ``calibration_loss``,
``posterior_quality``, ``reliability_intervals`` and ``smooth_ece``), and as attributes of this
package they are the functions: ``import torchcal.functional.smooth_ece as m`` gives the function.
Import the modules' other names directly, e.g. ``from torchcal.functional.smooth_ece import round_to_grid``.
"""

from torchcal.functional.bootstrap import BootstrapResult, bootstrap
from torchcal.functional.calibration_loss import (
    CalibrationLossResult,
    calibration_loss,
    cross_validated_calibration_loss,
)
from torchcal.functional.calibration_tests import (
    CalibrationTestResult,
    hosmer_lemeshow_test,
    kolmogorov_smirnov_test,
    kuiper_test,
    spiegelhalter_test,
)
from torchcal.functional.consistency_resampling import ResamplingTestResult, consistency_resampling_test
from torchcal.functional.debiased_ece import debiased_calibration_error, sweep_calibration_error
from torchcal.functional.decisions import (
    balanced_error_rate,
    bayes_decisions,
    bayes_risk,
    error_rate,
    expected_cost,
    zero_one_costs,
)
from torchcal.functional.detection import (
    cllr,
    det_curve,
    detection_cost,
    equal_error_rate,
    min_cllr,
    min_detection_cost,
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
from torchcal.functional.reliability_intervals import consistency_bands, reliability_intervals
from torchcal.functional.score_decomposition import corp_decomposition, murphy_decomposition
from torchcal.functional.scoring import (
    brier_score,
    class_frequencies,
    cross_entropy,
)
from torchcal.functional.selective import aurc, risk_coverage_curve
from torchcal.functional.smooth_ece import smooth_calibration_error, smooth_ece, smooth_reliability_curve

__all__ = [
    "BootstrapResult",
    "CalibrationLossResult",
    "CalibrationTestResult",
    "PosteriorQualityResult",
    "ReliabilityBins",
    "ResamplingTestResult",
    "aurc",
    "balanced_error_rate",
    "bayes_decisions",
    "bayes_risk",
    "bootstrap",
    "brier_score",
    "calibration_loss",
    "class_frequencies",
    "cllr",
    "consistency_bands",
    "consistency_resampling_test",
    "corp_decomposition",
    "cross_entropy",
    "cross_validated_calibration_loss",
    "debiased_calibration_error",
    "det_curve",
    "detection_cost",
    "entropic_calibration_difference",
    "equal_error_rate",
    "error_rate",
    "expected_calibration_error",
    "expected_cost",
    "hosmer_lemeshow_test",
    "kolmogorov_smirnov_test",
    "kuiper_test",
    "min_cllr",
    "min_detection_cost",
    "murphy_decomposition",
    "posterior_quality",
    "refinement_loss",
    "reliability_bins",
    "reliability_intervals",
    "risk_coverage_curve",
    "signed_calibration_error",
    "smooth_calibration_error",
    "smooth_ece",
    "smooth_reliability_curve",
    "spiegelhalter_test",
    "sweep_calibration_error",
    "zero_one_costs",
]
