"""Pure functions: scoring rules, expected cost and Bayes decisions, calibration diagnostics."""

from torchcal.functional.scoring import (
    brier_score,
    class_frequencies,
    cross_entropy,
)

__all__ = [
    "brier_score",
    "class_frequencies",
    "cross_entropy",
]
