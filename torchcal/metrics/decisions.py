"""Streaming expected cost of hard decisions and of Bayes decisions, and the error rates.

State: the class-by-decision count matrix (K, M) float64, from which the expected cost is
computed with any priors at ``compute()`` (``torchcal.functional.decisions.expected_cost_from_counts``);
the error rates keep per-class error and sample counts (K,).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchcal._validation import as_tensor, check_costs, check_priors
from torchcal.functional.decisions import (
    _bayes_decisions,
    check_decisions,
    check_every_class_counted,
    decision_counts,
    errors_per_sample,
    expected_cost_from_counts,
    is_zero_one_costs,
)
from torchcal.functional.scoring import class_sums, prior_weighted_mean
from torchcal.metrics._common import BatchMetric, ScoreMetric, add_sum_state, check_num_classes

__all__ = ["BalancedErrorRate", "BayesRisk", "ErrorRate", "ExpectedCost"]


class _CostMetric(BatchMetric):
    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0

    num_classes: int | None  # set from the costs; "| None" as in ScoreMetric, which BayesRisk also is
    costs: Tensor
    priors: Tensor | None
    counts: Tensor

    # ExpectedCost's counts do not depend on the costs (BayesRisk's decisions do: see there)
    _compute_only_options: tuple[str, ...] = ("costs", "priors", "normalize")

    def __init__(
        self, costs: Tensor, priors: Tensor | None = None, normalize: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        costs = as_tensor(costs, "costs")
        if costs.ndim == 2 and costs.shape[0] < 2:  # (a K = 1 metric would read 0 whatever it is given)
            raise ValueError(f"costs must have one row per class, K >= 2 rows; got shape {tuple(costs.shape)}.")
        costs = check_costs(costs, costs.shape[0] if costs.ndim else 0)
        self.num_classes, self.num_decisions = costs.shape
        self.register_buffer("costs", costs, persistent=False)
        self.register_buffer("priors", None if priors is None else check_priors(priors, self.num_classes), persistent=False)
        self.normalize = normalize
        add_sum_state(self, "counts", self.num_classes, self.num_decisions)

    def _accumulate(self, decisions: Tensor, labels: Tensor) -> None:
        self.counts += decision_counts(decisions, labels, *self.costs.shape).to(self.counts.device)

    def compute(self) -> Tensor:
        """The expected cost, a float64 scalar."""
        return expected_cost_from_counts(self.counts, self.costs, self.priors, self.normalize)


class ExpectedCost(_CostMetric):
    """Expected cost of hard decisions (NEC with ``normalize=True``), as ``functional.expected_cost``.

    ``update(decisions, labels)`` takes decision indices (N,) in [0, M) and labels (N,) in [0, K)
    (or both (N, d1, ...)). ``counts`` holds the (K, M) class-by-decision confusion counts.

    Args:
        costs: (K, M) cost matrix, rows true classes, columns decisions.
        priors: optional (K,) deployment priors; empirical class frequencies by default.
        normalize: divide by the cost of the best naive decision.
        ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = ExpectedCost(torch.tensor([[0, 1, .5], [1, 0, .5]]), normalize=True)
        >>> metric.update(torch.tensor([0, 1, 0]), torch.tensor([0, 1, 0]))
        >>> metric.update(torch.tensor([0, 2, 2]), torch.tensor([0, 1, 0]))
        >>> float(metric.compute())
        0.5
    """

    def update(self, decisions: Tensor, labels: Tensor) -> None:
        """Accumulate ``decisions`` and ``labels``, both (N,) or (N, d1, ...)."""
        batch = self._flattened(decisions, labels)
        if batch is None:
            return
        decisions, labels = batch
        if self.validate_args:
            decisions, labels, _ = check_decisions(decisions, labels, self.costs)
        self._accumulate(decisions, labels)


class BayesRisk(_CostMetric, ScoreMetric):
    """Expected cost of the Bayes decisions of the scores, as ``functional.bayes_risk``.

    ``update(scores, labels)`` takes scores (N, K) and labels (N,) (or (N, K, d1, ...) and
    (N, d1, ...)); the decisions minimise the expected cost under ``softmax(logits)`` (ties to the
    lowest decision index).

    Args:
        costs: (K, M) cost matrix.
        priors: optional (K,) deployment priors for the evaluation.
        normalize: divide by the cost of the best naive decision.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> from torchcal.functional import zero_one_costs
        >>> metric = BayesRisk(zero_one_costs(2))
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric.update(probs.log(), torch.tensor([0, 1, 1, 1]))
        >>> float(metric.compute())
        0.25
    """

    _compute_only_options: tuple[str, ...] = ("priors", "normalize")  # the decisions depend on the costs

    def __init__(self, costs: Tensor, priors: Tensor | None = None, normalize: bool = False, **kwargs: Any) -> None:
        super().__init__(costs, priors, normalize, **kwargs)
        self._zero_one = is_zero_one_costs(self.costs)  # (once: every batch's logits are checked, not the costs)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        if logits.shape[1] != self.num_classes:
            raise ValueError(f"{type(self).__name__} has costs for {self.num_classes} classes, but the scores have {logits.shape[1]}.")
        self._accumulate(_bayes_decisions(logits, self.costs.to(torch.float64), self._zero_one), labels)


class ErrorRate(ScoreMetric):
    """Fraction of samples whose first maximal posterior is not the label, as ``functional.error_rate``.

    The Bayes risk under 0-1 costs; ``priors`` re-weight the classes. State: per-class error and
    sample counts, (K,) float64 each (not a (K, K) confusion matrix: O(K) at any K).

    Args:
        num_classes: K.
        priors: optional (K,) deployment priors; empirical class frequencies by default.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = ErrorRate(num_classes=2)
        >>> metric.update(torch.tensor([[2., 0.], [0., 1.], [1., 1.]]), torch.tensor([0, 0, 1]))
        >>> round(float(metric.compute()), 6)
        0.666667
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    num_classes: int
    priors: Tensor | None
    class_errors: Tensor
    class_counts: Tensor

    _compute_only_options = ("priors",)

    def __init__(self, num_classes: int, priors: Tensor | None = None, **kwargs: Any) -> None:
        super().__init__(check_num_classes(num_classes), **kwargs)
        self.register_buffer("priors", None if priors is None else check_priors(priors, self.num_classes), persistent=False)
        add_sum_state(self, "class_errors", self.num_classes)
        add_sum_state(self, "class_counts", self.num_classes)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        errors, counts = class_sums(errors_per_sample(logits, labels), labels, self.num_classes)
        self.class_errors += errors
        self.class_counts += counts

    def compute(self) -> Tensor:
        """The error rate, a float64 scalar."""
        return prior_weighted_mean(self.class_errors, self.class_counts, self.priors)


