"""Consistency resampling: labels drawn from the model's own posteriors, i.e. under calibration.

- ``consistency_resampling_test``: the calibration test of Vaicenavicius et al. 2019 (the survey's
  Algorithm 1) with any metric of the library. The scores stay fixed; each of L resamples draws
  ``y_i ~ Categorical(q_i)`` for every sample and recomputes the metric, which gives its null
  distribution. The p-value ``(1 + #{phi_l >= phi}) / (L + 1)`` counts ties against H0 and is
  valid for any L (the survey's strict ``#{phi_l > phi} / L`` can be 0).

Two kinds of metric are evaluated for all resamples without calling them again:

- ``expected_calibration_error`` with equal-width bins: the scores and their bins do not depend on
  the labels, so each resample only adds its targets to the bins, O(N) whatever K;
- sums over samples (``cross_entropy``, ``brier_score``, ``bayes_risk``, ``error_rate``,
  ``balanced_error_rate``): their per-sample terms are tabulated for every possible label once (an
  (N, K) table, formed K labels at a time), and each resample gathers and sums them. Forming the
  table costs K evaluations of the metric, so it serves only when K < L.

Any other metric, a table beyond ``_MAX_TABLE_ELEMENTS``, or K >= L (e.g. L = 199 at K = 1,000)
calls the metric L times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchcal._validation import check_count, check_logits_and_labels, check_seed, seeded_generator
from torchcal.functional._ties import at_least
from torchcal.functional.bootstrap import CHUNK_ELEMENTS, float64_metric_value, metric_decomposition
from torchcal.functional.diagnostics import BinDecomposition, sums_by_key
from torchcal.functional.scoring import SumDecomposition, to_log_probs

__all__ = ["ResamplingTestResult", "consistency_resampling_test", "resample_labels"]

#: Largest table of per-label terms (elements) the vectorised null forms: 256 MB of float64.
_MAX_TABLE_ELEMENTS = 1 << 25


class ResamplingTestResult(NamedTuple):
    statistic: Tensor  # the metric on the observed labels
    p_value: Tensor  # (1 + #{null >= statistic}) / (L + 1)
    null_statistics: Tensor  # (L,) the metric on each set of resampled labels


def resample_labels(log_probs: Tensor, num_resamples: int, seed: int, chunk: int | None = None) -> Iterator[Tensor]:
    """Chunks (b, N) of labels drawn from ``Categorical(exp(log_probs))``, ``log_probs: (N, K)``.

    The uniform draws come from a CPU generator seeded with ``seed`` (the same labels on every
    device), one row of N per resample, so the labels do not depend on ``chunk``; they are
    inverted through the cumulative posteriors on the posteriors' device.

    Example:
        >>> log_probs = torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=torch.float64)
        >>> next(resample_labels(log_probs, 3, seed=0)).tolist()
        [[0, 1], [0, 1], [0, 1]]
    """
    n, k = log_probs.shape
    cumulative = log_probs.to(torch.float64).exp().cumsum(1)
    cumulative = cumulative / cumulative[:, -1:]  # the last edge is exactly 1
    generator = seeded_generator(seed)
    chunk = chunk or max(1, CHUNK_ELEMENTS // n)
    for start in range(0, num_resamples, chunk):
        size = min(chunk, num_resamples - start)
        uniform = torch.rand(size, n, generator=generator, dtype=torch.float64).to(log_probs.device)
        yield torch.searchsorted(cumulative, uniform.T.contiguous(), right=True).clamp_(max=k - 1).T


def consistency_resampling_test(
    metric_fn: Callable[..., Any],
    logits: Tensor,
    labels: Tensor,
    num_resamples: int = 1000,
    seed: int = 0,
    **metric_kwargs: Any,
) -> ResamplingTestResult:
    """Consistency-resampling test of calibration (Vaicenavicius et al. 2019) with any metric.

    Args:
        metric_fn: ``metric_fn(logits, labels, **metric_kwargs)`` returning a scalar where larger
            means less calibrated (an ECE, ``cross_entropy``, ``brier_score``, ``smooth_calibration_error``...).
        logits: (N, K) scores; any unnormalised log-posteriors. They are the null's posteriors.
        labels: (N,) the observed class indices.
        num_resamples: L.
        seed: seed of the label draws.
        **metric_kwargs: passed to ``metric_fn``.

    Example:
        >>> import torch
        >>> from functools import partial
        >>> from torchcal.functional import expected_calibration_error
        >>> logits = torch.randn(500, 3, generator=torch.Generator().manual_seed(0))
        >>> over_confident = 3 * logits  # labels drawn from softmax(logits), scores sharper
        >>> labels = torch.distributions.Categorical(logits=logits).sample()
        >>> result = consistency_resampling_test(expected_calibration_error, over_confident, labels, num_resamples=199)
        >>> float(result.p_value) < 0.01, result.null_statistics.shape
        (True, torch.Size([199]))
    """
    check_count(num_resamples, "num_resamples")
    seed = check_seed(seed)
    logits, labels = check_logits_and_labels(logits, labels)
    log_probs = to_log_probs(logits)
    terms = metric_decomposition(metric_fn, metric_kwargs)
    table = None
    # on the observed labels, outside the try: an error here (a bad option) is the metric's own
    if terms is not None:
        observed = terms(logits, labels, **metric_kwargs)
        statistic = observed.evaluate()
        if isinstance(observed, SumDecomposition):
            table = _label_table(terms, observed, logits, metric_kwargs, num_resamples)
    else:
        statistic = float64_metric_value(metric_fn(logits, labels, **metric_kwargs))
    try:
        if terms is not None and isinstance(observed, BinDecomposition):
            null = _binned_null(observed, log_probs, num_resamples, seed)
        elif table is not None:
            null = _summed_null(table, log_probs, num_resamples, seed)
        else:
            null = torch.stack(
                [
                    float64_metric_value(metric_fn(logits, drawn, **metric_kwargs))
                    for chunk in resample_labels(log_probs, num_resamples, seed)
                    for drawn in chunk
                ]
            )
    except ValueError as err:
        raise ValueError(
            f"the metric failed on labels resampled from the posteriors: {err} (a metric that weighs classes, "
            f"with priors or balanced, needs every class in every resample: use more samples, or a metric over samples)"
        ) from err
    exceed = at_least(null, statistic).sum(0).to(torch.float64)  # (ties, up to round-off, count against H0)
    return ResamplingTestResult(statistic, (1 + exceed) / (num_resamples + 1), null)


class _LabelTable(NamedTuple):
    """A sum-decomposable metric's terms for every (sample, label) pair: ``per_label`` holds their
    (N, K) values; ``like`` is the observed labels' decomposition, for its ``reduce`` (which
    depends on the metric's options only)."""

    like: SumDecomposition
    per_label: Tensor


