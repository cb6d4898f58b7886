"""Binary detection metrics of speaker recognition and forensics: Cllr, minCllr, EER, DCF, DET.

Class 1 is the target class. The detection score is the log-likelihood ratio
``llr = log(q_1 / q_0) - log(P_1 / P_0)``: the posterior log-odds minus the prior log-odds ``P``
the posteriors were computed with (``priors``; the evaluation data's class frequencies unless
given, the convention of the rest of torchcal). With ``Pmiss(theta)`` the fraction of targets with
``llr <= theta`` and ``Pfa(theta)`` the fraction of non-targets with ``llr > theta``:

- ``cllr`` (Brümmer & du Preez 2006): ``(mean_targets log2(1 + e^-llr) + mean_nontargets
  log2(1 + e^llr)) / 2``, the cross-entropy at flat priors in bits; 1 for a system that always
  says ``llr = 0``. ``min_cllr``: its value after the best monotonic recalibration of the scores
  (PAV, ``functional.isotonic.pool_adjacent_violators``); ``cllr - min_cllr`` is the
  calibration loss.
- ``equal_error_rate``: the EER of the ROC convex hull (BOSARIS' ``rocch2eer``): where the hull,
  whose vertices are the PAV blocks, crosses ``Pmiss = Pfa``.
- ``detection_cost``: the actual DCF ``C_miss P_tar Pmiss + C_fa (1 - P_tar) Pfa`` of the Bayes
  threshold ``theta = log(C_fa (1 - P_tar) / (C_miss P_tar))``, normalised by default by the cost
  of the best fixed decision; ``min_detection_cost``: the minimum over all thresholds. The
  normalised actual DCF is the binary normalised expected cost of ``plots.bayes_risk_sweep`` at
  the effective prior (its log-odds ``t = logit(P_eff)``).
- ``det_curve``: ``(Pfa, Pmiss)`` at every threshold, for DET plots on probit axes.

Cllr and the actual DCF are prior-weighted means of a per-sample value of the LLR (``cllr_per_sample``,
a false alarm or a miss), so they also stream as ``metrics.Cllr`` and ``metrics.DetectionCost``
from per-class sums (``cllr_from_class_sums``, ``detection_cost_from_class_sums``). minCllr, the
EER, the minimum DCF and the DET curve need every score at once.

The PAV and the sorting run on the CPU (NumPy) where noted; results return to the logits' device.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels, check_priors
from torchcal.functional._ties import tie_group_starts, tie_tolerance
from torchcal.functional.isotonic import pool_adjacent_violators
from torchcal.functional.scoring import class_frequencies, class_sums, to_log_probs

__all__ = [
    "DetectionCurve",
    "bayes_accepts",
    "bayes_threshold",
    "cllr",
    "cllr_from_class_sums",
    "cllr_per_sample",
    "det_curve",
    "detection_cost",
    "detection_cost_from_class_sums",
    "equal_error_rate",
    "log_likelihood_ratios",
    "min_cllr",
    "min_detection_cost",
    "roc_convex_hull",
]


class DetectionCurve(NamedTuple):
    """False-alarm and miss rates (T,) float64, from accepting everything to rejecting everything."""

    false_alarm: Tensor
    miss: Tensor


def _check_both_classes(counts: Tensor) -> None:
    """``ValueError`` unless the (2,) class counts are both positive."""
    if not bool((counts > 0).all()):
        raise ValueError("detection metrics need both target (label 1) and non-target (label 0) samples.")


def _binary(logits: Tensor, labels: Tensor, both_classes: bool = True) -> tuple[Tensor, Tensor]:
    logits, labels = check_logits_and_labels(logits, labels)
    if logits.shape[1] != 2:
        raise ValueError(f"detection metrics need K = 2 classes (class 1 the target), got K = {logits.shape[1]}.")
    if both_classes:
        is_target = labels == 1
        _check_both_classes(torch.stack([(~is_target).sum(), is_target.sum()]))
    return logits, labels


def log_likelihood_ratios(logits: Tensor, labels: Tensor, priors: Tensor | None = None) -> Tensor:
    """``llr = log(q_1 / q_0) - log(P_1 / P_0)`` (N,) float64; ``P`` = ``priors`` or the class frequencies.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.2, .8]], dtype=torch.float64)
        >>> log_likelihood_ratios(probs.log(), torch.tensor([0, 1])).round(decimals=4)
        tensor([-1.3863,  1.3863], dtype=torch.float64)
    """
    # given priors, the labels are not used: one class alone is enough
    return _llrs_and_labels(logits, labels, priors, both_classes=priors is None)[0]


def _log_odds_and_labels(
    logits: Tensor, labels: Tensor, priors: Tensor | None = None, both_classes: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """The posterior log-odds (N,), the priors' log-odds (a scalar; their difference is the LLR)
    and the validated int64 labels (N,) on their device."""
    logits, labels = _binary(logits, labels, both_classes)
    log_probs = to_log_probs(logits)
    p = class_frequencies(labels, 2) if priors is None else check_detection_priors(priors, device=logits.device)
    return log_probs[:, 1] - log_probs[:, 0], p[1].log() - p[0].log(), labels


def _llrs_and_labels(
    logits: Tensor, labels: Tensor, priors: Tensor | None = None, both_classes: bool = True
) -> tuple[Tensor, Tensor]:
    """``log_likelihood_ratios`` (N,) and the validated int64 labels (N,) on their device."""
    log_odds, prior_log_odds, labels = _log_odds_and_labels(logits, labels, priors, both_classes)
    return log_odds - prior_log_odds, labels


def check_detection_priors(priors: Any, device: torch.device | None = None) -> Tensor:
    """The (2,) priors that turn posteriors into LLRs, checked (both positive: the LLR subtracts
    their log-odds), in float64."""
    priors = check_priors(priors, 2, device=device)
    if not bool((priors > 0).all()):
        raise ValueError(
            f"priors must both be positive to turn posteriors into LLRs (which subtract log(P1 / P0)), "
            f"got {priors.tolist()}."
        )
    return priors


def cllr_per_sample(llr: Tensor, labels: Tensor) -> Tensor:
    """Each sample's cost in nats, ``log(1 + e^-llr)`` for targets and ``log(1 + e^llr)`` for non-targets; (N,)."""
    return torch.nn.functional.softplus(torch.where(labels == 1, -llr, llr))


