"""Expected cost of hard decisions, Bayes decisions and the Bayes risk (Ferrer, §2–3).

A cost matrix ``costs: (K, M)`` has one row per true class and one column per decision;
``M > K`` is allowed (e.g. an "abstain" column). With class priors ``P`` (the empirical class
frequencies unless given) and ``R[i, j]`` the fraction of class ``i`` that received decision ``j``,

    EC  = sum_ij costs[i, j] * P[i] * R[i, j]
    NEC = EC / min_j sum_i costs[i, j] * P[i]

where the denominator is the cost of the best naive system, the one that always makes the same
decision. EC is the prior-weighted mean of the per-sample cost ``costs[y_t, d_t]``, so it is
computed, like the scoring rules, from per-class sums (``scoring.class_sums``).

Bayes decisions minimise the expected cost under the posteriors: ``argmin_j (q @ costs)[j]``.
Ties go to the lowest decision index (with 0-1 costs: the first maximal posterior); expected
costs within the round-off of the product are tied.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor

from torchcal._validation import (
    as_tensor,
    check_costs,
    check_count,
    check_labels,
    check_logits,
    check_logits_and_labels,
    check_priors,
    name_classes,
)
from torchcal.functional.scoring import SumDecomposition, prior_weighted_mean

__all__ = [
    "balanced_error_rate",
    "balanced_error_rate_terms",
    "bayes_decisions",
    "bayes_risk",
    "bayes_risk_terms",
    "check_decisions",
    "decision_counts",
    "error_rate",
    "error_rate_terms",
    "errors_per_sample",
    "expected_cost",
    "expected_cost_from_class_sums",
    "expected_cost_from_counts",
    "expected_cost_terms",
    "is_zero_one_costs",
    "zero_one_costs",
]

_EPS = torch.finfo(torch.float64).eps


def zero_one_costs(num_classes: int, abstain: float | None = None) -> Tensor:
    """The 0-1 cost matrix (K, K), or (K, K + 1) with a last "abstain" column costing ``abstain``.

    Example:
        >>> zero_one_costs(2, abstain=0.1)
        tensor([[0.0000, 1.0000, 0.1000],
                [1.0000, 0.0000, 0.1000]], dtype=torch.float64)
    """
    check_count(num_classes, "num_classes", 2)
    costs = torch.ones(num_classes, num_classes, dtype=torch.float64).fill_diagonal_(0)  # (one K x K buffer)
    if abstain is None:
        return costs
    if not 0 <= abstain < math.inf:
        raise ValueError(f"abstain must be a finite, non-negative cost, got {abstain}.")
    return torch.cat([costs, torch.full((num_classes, 1), float(abstain), dtype=torch.float64)], dim=1)


def bayes_decisions(logits: Tensor, costs: Tensor) -> Tensor:
    """Decisions (N,) int64 minimising the expected cost ``softmax(logits) @ costs`` (N, M).

    Ties go to the lowest decision index; decisions whose expected costs differ by no more than the
    round-off of the product are tied. The posteriors are used as they are: to decide for
    deployment priors ``P_new`` when the scores carry training priors ``P_train``, shift the
    logits first, ``logits + log(P_new) - log(P_train)`` (Ferrer, eq. 45).

    With the 0-1 costs of ``zero_one_costs(K)`` the decision is the first maximal logit, near ties
    included, found without the (N, K) @ (K, K) product (see ``_first_maximal_decisions``).

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        costs: (K, M) cost matrix, rows true classes, columns decisions.

    Example:
        >>> import torch
        >>> probs = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]])
        >>> bayes_decisions(probs.log(), zero_one_costs(2))
        tensor([0, 0, 1])
        >>> bayes_decisions(probs.log(), zero_one_costs(2, abstain=0.2))  # abstain = decision 2
        tensor([2, 2, 1])
    """
    logits = check_logits(logits)
    return _bayes_decisions(logits, check_costs(costs, logits.shape[1], device=logits.device))


def _bayes_decisions(logits: Tensor, costs: Tensor, zero_one: bool | None = None) -> Tensor:
    """``bayes_decisions`` of valid ``logits: (N, K)`` and float64 ``costs: (K, M)``; ``zero_one``:
    whether they are ``zero_one_costs(K)``, if known (the test builds a second (K, K) matrix)."""
    if is_zero_one_costs(costs) if zero_one is None else zero_one:
        return _first_maximal_decisions(logits)
    return _least_cost_decisions(logits, costs)


def is_zero_one_costs(costs: Tensor) -> bool:
    """Whether ``costs: (K, M)`` is the 0-1 cost matrix ``zero_one_costs(K)``, exactly.

    Example:
        >>> is_zero_one_costs(zero_one_costs(3)), is_zero_one_costs(2 * zero_one_costs(3))
        (True, False)
    """
    num_classes, num_decisions = costs.shape
    # (without a second K x K matrix: at K = 20,000 each is 3.2 GB)
    return (num_classes == num_decisions and bool((costs.diagonal() == 0).all())
            and int(torch.count_nonzero(costs == 1)) == num_classes * (num_classes - 1))


def _least_cost_decisions(logits: Tensor, costs: Tensor) -> Tensor:
    """``bayes_decisions`` of valid ``logits: (N, K)`` and float64 ``costs: (K, M)``, by the product."""
    risk = torch.softmax(logits, dim=1, dtype=torch.float64) @ costs
    # The round-off of the product can split exact ties (tied low-precision logits) either way:
    # decisions within it of the minimum are tied, and the lowest index among them is taken. A sum
    # of K non-negative terms is off by at most K eps of itself, so the slack of a pair is that of
    # the two risks compared (of the row's largest, a decision never worth taking widened it for
    # all: a column of cost 1e4 flipped decisions 5e-12 apart in expected cost).
    best = risk.amin(dim=1, keepdim=True)
    return (risk - best <= logits.shape[1] * _EPS * (risk + best)).to(torch.uint8).argmax(dim=1)


def _first_maximal_decisions(logits: Tensor) -> Tensor:
    """``_least_cost_decisions(logits, zero_one_costs(K))`` of ``logits: (N, K)``, without the product.

    Under 0-1 costs the expected cost of decision j is ``1 - q_j``, so the product's slack ties j
    with the best decision when ``q_max - q_j <= K eps (2 - q_j - q_max)``. With ``e = exp(z - max z)``
    (1 at the maximum) and ``q = e / sum(e)``, that is ``1 - e_j <= K eps (2 sum(e) - e_j - 1)``: a
    gap below the maximal logit of at most about 2 K eps sum(e) <= 2 K^2 eps. The gap is
    absolute, whatever the logits' magnitude (the posteriors do not change when every logit of a
    row is shifted). So the decision is the first maximal logit unless a logit before it lies
    within ``2 K^2 eps`` of the maximum; only those rows are decided by the rule above, in float64.
    The product's own round-off can tie or split logits that differ by about the slack (within a
    factor of 2 of it); elsewhere both give the same decisions.
    """
    top = logits.amax(dim=1, keepdim=True)
    near = logits >= _rounded_down(top.double() - 2 * logits.shape[1] ** 2 * _EPS, logits.dtype)
    decisions = near.view(torch.uint8).argmax(dim=1)  # the first logit near the maximum
    # it is the first maximal logit, unless it lies below the maximum
    rows = (logits.gather(1, decisions.unsqueeze(1)) < top).squeeze(1).nonzero().squeeze(1)
    if rows.numel():
        decisions[rows] = _first_near_maximal(logits[rows])
    return decisions


def _rounded_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The largest values of ``dtype`` that are <= the float64 values ``x``."""
    rounded = x.to(dtype)
    below = torch.nextafter(rounded, torch.tensor(-math.inf, dtype=dtype, device=x.device))
    return torch.where(rounded.double() > x, below, rounded)


