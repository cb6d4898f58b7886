"""torchmetrics ``Metric`` classes: streaming, mergeable versions of ``torchcal.functional``.

Every class is named after its functional twin (``ExpectedCalibrationError`` /
``expected_calibration_error``; the former names ``CalibrationError``, ``ECD`` and
``BrierDecomposition`` are aliases) and behaves as a torchmetrics citizen: ``compute()`` returns one
float64 tensor (a scalar, or per-class values where asked), so it works with ``self.log``,
``MetricCollection`` (and its compute groups), ``BootStrapper`` (with ``quantile`` a float or a
float64 tensor: ``torch.quantile`` wants the values' dtype; its quantiles pool every entry of a
vector value, per-class ECEs or ``MurphyDecomposition``'s three terms, so take those from
``raw=True`` along the first dimension, or use ``functional.bootstrap``), ``MetricTracker``,
``ClasswiseWrapper`` and ``MultitaskWrapper``; ``plot(val=None, ax=None)`` plots a value.
``PosteriorQuality`` is a ``MetricCollection`` whose members share one fused pass.

Inputs, the same for every class (``torchcal.metrics._common``):

- ``update(scores, labels)``: scores (N, K) with labels (N,), or (N, K, d1, ...) with labels
  (N, d1, ...) (segmentation; the state stays O(K + bins)), or for K = 2 one score of class 1 per
  label, (N,) or (N, d1, ...). An empty batch is a no-op.
- ``input="logits"`` (default) or ``"log_probs"``: any unnormalised log-posteriors;
  ``input="probs"``: posteriors. Scores that look like probabilities under a log kind warn: they
  would give a wrong number.
- ``ignore_index``: a label whose samples are left out; ``validate_args=False`` skips the checks.
"""

from torchcal.metrics.calibration_loss import CalibrationLoss
from torchcal.metrics.calibration_tests import SpiegelhalterTest
from torchcal.metrics.debiased_ece import DebiasedCalibrationError
from torchcal.metrics.decisions import BalancedErrorRate, BayesRisk, ErrorRate, ExpectedCost
from torchcal.metrics.detection import Cllr, DetectionCost
from torchcal.metrics.diagnostics import (
    ECD,
    CalibrationError,
    EntropicCalibrationDifference,
    ExpectedCalibrationError,
    SignedCalibrationError,
)
from torchcal.metrics.fused import PosteriorQuality, PosteriorStatistic
from torchcal.metrics.refinement import RefinementLoss
from torchcal.metrics.score_decomposition import BrierDecomposition, MurphyDecomposition
from torchcal.metrics.scoring import BrierScore, CrossEntropy
from torchcal.metrics.smooth_ece import SmoothCalibrationError

__all__ = [
    "ECD",
    "BalancedErrorRate",
    "BayesRisk",
    "BrierDecomposition",
    "BrierScore",
    "CalibrationError",
    "CalibrationLoss",
    "Cllr",
    "CrossEntropy",
    "DebiasedCalibrationError",
    "DetectionCost",
    "EntropicCalibrationDifference",
    "ErrorRate",
    "ExpectedCalibrationError",
    "ExpectedCost",
    "MurphyDecomposition",
    "PosteriorQuality",
    "PosteriorStatistic",
    "RefinementLoss",
    "SignedCalibrationError",
    "SmoothCalibrationError",
    "SpiegelhalterTest",
]
