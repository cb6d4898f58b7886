"""Decompositions of a proper score into miscalibration, discrimination and uncertainty.

- ``corp_decomposition`` (Dimitriadis, Gneiting & Jordan 2021, "CORP"): for one binary problem
  with scores ``x`` and 0/1 targets ``y``, the PAV (isotonic) recalibration ``x_hat`` of ``y`` on
  ``x`` is the CORP reliability curve, and for a proper score S with mean ``S(.)``,
  ``S(x) = MCB - DSC + UNC`` with ``MCB = S(x) - S(x_hat)`` (miscalibration, >= 0),
  ``DSC = S(ybar) - S(x_hat)`` (discrimination, >= 0) and ``UNC = S(ybar)`` (the score of the
  constant forecast ``ybar``). The identity is exact: no binning, no within-bin terms.
- ``murphy_decomposition`` (Murphy 1973): the binned Brier score's reliability, resolution and
  uncertainty from per-bin sums, ``REL = sum_m (n_m / N)(sbar_m - ybar_m)^2``,
  ``RES = sum_m (n_m / N)(ybar_m - ybar)^2``, ``UNC = ybar (1 - ybar)``, summed over the columns
  (for ``"classwise"`` that is the multiclass Brier score's decomposition). ``REL - RES + UNC``
  equals the Brier score only when the scores are constant within bins; the difference is the
  within-bin variance and covariance terms of Stephenson et al. 2008.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from torchcal._validation import as_tensor
from torchcal.functional.diagnostics import Strategy, bin_statistics, binary_problems, binned_scores
from torchcal.functional.isotonic import pool_adjacent_violators
from torchcal.functional.scoring import one_vs_rest_log_odds, top_label_log_odds

__all__ = [
    "CorpDecomposition",
    "MurphyDecomposition",
    "corp_decomposition",
    "corp_recalibration",
    "corp_reliability_curve",
    "murphy_decomposition",
    "murphy_from_bins",
]

BinaryScore = Callable[[Tensor, Tensor], Tensor]


class CorpDecomposition(NamedTuple):
    score: Tensor  # mean score of the forecasts: miscalibration - discrimination + uncertainty
    miscalibration: Tensor
    discrimination: Tensor
    uncertainty: Tensor


class MurphyDecomposition(NamedTuple):
    reliability: Tensor
    resolution: Tensor
    uncertainty: Tensor


def _brier(p: Tensor, y: Tensor) -> Tensor:
    return (p - y).square()


def _log(p: Tensor, y: Tensor) -> Tensor:
    # xlogy: a PAV block of pure 0s or 1s forecasts exactly 0 or 1 and scores 0, not NaN
    return -(torch.special.xlogy(y, p) + torch.special.xlogy(1 - y, 1 - p))


SCORES: dict[str, BinaryScore] = {"brier": _brier, "log": _log}


class _BinaryProblem(NamedTuple):
    scores: Tensor  # (N,) the probability of the event ``kind`` selects (the top label, or class 1)
    targets: Tensor  # (N,) 1 where it happened
    log_odds: Tensor  # (N,) its exact log-odds: the scores' order where confident scores round to 1


def _binary_problem(logits: Tensor, labels: Tensor, kind: str) -> _BinaryProblem:
    scores, targets = binary_problems(logits, labels, kind)
    logits = as_tensor(logits, "logits")
    event = top_label_log_odds(logits) if kind == "top-label" else one_vs_rest_log_odds(logits)[:, 1]
    return _BinaryProblem(scores[:, 0], targets[:, 0], event)


def _mean_log_score(problem: _BinaryProblem) -> Tensor:
    """The mean log score of the event from its log-odds ``t``: ``-log sigmoid(t)`` where it
    happened, ``-log sigmoid(-t)`` where not (``1 - p`` loses digits, or all of them where p rounds to 1)."""
    return F.softplus(torch.where(problem.targets > 0, -problem.log_odds, problem.log_odds)).mean()


def corp_recalibration(scores: Tensor, targets: Tensor) -> Tensor:
    """The PAV recalibration ``x_hat`` (N,) of 0/1 ``targets`` on ``scores`` (N,), tied scores pooled.

    Computed on the CPU by ``functional.isotonic.pool_adjacent_violators`` and returned on
    the scores' device.

    Example:
        >>> corp_recalibration(torch.tensor([0.1, 0.4, 0.6, 0.9]), torch.tensor([0., 1., 0., 1.]))
        tensor([0.0000, 0.5000, 0.5000, 1.0000], dtype=torch.float64)
    """
    scores, targets = as_tensor(scores, "scores"), as_tensor(targets, "targets")
    if scores.ndim != 1 or targets.shape != scores.shape:
        raise ValueError(
            f"scores and targets must be two 1-D tensors of the same length, got shapes {tuple(scores.shape)} and "
            f"{tuple(targets.shape)}."
        )
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores contain NaN or infinite values; PAV needs finite scores to order.")
    if not bool(((targets == 0) | (targets == 1)).all()):
        raise ValueError("targets must be 0 or 1 (whether each forecast event happened).")
    x = scores.detach().to(torch.float64).cpu().numpy()
    boundaries, values = pool_adjacent_violators(x, targets.detach().to(torch.float64).cpu().numpy(), np.ones_like(x))
    fitted = values[np.searchsorted(boundaries, x, side="right") - 1]
    return torch.from_numpy(fitted).to(scores.device)


def corp_reliability_curve(
    logits: Tensor, labels: Tensor, kind: Literal["top-label", "binary"] = "top-label"
) -> tuple[Tensor, Tensor]:
    """The CORP reliability diagram: the scores (N,) in increasing order and their PAV
    recalibration (N,), a non-decreasing step function to draw against the diagonal.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> scores, recalibrated = corp_reliability_curve(probs.log(), torch.tensor([0, 1, 1, 0]), kind="binary")
        >>> scores.round(decimals=4).tolist(), recalibrated.round(decimals=4).tolist()
        ([0.1, 0.2, 0.6, 0.7], [0.0, 0.6667, 0.6667, 0.6667])
    """
    problem = _binary_problem(logits, labels, kind)
    # PAV on the log-odds: distinct confident scores that round to the same probability keep their order
    order = problem.log_odds.argsort()
    return problem.scores[order], corp_recalibration(problem.log_odds, problem.targets)[order]


def corp_decomposition(
    logits: Tensor,
    labels: Tensor,
    score: Literal["brier", "log"] | BinaryScore = "brier",
    kind: Literal["top-label", "binary"] = "top-label",
) -> CorpDecomposition:
    """CORP decomposition ``S = MCB - DSC + UNC`` of a proper score (Dimitriadis et al. 2021).

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        score: ``"brier"``, ``"log"`` (natural log), or any proper scoring rule of a binary
            forecast as ``score(p, y) -> (N,)`` for probabilities ``p`` and 0/1 targets ``y``.
        kind: ``"top-label"`` (confidence vs correctness) or ``"binary"`` (class 1 of K = 2).

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> result = corp_decomposition(probs.log(), torch.tensor([0, 1, 1, 0]), kind="binary")
        >>> [round(float(v), 4) for v in result]
        [0.325, 0.1583, 0.0833, 0.25]
    """
    if isinstance(score, str):
        if score not in SCORES:
            raise ValueError(f'score must be "brier", "log" or a function score(p, y), got {score!r}.')
        score = SCORES[score]
    problem = _binary_problem(logits, labels, kind)
    y = problem.targets
    # PAV on the log-odds: confident rows whose probabilities all round to 1 are not pooled
    recalibrated = corp_recalibration(problem.log_odds, y)
    climatology = y.mean().expand_as(y)
    recalibrated_score, uncertainty = (score(p, y).mean() for p in (recalibrated, climatology))
    mean_score = _mean_log_score(problem) if score is _log else score(problem.scores, y).mean()
    return CorpDecomposition(mean_score, mean_score - recalibrated_score, uncertainty - recalibrated_score, uncertainty)


def murphy_from_bins(counts: Tensor, score_sums: Tensor, target_sums: Tensor) -> MurphyDecomposition:
    """Murphy's REL, RES and UNC from per-bin sums (C, M) of 0/1 targets, summed over the C columns.

    Example:
        >>> counts, score_sums, target_sums = torch.tensor([[2., 2.]]), torch.tensor([[.4, 1.6]]), torch.tensor([[0., 2.]])
        >>> [round(float(v), 4) for v in murphy_from_bins(counts, score_sums, target_sums)]
        [0.04, 0.25, 0.25]
    """
    n = counts.sum(-1, keepdim=True)
    denominator = counts.clamp_min(1)
    frequency, mean_score = target_sums / denominator, score_sums / denominator
    overall = target_sums.sum(-1, keepdim=True) / n
    weight = counts / n
    reliability = (weight * (mean_score - frequency).square()).sum(-1).sum(-1)
    resolution = (weight * (frequency - overall).square()).sum(-1).sum(-1)
    uncertainty = (overall * (1 - overall)).sum(-1).sum(-1)
    return MurphyDecomposition(reliability, resolution, uncertainty)


def murphy_decomposition(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary", "classwise"] = "classwise",
) -> MurphyDecomposition:
    """Murphy's decomposition of the binned Brier score: ``REL - RES + UNC``.

    ``kind="classwise"`` (default) decomposes the multiclass Brier score ``sum_k (q_k - [y = k])^2``
    (each class binned on its own ``q_k``); ``"top-label"`` and ``"binary"`` the Brier score of
    that one binary problem. Bins as ``functional.expected_calibration_error``.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> [round(float(v), 4) for v in murphy_decomposition(probs.log(), torch.tensor([0, 1, 1, 0]), n_bins=2)]
        [0.145, 0.0, 0.5]
    """
    if kind not in ("top-label", "binary", "classwise"):
        raise ValueError(f'kind must be "top-label", "binary" or "classwise", got {kind!r}.')
    binned = binned_scores(logits, labels, n_bins, strategy, kind)
    return murphy_from_bins(*bin_statistics(binned.scores, binned.targets, binned.edges, binned.tolerance))