def _first_near_maximal(logits: Tensor) -> Tensor:
    """The first logit of each row of ``logits: (N, K)`` that the 0-1 slack ties with the maximum
    (``1 - e_j <= K eps (2 sum(e) - e_j - 1)``, see ``_first_maximal_decisions``); (N,) int64."""
    z = logits.detach().double()
    e = (z - z.amax(dim=1, keepdim=True)).exp_()
    slack = z.shape[1] * _EPS * (2 * e.sum(dim=1, keepdim=True) - e - 1)
    return (1 - e <= slack).view(torch.uint8).argmax(dim=1)


def expected_cost_from_class_sums(
    sums: Tensor,
    counts: Tensor,
    costs: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> Tensor:
    """EC (or NEC) from per-class sums of the per-sample cost and per-class counts (..., K).

    Raises ``ValueError`` for NEC when the best naive system costs 0 (nothing to normalise by).

    Example (per-class sums 1 and 0.5 over 4 and 2 samples):
        >>> sums, counts = torch.tensor([1.0, 0.5]), torch.tensor([4.0, 2.0])
        >>> float(expected_cost_from_class_sums(sums, counts, zero_one_costs(2), priors=torch.tensor([.5, .5])))
        0.25
    """
    ec = prior_weighted_mean(sums, counts, priors)
    if not normalize:
        return ec
    reference = counts / counts.sum(-1, keepdim=True) if priors is None else check_priors(
        priors, sums.shape[-1], device=sums.device
    )
    # (in float64: a metric's set_dtype may have cast its cost and prior buffers to float32)
    naive = (reference.to(torch.float64) @ costs.to(torch.float64)).amin(-1)  # the cheapest constant decision
    if bool((naive <= 0).any()):
        raise ValueError(
            "the best naive decision has zero expected cost under these costs and priors, so the "
            "normalised expected cost is undefined; use normalize=False or check the cost matrix."
        )
    return ec / naive


def check_decisions(decisions: Tensor, labels: Tensor, costs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate ``decisions: (N,)`` in [0, M), ``labels: (N,)`` in [0, K) and ``costs: (K, M)``.

    Returns them on the labels' device, the costs in float64.

    Example:
        >>> check_decisions(torch.tensor([0, 2]), torch.tensor([1, 0]), zero_one_costs(2, abstain=0.1))[0]
        tensor([0, 2])
        >>> check_decisions(torch.tensor([0, 3]), torch.tensor([1, 0]), zero_one_costs(2, abstain=0.1))
        Traceback (most recent call last):
        ...
        ValueError: decisions must lie in [0, 3) for M = 3 decisions; found 1 out-of-range value(s), e.g. 3.
    """
    costs = check_costs(costs, None)
    labels = as_tensor(labels, "labels")
    labels = check_labels(labels, labels.shape[0] if labels.ndim == 1 else labels.numel(), costs.shape[0])
    if labels.shape[0] == 0:
        raise ValueError("labels are empty (N = 0): at least one sample is needed.")
    decisions = check_labels(decisions, labels.shape[0], costs.shape[1], name="decisions", counted="decisions",
                             samples="there are N = {} labels")
    return decisions.to(labels.device), labels, costs.to(labels.device)


def decision_counts(decisions: Tensor, labels: Tensor, num_classes: int, num_decisions: int) -> Tensor:
    """Class-by-decision counts ``N[i, j] = #{t : y_t = i, d_t = j}``; (K, M) float64.

    Example:
        >>> decision_counts(torch.tensor([0, 2, 1]), torch.tensor([0, 0, 1]), 2, 3)
        tensor([[1., 0., 1.],
                [0., 1., 0.]], dtype=torch.float64)
    """
    flat = labels * num_decisions + decisions
    # index_add_ rather than bincount, which reads the largest index back to the host on a GPU
    counts = torch.zeros(num_classes * num_decisions, dtype=torch.float64, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64)).reshape(num_classes, num_decisions)


def expected_cost_from_counts(
    counts: Tensor, costs: Tensor, priors: Tensor | None = None, normalize: bool = False
) -> Tensor:
    """EC (or NEC) from class-by-decision ``counts: (..., K, M)`` (see ``decision_counts``).

    Example (Ferrer's micro test: EC = 1/6, NEC = 1/2):
        >>> counts = torch.tensor([[3., 0., 1.], [0., 1., 1.]], dtype=torch.float64)
        >>> costs = torch.tensor([[0, 1, .5], [1, 0, .5]], dtype=torch.float64)
        >>> float(expected_cost_from_counts(counts, costs, normalize=True))
        0.5
    """
    return expected_cost_from_class_sums((counts * costs).sum(-1), counts.sum(-1), costs, priors, normalize)


def expected_cost_terms(
    decisions: Tensor,
    labels: Tensor,
    costs: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> SumDecomposition:
    """Validate the inputs of ``expected_cost`` and return its ``SumDecomposition``.

    The per-sample value is the cost ``costs[labels[t], decisions[t]]``.

    Example:
        >>> terms = expected_cost_terms(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), zero_one_costs(2))
        >>> terms.per_sample, round(float(terms.evaluate()), 6)
        (tensor([0., 1., 0.], dtype=torch.float64), 0.333333)
    """
    decisions, labels, costs = check_decisions(decisions, labels, costs)
    if priors is not None:
        priors = check_priors(priors, costs.shape[0], device=costs.device)
    reduce = partial(expected_cost_from_class_sums, costs=costs, priors=priors, normalize=normalize)
    return SumDecomposition(costs[labels, decisions], labels, costs.shape[0], reduce)


def expected_cost(
    decisions: Tensor,
    labels: Tensor,
    costs: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> Tensor:
    """Expected cost EC of hard decisions, or NEC with ``normalize=True`` (Ferrer, eq. 4–6).

    Args:
        decisions: (N,) decision indices in [0, M).
        labels: (N,) class indices in [0, K).
        costs: (K, M) cost matrix, rows true classes, columns decisions.
        priors: optional (K,) deployment priors; the default is the empirical class frequencies.
        normalize: divide by the cost of the best naive system ``min_j sum_i costs[i, j] P[i]``
            (NEC); ``ValueError`` if that is 0. The costs are used as given: a constant added to
            a class's row raises the system's and the naive system's costs alike, so the NEC of
            costs whose rows have no zero differs from psrcal's, which subtracts each row's
            minimum first (do that to compare).

    Example (Ferrer's micro test):
        >>> import torch
        >>> labels = torch.tensor([0, 1, 0, 0, 1, 0])
        >>> decisions = torch.tensor([0, 1, 0, 0, 2, 2])
        >>> costs = torch.tensor([[0, 1, .5], [1, 0, .5]])
        >>> round(float(expected_cost(decisions, labels, costs)), 6)
        0.166667
        >>> float(expected_cost(decisions, labels, costs, normalize=True))
        0.5
    """
    return expected_cost_terms(decisions, labels, costs, priors, normalize).evaluate()


def bayes_risk_terms(
    logits: Tensor,
    labels: Tensor,
    costs: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> SumDecomposition:
    """``expected_cost_terms`` of the Bayes decisions of ``logits``.

    Example:
        >>> terms = bayes_risk_terms(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([1, 1]), zero_one_costs(2))
        >>> terms.per_sample
        tensor([1., 0.], dtype=torch.float64)
    """
    return _bayes_risk_terms(*check_logits_and_labels(logits, labels), costs, priors, normalize)


def _bayes_risk_terms(logits: Tensor, labels: Tensor, costs: Tensor, priors: Tensor | None = None,
                      normalize: bool = False) -> SumDecomposition:
    """``bayes_risk_terms`` of valid ``logits`` and ``labels``: validated once, at the entry point."""
    costs = check_costs(costs, logits.shape[1], device=logits.device)
    return expected_cost_terms(_bayes_decisions(logits, costs), labels, costs, priors, normalize)


def bayes_risk(
    logits: Tensor,
    labels: Tensor,
    costs: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> Tensor:
    """Expected cost of the Bayes decisions of ``logits`` (Ferrer's EC~, a proper scoring rule).

    ``priors`` weight the classes in the evaluation; the decisions use the posteriors as they are
    (see ``bayes_decisions``).

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        costs: (K, M) cost matrix.
        priors: optional (K,) deployment priors for the evaluation.
        normalize: divide by the cost of the best naive system (the costs as given: see
            :func:`expected_cost`).

    Example:
        >>> import torch
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> labels = torch.tensor([0, 1, 1, 1])
        >>> float(bayes_risk(probs.log(), labels, zero_one_costs(2)))
        0.25
        >>> float(bayes_risk(probs.log(), labels, zero_one_costs(2), normalize=True))
        1.0
    """
    return bayes_risk_terms(logits, labels, costs, priors, normalize).evaluate()


def error_rate(logits: Tensor, labels: Tensor, priors: Tensor | None = None) -> Tensor:
    """Fraction of samples whose first maximal posterior is not the true class (the per-class
    fractions weighted by ``priors``, if given).

    The Bayes risk under 0-1 costs (``bayes_risk(..., zero_one_costs(K), priors)``), computed
    without the (K, K) cost matrix: O(N K) work and memory at any K.

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2., 0.], [0., 1.], [1., 1.]])
        >>> round(float(error_rate(logits, torch.tensor([0, 0, 1]))), 6)
        0.666667
    """
    return error_rate_terms(logits, labels, priors).evaluate()


def error_rate_terms(logits: Tensor, labels: Tensor, priors: Tensor | None = None) -> SumDecomposition:
    """``SumDecomposition`` of ``error_rate``.

    Example:
        >>> error_rate_terms(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([1, 1])).per_sample
        tensor([1., 0.], dtype=torch.float64)
    """
    logits, labels = check_logits_and_labels(logits, labels)
    if priors is not None:
        priors = check_priors(priors, logits.shape[1], device=logits.device)
    return _error_rate_terms(logits, labels, priors)


def _error_rate_terms(logits: Tensor, labels: Tensor, priors: Tensor | None) -> SumDecomposition:
    """``error_rate_terms`` of valid ``logits``, ``labels`` and ``priors``."""
    return SumDecomposition(errors_per_sample(logits, labels), labels, logits.shape[1], partial(prior_weighted_mean, priors=priors))


def errors_per_sample(logits: Tensor, labels: Tensor) -> Tensor:
    """1 where the first maximal posterior of valid ``logits: (N, K)`` is not ``labels: (N,)``,
    else 0; (N,) float64: the per-sample cost of the Bayes decisions under ``zero_one_costs(K)``."""
    return (_first_maximal_decisions(logits) != labels).to(torch.float64)


def balanced_error_rate(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean over classes of the per-class error rate: the 0-1 Bayes risk with uniform priors.

    Every class must have at least one sample (``ValueError`` naming those without).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[2., 0.], [0., 1.], [3., 0.], [0., 2.]])
        >>> float(balanced_error_rate(logits, torch.tensor([0, 0, 0, 1])))  # (1/3 + 0) / 2
        0.16666666666666666
    """
    return balanced_error_rate_terms(logits, labels).evaluate()


def balanced_error_rate_terms(logits: Tensor, labels: Tensor) -> SumDecomposition:
    """``SumDecomposition`` of ``balanced_error_rate``.

    Example:
        >>> terms = balanced_error_rate_terms(torch.tensor([[2., 0.], [0., 1.], [1., 0.]]), torch.tensor([1, 1, 0]))
        >>> float(terms.evaluate())  # class 0: 0 errors of 1, class 1: 1 of 2
        0.25
    """
    logits, labels = check_logits_and_labels(logits, labels)
    num_classes = logits.shape[1]
    check_every_class_counted(torch.bincount(labels, minlength=num_classes), torch.ones(num_classes))
    uniform = torch.full((num_classes,), 1 / num_classes, dtype=torch.float64, device=logits.device)
    return _error_rate_terms(logits, labels, uniform)


def check_every_class_counted(counts: Tensor, averaged: Tensor) -> None:
    """Raise unless every class the balanced error rate averages (``averaged: (K,)``, positive)
    has a sample among ``counts: (K,)`` (the generic message offers priors, which it takes none of)."""
    missing = ((counts == 0) & (averaged.to(counts.device) > 0)).nonzero().flatten().tolist()
    if missing:
        raise ValueError(
            f"the balanced error rate averages the error rate of every class, but {name_classes(missing)} "
            f"{'have' if len(missing) > 1 else 'has'} no sample: add samples, "
            f"or leave {'their columns' if len(missing) > 1 else 'its column'} out of the scores (a metric's "
            f"ignore_index leaves out one class in [0, K))."
        )