class BalancedErrorRate(ErrorRate):
    """Mean over classes of the per-class error rate, as ``functional.balanced_error_rate``.

    ``ErrorRate`` with uniform priors: every class needs a sample by ``compute()``, except a class
    that ``ignore_index`` leaves out (a label in [0, K) of a segmentation's "void" class, say),
    which has none: the mean is over the other classes (prior 0 for it).

    Example:
        >>> import torch
        >>> metric = BalancedErrorRate(num_classes=2)
        >>> metric.update(torch.tensor([[2., 0.], [0., 1.], [3., 0.], [0., 2.]]), torch.tensor([0, 0, 0, 1]))
        >>> round(float(metric.compute()), 6)
        0.166667
    """

    def __init__(self, num_classes: int, **kwargs: Any) -> None:
        priors = torch.ones(check_num_classes(num_classes), dtype=torch.float64)
        ignored = kwargs.get("ignore_index")
        if isinstance(ignored, int) and not isinstance(ignored, bool) and 0 <= ignored < num_classes:
            priors[ignored] = 0
        super().__init__(num_classes, priors / priors.sum(), **kwargs)

    def compute(self) -> Tensor:
        """The balanced error rate, a float64 scalar."""
        assert self.priors is not None  # (uniform over the classes it averages)
        check_every_class_counted(self.class_counts, self.priors)
        return super().compute()
