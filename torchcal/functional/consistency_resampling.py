"""Consistency resampling: labels drawn from the model's own posteriors, i.e. under calibration.

- ``consistency_resampling_test``: the calibration test of Vaicenavicius et al. 2019 (the survey's
  Algorithm 1) with any metric of the library. The scores stay fixed; each of L resamples draws
  ``y_i ~ Categorical(q_i)`` for every sample and recomputes the metric, which gives its null
  distribution. The p-value ``(1 + #{phi_l >= phi}) / (L + 1)`` counts ties against H0 and is
  valid for any L (the survey's strict ``#{phi_l > phi} / L`` can be 0).

Metrics that are sums over samples (``cross_entropy``, ``brier_score``, ``bayes_risk``,
``error_rate``, ``balanced_error_rate``, and ``expected_calibration_error`` with equal-width bins)
are evaluated for all resamples at once: their per-sample terms are tabulated for every possible
label once, and each resample only gathers and sums them. Any other metric is called L times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchcal._validation import check_logits_and_labels
from torchcal.functional.bootstrap import CHUNK_ELEMENTS, float64_metric_value, metric_decomposition
from torchcal.functional.diagnostics import BinDecomposition, sums_by_key
from torchcal.functional.scoring import SumDecomposition, to_log_probs

__all__ = ["ResamplingTestResult", "consistency_resampling_test", "resample_labels"]


class ResamplingTestResult(NamedTuple):
    statistic: Tensor  # the metric on the observed labels
    p_value: Tensor  # (1 + #{null >= statistic}) / (L + 1)
    null_statistics: Tensor  # (L,) the metric on each set of resampled labels


def resample_labels(log_probs: Tensor, num_resamples: int, seed: int, chunk: int | None = None) -> Iterator[Tensor]:
    """Chunks (b, N) of labels drawn from ``Categorical(exp(log_probs))``, ``log_probs: (N, K)``.

    The uniform draws come from a CPU generator seeded with ``seed`` (the same labels on every
    device) and are inverted through the cumulative posteriors on the posteriors' device.

    Example:
        >>> log_probs = torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=torch.float64)
        >>> next(resample_labels(log_probs, 3, seed=0)).tolist()
        [[0, 1], [0, 1], [0, 1]]
    """
    n, k = log_probs.shape
    cumulative = log_probs.to(torch.float64).exp().cumsum(1)
    cumulative = cumulative / cumulative[:, -1:]  # the last edge is exactly 1
    generator = torch.Generator().manual_seed(seed)
    chunk = chunk or max(1, CHUNK_ELEMENTS // n)
    for start in range(0, num_resamples, chunk):
        size = min(chunk, num_resamples - start)
        uniform = torch.rand(n, size, generator=generator, dtype=torch.float64).to(log_probs.device)
        yield torch.searchsorted(cumulative, uniform, right=True).clamp_(max=k - 1).T


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
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, int) or num_resamples < 1:
        raise ValueError(f"num_resamples must be a positive integer, got {num_resamples!r}.")
    logits, labels = check_logits_and_labels(logits, labels)
    log_probs = to_log_probs(logits)
    terms = metric_decomposition(metric_fn, metric_kwargs)
    if terms is not None:
        statistic = terms(logits, labels, **metric_kwargs).evaluate()
        null = _vectorised_null(terms, logits, log_probs, num_resamples, seed, metric_kwargs)
    else:
        statistic = float64_metric_value(metric_fn(logits, labels, **metric_kwargs))
        null = torch.stack(
            [
                float64_metric_value(metric_fn(logits, drawn, **metric_kwargs))
                for chunk in resample_labels(log_probs, num_resamples, seed)
                for drawn in chunk
            ]
        )
    exceed = (null >= statistic).sum(0).to(torch.float64)
    return ResamplingTestResult(statistic, (1 + exceed) / (num_resamples + 1), null)


def _vectorised_null(
    terms_fn: Callable[..., SumDecomposition | BinDecomposition],
    logits: Tensor,
    log_probs: Tensor,
    num_resamples: int,
    seed: int,
    metric_kwargs: dict[str, Any],
) -> Tensor:
    """The metric on every set of resampled labels, from a table of its terms for every label."""
    n, k = logits.shape
    every_label = torch.arange(k, device=logits.device).repeat(n)
    table = terms_fn(logits.repeat_interleave(k, 0), every_label, **metric_kwargs)  # row i * K + j: label j
    rows = torch.arange(n, device=logits.device) * k
    if isinstance(table, SumDecomposition):
        width = 1
        per_label = table.per_sample
    else:
        num_columns, n_bins = table.shape
        width = num_columns
        keys = table.keys[rows]  # the bins do not depend on the label
        counts, score_sums, _ = sums_by_key(keys, table.scores[rows], table.targets[rows], num_columns * n_bins)
    replicates = []
    for drawn in resample_labels(log_probs, num_resamples, seed, max(1, CHUNK_ELEMENTS // (n * width))):
        picked = rows + drawn  # (b, N) rows of the table
        b = drawn.shape[0]
        if isinstance(table, SumDecomposition):
            values = per_label[picked]
            sums = values.new_zeros(b, k).scatter_add_(1, drawn, values.to(torch.float64))
            totals = values.new_zeros(b, k).scatter_add_(1, drawn, torch.ones_like(values, dtype=torch.float64))
            replicates.append(table.reduce(sums, totals))
        else:
            targets = table.targets[picked].to(torch.float64)  # (b, N, C)
            target_sums = targets.new_zeros(b, num_columns * n_bins)
            target_sums.scatter_add_(1, keys.expand(b, n, num_columns).reshape(b, -1), targets.reshape(b, -1))
            shape = (b, num_columns, n_bins)
            replicates.append(table.reduce(
                counts.expand(b, -1).reshape(shape), score_sums.expand(b, -1).reshape(shape), target_sums.reshape(shape)
            ))
    return torch.cat(replicates)
