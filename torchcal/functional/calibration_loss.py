"""Calibration loss (Ferrer & Ramos): how much of a score a calibration transform removes.

``absolute = EPSR(raw) - EPSR(calibrated)`` and ``relative = 100 * absolute / EPSR(raw)`` (percent),
for an expected proper scoring rule (EPSR) such as cross-entropy or the Brier score. The
calibrated scores should come from a calibrator trained on other data than the one scored:
held-out data, or cross-validation (``cross_validated_calibration_loss``). A calibrator that
makes things worse gives a negative loss.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchcal._validation import check_labels, check_logits, check_logits_and_labels
from torchcal.functional.scoring import cross_entropy

__all__ = [
    "CalibrationLossResult",
    "calibration_loss",
    "calibration_loss_from_scores",
    "cross_validated_calibration_loss",
]

Score = Callable[..., Tensor]


class CalibrationLossResult(NamedTuple):
    absolute: Tensor  # EPSR(raw) - EPSR(calibrated), in the score's units
    relative: Tensor  # 100 * absolute / EPSR(raw), in percent


def calibration_loss_from_scores(raw: Tensor, calibrated: Tensor) -> CalibrationLossResult:
    """``CalibrationLossResult`` from the EPSR of the raw and of the calibrated scores.

    A raw score of 0 (a perfect system) leaves the relative loss undefined: NaN, beside the
    absolute loss ``-calibrated``. A negative raw score (no EPSR is negative) raises ``ValueError``.

    Example:
        >>> import torch
        >>> calibration_loss_from_scores(torch.tensor(0.5), torch.tensor(0.4))
        CalibrationLossResult(absolute=tensor(0.1000), relative=tensor(20.0000))
    """
    if bool(raw < 0):
        raise ValueError(f"the raw score is {float(raw):.6g}, but an expected proper scoring rule is >= 0: is score one?")
    absolute = raw - calibrated
    return CalibrationLossResult(absolute, 100 * absolute / raw if bool(raw > 0) else torch.full_like(absolute, math.nan))


def _check_score(score: Any) -> None:
    if not callable(score):
        raise ValueError(f"score must be a function score(logits, labels[, priors=...]), got {type(score).__name__}; "
                         f"pass deployment priors as priors=.")


def _score(score: Score, logits: Tensor, labels: Tensor, priors: Tensor | None) -> Tensor:
    return score(logits, labels) if priors is None else score(logits, labels, priors=priors)


def calibration_loss(
    raw_logits: Tensor,
    calibrated_logits: Tensor,
    labels: Tensor,
    score: Score = cross_entropy,
    priors: Tensor | None = None,
) -> CalibrationLossResult:
    """Absolute and relative (%) calibration loss of ``score`` between raw and calibrated scores.

    Args:
        raw_logits: (N, K) scores before calibration.
        calibrated_logits: (N, K) the same samples after calibration (log-posteriors).
        labels: (N,) class indices in [0, K).
        score: an EPSR ``score(logits, labels[, priors=...])``, e.g. ``cross_entropy`` or
            ``brier_score``; use ``functools.partial`` to fix other arguments.
        priors: optional (K,) deployment priors passed to ``score`` (by name: the fourth
            positional argument is ``score``).

    Example:
        >>> import torch
        >>> raw = torch.tensor([[3., 0.], [0., 3.], [3., 0.], [0., 3.]])
        >>> result = calibration_loss(raw, raw / 2, torch.tensor([0, 1, 1, 0]))
        >>> round(float(result.absolute), 4), round(float(result.relative), 2)
        (0.5972, 38.56)
    """
    _check_score(score)
    raw_logits = check_logits(raw_logits, "raw_logits")
    labels = check_labels(labels, raw_logits.shape[0], raw_logits.shape[1]).to(raw_logits.device)
    calibrated_logits = check_logits(
        calibrated_logits, "calibrated_logits", num_classes=raw_logits.shape[1], classes_of="of raw_logits"
    )
    if calibrated_logits.shape[0] != raw_logits.shape[0]:
        raise ValueError(
            f"calibrated_logits has {calibrated_logits.shape[0]} rows but raw_logits has "
            f"{raw_logits.shape[0]}; they must describe the same samples."
        )
    return calibration_loss_from_scores(
        _score(score, raw_logits, labels, priors), _score(score, calibrated_logits, labels, priors)
    )


def cross_validated_calibration_loss(
    logits: Tensor,
    labels: Tensor,
    calibrator: Any,
    score: Score = cross_entropy,
    priors: Tensor | None = None,
    folds: int = 5,
    seed: int = 0,
    groups: Tensor | None = None,
) -> CalibrationLossResult:
    """Calibration loss with out-of-fold calibrated scores from ``torchcal.cross_validate``.

    Each sample is calibrated by a copy of ``calibrator`` fitted on the other folds (stratified),
    which is Ferrer & Ramos' protocol when no separate calibration data exist. ``calibrator`` is
    not modified.

    Args:
        logits: (N, K) scores before calibration.
        labels: (N,) class indices in [0, K).
        calibrator: an unfitted torchcal calibrator, e.g. ``torchcal.AffineCalibration()``.
        score, priors: as in ``calibration_loss``; the fold calibrators are fitted with the
            ``priors`` too (``fit(..., priors=priors)``), as psrcal's ``calibration_with_crossval`` does.
        folds: number of cross-validation folds.
        seed: seed of the fold assignment.
        groups: optional (N,) group of each sample; a group's samples share a fold (unstratified
            folds, see ``torchcal.fit.fold_indices``). :func:`~torchcal.functional.bootstrap`
            passes each copy's original row, so that no fold calibrator is fitted on copies of the
            samples it calibrates (Ferrer & Ramos, App. E).

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(1000, 3)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> result = cross_validated_calibration_loss(logits, labels, torchcal.TemperatureScaling())
        >>> bool(result.relative > 20)  # logits 3 times over-confident
        True
    """
    from torchcal import cross_validate  # torchcal's top level imports this module
    from torchcal.calibrators.base import check_calibrator

    check_calibrator(calibrator)
    _check_score(score)
    logits, labels = check_logits_and_labels(logits, labels)
    # the fold calibrators are fitted for the priors they are scored with (their posteriors are for them)
    fit_options: dict[str, Any] = {} if priors is None else {"priors": priors}
    calibrated = cross_validate(copy.deepcopy(calibrator), logits, labels, folds=folds, seed=seed, groups=groups, **fit_options)
    return calibration_loss(logits, calibrated, labels, score, priors)
