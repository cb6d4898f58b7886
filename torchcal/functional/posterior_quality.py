"""The common bundle of posterior-quality values in one call: cross-entropy, Brier, error rate, ECE.

``posterior_quality`` is the functional twin of ``torchcal.metrics.PosteriorQuality`` (which
computes the same values in one fused pass per batch).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels, check_priors
from torchcal.functional.decisions import error_rate
from torchcal.functional.diagnostics import expected_calibration_error
from torchcal.functional.scoring import (
    brier_score,
    class_frequencies,
    cross_entropy,
    naive_brier_score,
    naive_cross_entropy,
)

__all__ = ["STATISTICS", "PosteriorQualityResult", "Statistic", "posterior_quality"]

Statistic = Literal["cross_entropy", "nce", "brier", "nbs", "error_rate", "ece"]
STATISTICS: tuple[Statistic, ...] = get_args(Statistic)


class PosteriorQualityResult(NamedTuple):
    """Float64 scalars; ``._asdict()`` gives the dict ``PosteriorQuality.compute()`` returns."""

    cross_entropy: Tensor  # nats
    nce: Tensor  # cross-entropy / prior entropy
    brier: Tensor  # 0..2 scale
    nbs: Tensor  # Brier / the naive system's Brier
    error_rate: Tensor  # prior-weighted with priors
    ece: Tensor  # top-label, equal-width bins, not prior-weighted


def posterior_quality(
    logits: Tensor, labels: Tensor, n_bins: int = 15, priors: Tensor | None = None
) -> PosteriorQualityResult:
    """Cross-entropy, NCE, Brier, NBS, error rate and top-label ECE of ``softmax(logits)``.

    Each value is that of its own functional form (``cross_entropy``, ``brier_score``,
    ``error_rate`` and ``expected_calibration_error(n_bins=n_bins)``); the ECE is never
    prior-weighted. NCE and NBS are NaN where the naive system scores 0 (one class holds all the
    labels, or all the priors), as the metric's are; the other values are still defined there.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        n_bins: number of equal-width ECE bins.
        priors: optional (K,) deployment priors for the scores and the error rate.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> result = posterior_quality(probs.log(), torch.tensor([0, 1, 1, 1]), n_bins=10)
        >>> {name: round(float(value), 6) for name, value in result._asdict().items()}
        {'cross_entropy': 0.400367, 'nce': 0.711973, 'brier': 0.25, 'nbs': 0.666667, 'error_rate': 0.25, 'ece': 0.3}
    """
    logits, labels = check_logits_and_labels(logits, labels)
    if priors is not None:
        priors = check_priors(priors, logits.shape[1], device=logits.device)
    errors = error_rate(logits, labels, priors)
    naive_priors = class_frequencies(labels, logits.shape[1]) if priors is None else priors

    def normalized(score: Tensor, naive_score: Tensor) -> Tensor:
        return score / naive_score if bool(naive_score > 0) else torch.full_like(score, float("nan"))

    ce, brier = cross_entropy(logits, labels, priors), brier_score(logits, labels, priors)
    return PosteriorQualityResult(
        ce,
        normalized(ce, naive_cross_entropy(naive_priors)),
        brier,
        normalized(brier, naive_brier_score(naive_priors)),
        errors,
        expected_calibration_error(logits, labels, n_bins=n_bins),
    )
