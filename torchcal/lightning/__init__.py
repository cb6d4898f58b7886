"""Lightning integration: :class:`CalibrationCallback` logs calibration metrics during training and
fits a calibration head on the validation outputs.

Imported explicitly (``import torchcal.lightning``); ``import torchcal`` does not load Lightning.
"""

from torchcal.lightning.callback import DEFAULT_METRICS, METRIC_NAMES, CalibrationCallback, calibration_metrics

__all__ = ["DEFAULT_METRICS", "METRIC_NAMES", "CalibrationCallback", "calibration_metrics"]