def cllr_from_class_sums(sums: Tensor, counts: Tensor) -> Tensor:
    """Cllr in bits from per-class sums of ``cllr_per_sample`` and class counts, (2,) each: the
    mean of the two class means (flat priors), over ``log 2``.

    Example:
        >>> cllr_from_class_sums(torch.tensor([2.0, 6.0]) * math.log(2), torch.tensor([2.0, 3.0]))
        tensor(1.5000)
    """
    _check_both_classes(counts)
    return (sums / counts).mean() / math.log(2)


def cllr(logits: Tensor, labels: Tensor, priors: Tensor | None = None) -> Tensor:
    """Cllr in bits (Brümmer & du Preez 2006) of the LLRs of ``log_likelihood_ratios``.

    Args:
        logits: (N, 2) scores; class 1 is the target. labels: (N,) 0/1.
        priors: the priors the posteriors assume (for the LLRs); the class frequencies by default.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> round(float(cllr(probs.log(), torch.tensor([0, 1, 1, 1]))), 4)
        0.7356
    """
    llr, labels = _llrs_and_labels(logits, labels, priors)
    return cllr_from_class_sums(*class_sums(cllr_per_sample(llr, labels), labels, 2))


def _pav_blocks(scores: Tensor, is_target: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PAV of the targets on the scores (CPU): per-sample block value, and per-block target and
    non-target counts in increasing score order."""
    x = scores.detach().to(torch.float64).cpu().numpy()
    t = is_target.detach().cpu().numpy().astype(np.float64)
    boundaries, values = pool_adjacent_violators(x, t, np.ones_like(x))
    block = np.searchsorted(boundaries, x, side="right") - 1
    targets = np.bincount(block, weights=t, minlength=len(values))
    totals = np.bincount(block, minlength=len(values)).astype(np.float64)
    return values[block], targets, totals - targets


def min_cllr(logits: Tensor, labels: Tensor) -> Tensor:
    """minCllr: the Cllr of the PAV-recalibrated scores, the best any monotonic map can reach.

    The PAV posteriors ``p`` (at the data's class frequencies ``P``) become LLRs
    ``logit(p) - logit(P_1)``; blocks of only targets or only non-targets get infinite LLRs of the
    right sign, which cost 0.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> round(float(min_cllr(probs.log(), torch.tensor([0, 1, 1, 1]))), 4)
        0.0
    """
    llr, labels = _llrs_and_labels(logits, labels)
    is_target = labels == 1
    fitted = torch.from_numpy(_pav_blocks(llr, is_target)[0]).to(llr.device)
    prior = is_target.to(torch.float64).mean()
    optimal = fitted.log() - (-fitted).log1p() - (prior.log() - (-prior).log1p())
    labels = is_target.long()
    return cllr_from_class_sums(*class_sums(cllr_per_sample(optimal, labels), labels, 2))


def roc_convex_hull(logits: Tensor, labels: Tensor) -> DetectionCurve:
    """Vertices of the ROC convex hull, from ``(Pfa, Pmiss) = (1, 0)`` to ``(0, 1)`` (PAV blocks; CPU).

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> roc_convex_hull(probs.log(), torch.tensor([0, 1, 0, 1]))
        DetectionCurve(false_alarm=tensor([1., 0., 0.], dtype=torch.float64), miss=tensor([0., 0., 1.], dtype=torch.float64))
    """
    logits, labels = _binary(logits, labels)
    scores = to_log_probs(logits)
    _, targets, nontargets = _pav_blocks(scores[:, 1] - scores[:, 0], labels == 1)
    miss = np.r_[0.0, np.cumsum(targets)] / targets.sum()
    false_alarm = 1 - np.r_[0.0, np.cumsum(nontargets)] / nontargets.sum()
    return DetectionCurve(*(torch.from_numpy(v).to(logits.device) for v in (false_alarm, miss)))


def equal_error_rate(logits: Tensor, labels: Tensor) -> Tensor:
    """The ROC-convex-hull EER (BOSARIS ``rocch2eer``): a scalar in [0, 0.5].

    Each hull segment's line ``s . (Pfa, Pmiss) = 1`` crosses the diagonal at ``1 / (s_1 + s_2)``;
    the EER is the largest such crossing (0 for axis-parallel segments).

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9], [.4, .6]], dtype=torch.float64)
        >>> round(float(equal_error_rate(probs.log(), torch.tensor([0, 1, 1, 1, 0]))), 4)
        0.2
    """
    false_alarm, miss = roc_convex_hull(logits, labels)
    x1, x2, y1, y2 = false_alarm[:-1], false_alarm[1:], miss[:-1], miss[1:]
    determinant = x1 * y2 - x2 * y1
    denominator = (y2 - y1) + (x1 - x2)
    flat = (x1 == x2) | (y1 == y2) | (determinant == 0)
    crossing = torch.where(flat, torch.zeros_like(determinant), determinant / torch.where(flat, torch.ones_like(denominator), denominator))
    return crossing.max()


def det_curve(logits: Tensor, labels: Tensor) -> DetectionCurve:
    """``(Pfa, Pmiss)`` at every threshold between distinct LLRs, plus both ends; (T,) each. LLRs
    within round-off of each other (``functional._ties``: the same posterior from rows of logits
    with offsets of order 1: see there for larger ones) are one LLR, as in the PAV of ``roc_convex_hull``.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> det_curve(probs.log(), torch.tensor([0, 1, 0, 1])).miss.tolist()
        [0.0, 0.0, 0.0, 0.5, 1.0]
    """
    logits, labels = _binary(logits, labels)
    log_probs = to_log_probs(logits)
    scores = log_probs[:, 1] - log_probs[:, 0]
    order = scores.argsort()
    ordered, is_target = scores[order], (labels[order] == 1).to(torch.float64)
    last_of_tie = torch.ones_like(ordered, dtype=torch.bool)
    last_of_tie[:-1] = tie_group_starts(ordered)[1:]
    zero = ordered.new_zeros(1)
    targets_below = torch.cat([zero, is_target.cumsum(0)[last_of_tie]])
    nontargets_below = torch.cat([zero, (1 - is_target).cumsum(0)[last_of_tie]])
    return DetectionCurve(1 - nontargets_below / nontargets_below[-1], targets_below / targets_below[-1])


def _check_operating_point(target_prior: float, cost_miss: float, cost_false_alarm: float) -> None:
    if not 0 < target_prior < 1:
        raise ValueError(f"target_prior must lie strictly between 0 and 1, got {target_prior}.")
    for name, cost in (("cost_miss", cost_miss), ("cost_false_alarm", cost_false_alarm)):
        if not (math.isfinite(cost) and cost > 0):
            raise ValueError(
                f"cost_miss and cost_false_alarm must be finite and positive, got {name} = {cost}: "
                f"give the cost of one miss and of one false alarm, e.g. 1.0."
            )


def _dcf(miss: Tensor, false_alarm: Tensor, target_prior: float, cost_miss: float, cost_false_alarm: float, normalize: bool) -> Tensor:
    cost = cost_miss * target_prior * miss + cost_false_alarm * (1 - target_prior) * false_alarm
    return cost / min(cost_miss * target_prior, cost_false_alarm * (1 - target_prior)) if normalize else cost


def bayes_threshold(target_prior: float, cost_miss: float, cost_false_alarm: float) -> float:
    """The LLR above which the Bayes decision accepts: ``log(C_fa (1 - P_tar) / (C_miss P_tar))``."""
    _check_operating_point(target_prior, cost_miss, cost_false_alarm)
    return math.log(cost_false_alarm * (1 - target_prior) / (cost_miss * target_prior))


def bayes_accepts(log_odds: Tensor, prior_log_odds: Tensor, threshold: float) -> Tensor:
    """The Bayes decisions (N,) bool: accept where the LLR ``log_odds - prior_log_odds`` exceeds
    ``threshold`` by more than the three terms' round-off, and is not tied with it (``_ties``). An
    LLR that equals the threshold is a miss, as the module says, however the terms round:
    posteriors of 1/2 under a target prior equal to the priors' ``P_1`` sit exactly on it. (Scores
    that ``min_detection_cost`` ties, such as 0 and 3e-15, are not split by the threshold 0
    between them: the actual DCF had come out 0 beside a minimum of 1.)

    Example:
        >>> bool(bayes_accepts(torch.zeros(1, dtype=torch.float64), torch.tensor(math.log(4)), -math.log(4)))
        False
    """
    eps = torch.finfo(torch.float64).eps
    llr = log_odds - prior_log_odds
    slack = 8 * eps * (1 + log_odds.abs() + prior_log_odds.abs() + abs(threshold))
    return llr > threshold + torch.maximum(slack, tie_tolerance(llr.abs().clamp_min(abs(threshold))))


def detection_cost_from_class_sums(
    errors: Tensor,
    counts: Tensor,
    target_prior: float = 0.5,
    cost_miss: float = 1.0,
    cost_false_alarm: float = 1.0,
    normalize: bool = True,
) -> Tensor:
    """Actual DCF from per-class error counts ``[false alarms, misses]`` and class counts, (2,) each.

    Example:
        >>> float(detection_cost_from_class_sums(torch.tensor([1.0, 0.0]), torch.tensor([4.0, 2.0])))
        0.25
    """
    _check_operating_point(target_prior, cost_miss, cost_false_alarm)
    _check_both_classes(counts)
    false_alarm, miss = errors / counts
    return _dcf(miss, false_alarm, target_prior, cost_miss, cost_false_alarm, normalize)


def detection_cost(
    logits: Tensor,
    labels: Tensor,
    target_prior: float = 0.5,
    cost_miss: float = 1.0,
    cost_false_alarm: float = 1.0,
    priors: Tensor | None = None,
    normalize: bool = True,
) -> Tensor:
    """Actual DCF of the Bayes decisions ``llr > log(C_fa (1 - P_tar) / (C_miss P_tar))``.

    Args:
        logits: (N, 2) scores; class 1 is the target. labels: (N,) 0/1.
        target_prior, cost_miss, cost_false_alarm: the operating point.
        priors: the priors the posteriors assume (for the LLRs); the class frequencies by default.
        normalize: divide by ``min(C_miss P_tar, C_fa (1 - P_tar))``, the best fixed decision.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> round(float(detection_cost(probs.log(), torch.tensor([0, 1, 1, 1]), target_prior=0.75)), 4)
        1.0
    """
    threshold = bayes_threshold(target_prior, cost_miss, cost_false_alarm)
    log_odds, prior_log_odds, labels = _log_odds_and_labels(logits, labels, priors)
    errors, counts = class_sums(bayes_accepts(log_odds, prior_log_odds, threshold) != (labels == 1), labels, 2)
    return detection_cost_from_class_sums(errors, counts, target_prior, cost_miss, cost_false_alarm, normalize)


def min_detection_cost(
    logits: Tensor,
    labels: Tensor,
    target_prior: float = 0.5,
    cost_miss: float = 1.0,
    cost_false_alarm: float = 1.0,
    normalize: bool = True,
) -> Tensor:
    """Minimum DCF over all thresholds (the DCF after the best monotonic recalibration).

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]], dtype=torch.float64)
        >>> round(float(min_detection_cost(probs.log(), torch.tensor([0, 1, 1, 1]), target_prior=0.75)), 4)
        0.0
    """
    _check_operating_point(target_prior, cost_miss, cost_false_alarm)
    false_alarm, miss = det_curve(logits, labels)
    return _dcf(miss, false_alarm, target_prior, cost_miss, cost_false_alarm, normalize).min()