def _label_table(
    terms_fn: Callable[..., SumDecomposition | BinDecomposition], observed: SumDecomposition, logits: Tensor,
    metric_kwargs: dict[str, Any], num_resamples: int,
) -> _LabelTable | None:
    """The terms of every label, K labellings at a time: labelling j gives sample i the label
    ``(i + j) mod K``, so every class is present in each (class-weighted metrics need that) and
    nothing of size N K x K is formed. None when N < K, when the K labellings cost at least what
    the ``num_resamples`` resamples they would save do (K >= L), or when the table would exceed
    ``_MAX_TABLE_ELEMENTS``: the caller then loops over the resamples."""
    n, k = logits.shape
    samples = torch.arange(n, device=logits.device)
    if n < k or k >= num_resamples or n * k > _MAX_TABLE_ELEMENTS:
        return None
    table = torch.empty(n, k, dtype=torch.float64, device=logits.device)
    for j in range(k):
        labelling = (samples + j) % k
        terms = terms_fn(logits, labelling, **metric_kwargs)
        assert isinstance(terms, SumDecomposition)
        table[samples, labelling] = terms.per_sample.to(torch.float64)
    return _LabelTable(observed, table)


def _summed_null(table: _LabelTable, log_probs: Tensor, num_resamples: int, seed: int) -> Tensor:
    """The metric on every set of resampled labels, gathered from the table of its terms."""
    n, k = log_probs.shape
    like, per_label = table
    samples = torch.arange(n, device=log_probs.device)
    replicates = []
    for drawn in resample_labels(log_probs, num_resamples, seed):
        picked = per_label[samples, drawn]  # (b, N)
        sums = picked.new_zeros(drawn.shape[0], k).scatter_add_(1, drawn, picked)
        totals = picked.new_zeros(drawn.shape[0], k).scatter_add_(1, drawn, torch.ones_like(picked))
        replicates.append(like.reduce(sums, totals))
    return torch.cat(replicates)


def _binned_null(observed: BinDecomposition, log_probs: Tensor, num_resamples: int, seed: int) -> Tensor:
    """A binned metric on every set of resampled labels. Only the targets' sums change: a drawn
    label sets the target of the one column that tests its class, if any (``classes``), so each
    resample costs O(N) whatever K (at 50,000 x 1,000 the metric itself, called per resample, took
    about a second each)."""
    n = log_probs.shape[0]
    num_columns, n_bins = observed.shape
    counts, score_sums, _ = sums_by_key(observed.keys, observed.scores, observed.targets, num_columns * n_bins)
    samples = torch.arange(n, device=log_probs.device)
    replicates = []
    chunk = max(1, CHUNK_ELEMENTS // max(n, num_columns * n_bins))  # (b, N) labels, (b, C M) sums
    for drawn in resample_labels(log_probs, num_resamples, seed, chunk):
        if num_columns == 1:
            keys, hits = observed.keys[:, 0].expand_as(drawn), observed.classes[:, 0] == drawn
        else:  # column k tests class k
            keys, hits = observed.keys[samples, drawn], torch.ones_like(drawn, dtype=torch.bool)
        target_sums = torch.zeros(drawn.shape[0], num_columns * n_bins, dtype=torch.float64, device=log_probs.device)
        target_sums.scatter_add_(1, keys, hits.to(torch.float64))
        shape = (drawn.shape[0], num_columns, n_bins)
        replicates.append(observed.reduce(counts.view(1, num_columns, n_bins).expand(shape),
                                          score_sums.view(1, num_columns, n_bins).expand(shape), target_sums.view(shape)))
    return torch.cat(replicates)
