"""Streaming Spiegelhalter test: Z is a function of three float64 sums, whatever N.

The other tests of ``functional.calibration_tests`` need every score at once (equal-mass groups
for Hosmer–Lemeshow, the walk in score order for Kolmogorov–Smirnov and Kuiper) and have only the
functional form.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from torchcal.functional.calibration_tests import (
    Alternative,
    CalibrationTestResult,
    spiegelhalter_sums,
    spiegelhalter_test_from_sums,
)
from torchcal.functional.diagnostics import check_binary_kind
from torchcal.metrics._common import ScoreMetric, add_sum_state

__all__ = ["SpiegelhalterTest"]


class SpiegelhalterTest(ScoreMetric):
    """Spiegelhalter's Z test of calibration, as ``functional.spiegelhalter_test``.

    ``compute()`` returns the statistic Z (a float64 scalar), not the p-value: Z is what the sums
    give (the Brier score minus its expectation under calibration, standardised: typically positive
    for over-confident scores and negative for under-confident ones), and it averages
    and bootstraps sensibly in torchmetrics' wrappers, where p-values do not. ``result()`` returns the ``CalibrationTestResult`` (Z and the p-value of
    ``alternative``) of the data accumulated on every process. Without any sample (no update, or
    every label ignored) both are NaN, as ``compute()`` is.

    Args:
        num_classes: K, or None for any.
        kind: ``"top-label"`` (confidence vs correctness) or ``"binary"`` (``q_1``, K = 2).
        alternative: the p-value of ``result()``: ``"two-sided"``, ``"greater"`` or ``"less"``.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.3, .7], [.4, .6]])
        >>> metric = SpiegelhalterTest(2, kind="binary", input="probs")
        >>> metric.update(probs[:3], torch.tensor([0, 1, 1]))
        >>> metric.update(probs[3:], torch.tensor([0]))
        >>> round(float(metric.compute()), 4), round(float(metric.result().p_value), 4)
        (1.005, 0.3149)
    """

    is_differentiable = False
    higher_is_better = None  # signed: 0 is the target
    full_state_update = False

    sums: Tensor

    _compute_only_options = ("alternative",)

    def __init__(
        self,
        num_classes: int | None = None,
        kind: Literal["top-label", "binary"] = "top-label",
        alternative: Alternative = "two-sided",
        **kwargs: Any,
    ) -> None:
        super().__init__(num_classes, **kwargs)
        if kind not in ("top-label", "binary"):
            raise ValueError(f'kind must be "top-label" or "binary", got {kind!r}.')
        if alternative not in ("two-sided", "greater", "less"):
            raise ValueError(f'alternative must be "two-sided", "greater" or "less", got {alternative!r}.')
        if num_classes is not None:  # (else at the first update, which knows K)
            check_binary_kind(kind, num_classes, ("top-label", "binary"))
        self.kind, self.alternative = kind, alternative
        add_sum_state(self, "sums", 3)  # spiegelhalter_sums

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        problems = self._binary_problems(scores, labels, allowed=("top-label", "binary"))
        if problems is None:
            return
        scores, targets = problems
        self.sums += spiegelhalter_sums(scores[:, 0], targets[:, 0])

    def compute(self) -> Tensor:
        """Spiegelhalter's Z, a float64 scalar."""
        return spiegelhalter_test_from_sums(self.sums, self.alternative).statistic

    def result(self) -> CalibrationTestResult:
        """Z and its p-value for the data accumulated on every process; both NaN without samples."""
        return self._synced_result(lambda: spiegelhalter_test_from_sums(self.sums, self.alternative), CalibrationTestResult)
