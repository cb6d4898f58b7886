"""Selective prediction: the risk-coverage curve and its area (AURC; Geifman et al. 2018).

The classifier answers the fraction ``k / N`` of the samples it is most confident about (the
top-label probability) and abstains on the rest; the selective risk at that coverage is the error
rate of the answered samples. AURC is the mean of the risk over the coverages ``1/N, ..., N/N``.
Samples with equal confidence (to a relative 1.5e-11 in its log, so that rows of the same logits
in another order tie) are answered together or in random order, so at positions inside a group of
ties the number of errors is its expectation over the orders of the group: the curve and AURC do
not depend on the order of the rows. The answers are ``error_rate``'s decisions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels
from torchcal.functional.decisions import _first_maximal_decisions

__all__ = ["RiskCoverageCurve", "aurc", "risk_coverage_curve"]


class RiskCoverageCurve(NamedTuple):
    """Coverage and selective risk (T,) float64 at the end of each group of tied confidences."""

    coverage: Tensor
    risk: Tensor


def _confidence_key(logits: Tensor, predicted: Tensor) -> Tensor:
    """The log-posterior of each row's ``predicted`` class, ``-log1p(sum_{j != pred} exp(z_j -
    z_pred))`` in float64, rounded to 36 bits of mantissa (a relative 1.5e-11): (N,). Rows holding
    the same logits in another order differ in the last bits of that sum, which split their tie;
    rounded, they tie but for about one pair in 1e4 that straddles a step. Through ``log1p`` the
    sum keeps its relative precision, so confident rows (``q`` within 1e-12 of 1) stay apart."""
    z = logits.to(torch.float64)
    rest = torch.exp(z - z.gather(1, predicted.unsqueeze(1))).scatter_(1, predicted.unsqueeze(1), 0.0).sum(1)
    mantissa, exponent = torch.frexp(-torch.log1p(rest))
    return torch.ldexp(torch.round(mantissa * 2.0**36) / 2.0**36, exponent)


def _expected_errors(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Expected cumulative errors (N,) at positions 1..N (most confident first), and group ends."""
    logits, labels = check_logits_and_labels(logits, labels)
    predicted = _first_maximal_decisions(logits)  # (error_rate's decisions, near-ties included)
    confidence = _confidence_key(logits, predicted)
    order = confidence.argsort(descending=True, stable=True)
    ordered, errors = confidence[order], (predicted[order] != labels[order]).to(torch.float64)
    n = ordered.shape[0]
    new_group = torch.ones(n, dtype=torch.bool, device=ordered.device)
    new_group[1:] = ordered[1:] != ordered[:-1]
    group = new_group.cumsum(0) - 1
    num_groups = int(group[-1]) + 1
    sizes = torch.zeros(num_groups, dtype=torch.float64, device=ordered.device).index_add_(0, group, torch.ones_like(errors))
    group_errors = torch.zeros_like(sizes).index_add_(0, group, errors)
    errors_before = group_errors.cumsum(0) - group_errors
    start = sizes.cumsum(0) - sizes
    position = torch.arange(1, n + 1, dtype=torch.float64, device=ordered.device)
    expected = errors_before[group] + (position - start[group]) * group_errors[group] / sizes[group]
    last_of_group = torch.ones_like(new_group)
    last_of_group[:-1] = new_group[1:]
    return expected, last_of_group


def risk_coverage_curve(logits: Tensor, labels: Tensor) -> RiskCoverageCurve:
    """Selective risk against coverage, answering the most confident samples first.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> risk_coverage_curve(probs.log(), torch.tensor([0, 1, 1, 0]))
        RiskCoverageCurve(coverage=tensor([0.2500, 0.5000, 0.7500, 1.0000], dtype=torch.float64), risk=tensor([0.0000, 0.5000, 0.6667, 0.5000], dtype=torch.float64))
    """
    expected, last_of_group = _expected_errors(logits, labels)
    n = expected.shape[0]
    position = torch.arange(1, n + 1, dtype=torch.float64, device=expected.device)
    return RiskCoverageCurve(position[last_of_group] / n, expected[last_of_group] / position[last_of_group])


def aurc(logits: Tensor, labels: Tensor) -> Tensor:
    """Area under the risk-coverage curve: the mean selective risk over coverages ``k / N``.

    Lower is better; the error rate ``e`` of a classifier whose confidence does not rank its
    errors gives about ``e``, a perfect ranking ``e + (1 - e) log(1 - e)``.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> round(float(aurc(probs.log(), torch.tensor([0, 1, 1, 0]))), 4)
        0.4167
    """
    expected, _ = _expected_errors(logits, labels)
    position = torch.arange(1, expected.shape[0] + 1, dtype=torch.float64, device=expected.device)
    return (expected / position).mean()
