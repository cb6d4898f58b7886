"""Cross-entropy, Brier score, top-label ECE and error rate of a stream, from one pass per batch.

Each batch costs a single softmax-sized pass: every quantity is a reduction of the logits ``z`` and
of ``e = exp(z - max_k z_k)`` (``_softmax_rows``), without materialising ``log_probs`` or a second
(N, K) temporary. State: per-class sums of log-loss, Brier and correct decisions and per-class
counts (4, K), and per-bin correct sums, counts and confidence sums (3, M): float64, summed across
processes, so memory is O(K + M) whatever N is, and priors apply exactly at ``compute()``.

``PosteriorQuality`` is a ``MetricCollection`` of one ``PosteriorStatistic`` per value, all in one
compute group: an ``update`` runs the pass once and the members share the state, while each member
is an ordinary metric whose ``compute()`` returns one tensor (``self.log``, wrappers, ``plot``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from torchcal._validation import check_priors
from torchcal.functional.diagnostics import (
    calibration_error_from_bins,
    check_n_bins,
    edge_tolerance,
    uniform_bin_indices,
)
from torchcal.functional.posterior_quality import STATISTICS, Statistic
from torchcal.functional.scoring import (
    epsr_from_class_sums,
    naive_brier_score,
    naive_cross_entropy,
    prior_weighted_mean,
)
from torchcal.metrics._common import InputKind, ScoreMetric, add_sum_state, check_num_classes
from torchcal.metrics._softmax_rows import softmax_rows

__all__ = ["PosteriorQuality", "PosteriorStatistic"]

Precision = Literal["float64", "float32"]
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class PosteriorStatistic(ScoreMetric):
    """One value of ``PosteriorQuality`` (``statistic``), from the fused per-class and per-bin sums.

    Alone it is an ordinary metric; inside ``PosteriorQuality`` all members share one state.
    ``compute()`` returns a float64 scalar (see ``PosteriorQuality`` for the values).

    Args:
        statistic: one of ``"cross_entropy"``, ``"nce"``, ``"brier"``, ``"nbs"``,
            ``"error_rate"``, ``"ece"``.
        num_classes, n_bins, priors, precision: as ``PosteriorQuality``.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric = PosteriorStatistic("nce", num_classes=2, input="probs")
        >>> round(float(metric(probs, torch.tensor([0, 1, 1, 1]))), 6)
        0.711973
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 0.0

    num_classes: int
    priors: Tensor | None
    class_sums: Tensor
    bin_sums: Tensor

    _compute_only_options = ("statistic", "priors")  # the six members of PosteriorQuality share one state

    def __init__(
        self,
        statistic: Statistic,
        num_classes: int,
        n_bins: int = 15,
        priors: Tensor | None = None,
        precision: Precision = "float64",
        **kwargs: Any,
    ) -> None:
        super().__init__(check_num_classes(num_classes), **kwargs)
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}.")
        if precision not in _DTYPES:
            raise ValueError(f'precision must be "float64" or "float32", got {precision!r}.')
        self.statistic, self.precision, self.n_bins = statistic, precision, check_n_bins(n_bins)
        self.register_buffer("priors", None if priors is None else check_priors(priors, num_classes), persistent=False)
        # Rows: log-loss, Brier and correct sums and the count of each class / correct sum, count
        # and confidence sum of each bin. One tensor each, so an update is two index_add_ calls.
        add_sum_state(self, "class_sums", 4, num_classes)
        add_sum_state(self, "bin_sums", 3, n_bins)

    def update(self, scores: Tensor, labels: Tensor) -> None:
        """Accumulate ``scores: (N, K)`` or ``(N, K, d1, ...)`` and ``labels: (N,)`` or ``(N, d1, ...)``."""
        batch = self._scores(scores, labels)
        if batch is None:
            return
        logits, labels = batch
        rows = softmax_rows(logits, labels, _DTYPES[self.precision])
        log_loss, confidence = rows.log_loss, rows.confidence
        brier = (rows.norm * confidence).square_().add_(1).sub_(log_loss.neg().exp_(), alpha=2)
        # Rows 0-3 are the class sums (log-loss, Brier, correct, count), rows 2-4 the bin sums
        # (correct, count, confidence): one stack, two index_add_ calls. In the state's dtype, which
        # set_dtype may have changed from float64.
        terms = torch.stack([log_loss, brier, rows.correct.to(torch.float64), torch.ones_like(confidence), confidence])
        terms = terms.to(self.class_sums.dtype)
        self.class_sums.index_add_(1, labels, terms[:4])
        self.bin_sums.index_add_(1, uniform_bin_indices(confidence, self.n_bins, edge_tolerance(logits.dtype, confidence.dtype)), terms[2:])

    def compute(self) -> Tensor:
        """The statistic, a float64 scalar."""
        log_loss, brier, correct, counts = self.class_sums
        if self.statistic == "error_rate":
            return prior_weighted_mean(counts - correct, counts, self.priors)
        if self.statistic == "ece":
            bin_correct, bin_counts, bin_confidence = self.bin_sums.unsqueeze(1)
            return calibration_error_from_bins(bin_counts, bin_confidence, bin_correct)
        sums, naive = (log_loss, naive_cross_entropy) if self.statistic in ("cross_entropy", "nce") else (brier, naive_brier_score)
        score = epsr_from_class_sums(sums, counts, naive, self.priors)
        if self.statistic in ("cross_entropy", "brier"):
            return score
        naive_score = naive(counts / counts.sum() if self.priors is None else self.priors)
        return score / naive_score if bool(naive_score > 0) else torch.full_like(score, float("nan"))


class PosteriorQuality(MetricCollection):
    """Cross-entropy, Brier score, top-label ECE and error rate of ``softmax(logits)``, fused.

    A ``MetricCollection`` of six ``PosteriorStatistic`` members sharing one state (one compute
    group), so ``update`` costs one softmax-sized pass for all of them. ``compute()`` returns a dict
    of float64 scalars (with the collection's ``prefix``/``postfix``), as
    ``functional.posterior_quality`` returns them:

    - ``cross_entropy``, ``nce``: as ``functional.cross_entropy(..., priors, normalize)``;
    - ``brier``, ``nbs``: as ``functional.brier_score(..., priors, normalize)`` (0..2 scale);
    - ``error_rate``: the error of the first maximal class, prior-weighted like the scores
      (``functional.error_rate(..., priors)``; the functional form also ties decisions within
      float64 round-off);
    - ``ece``: ``functional.expected_calibration_error(kind="top-label", n_bins=n_bins)``, always
      over the samples as they are (not prior-weighted).

    ``nce``/``nbs`` divide by the naive system's score under ``priors``, or the empirical class
    frequencies; they are NaN when that score is 0 (all the prior mass on one class).

    Use it as any collection: ``self.log_dict(metric)`` in Lightning, ``metric["ece"]`` for one
    member, ``metric.plot()``. ``forward`` (calling the collection) runs each member's own pass, as
    torchmetrics does for every collection; accumulate with ``update`` where speed matters.

    Precision. ``"float64"`` computes the per-sample terms in float64: equal to the functional forms
    up to round-off (~1e-15 relative). ``"float32"`` computes them in float32 and accumulates in
    float64: about 1e-7 relative per sample, ~1e-6 on the means of 1M samples (rounding errors
    average out instead of drifting, unlike float32 accumulators); its ECE bins are those of the
    float64 path except for confidences within float32 round-off of a bin edge.

    Args:
        num_classes: K.
        n_bins: number of equal-width ECE bins M (right-closed, as ``functional.diagnostics``).
        priors: optional (K,) deployment priors for the scores and the error rate.
        precision: ``"float64"`` (default) or ``"float32"``, the dtype of the per-sample terms.
        input, ignore_index, validate_args: see ``torchcal.metrics``; ``validate_args=False``
            skips the checks in trusted hot loops.
        prefix, postfix: added to the keys, as ``MetricCollection``.
        kwargs: passed to each member's ``torchmetrics.Metric``.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric = PosteriorQuality(num_classes=2, n_bins=10)
        >>> metric.update(probs[:1].log(), torch.tensor([0]))
        >>> metric.update(probs[1:].log(), torch.tensor([1, 1, 1]))
        >>> {name: round(float(value), 6) for name, value in metric.compute().items()}  # sorted by name
        {'brier': 0.25, 'cross_entropy': 0.400367, 'ece': 0.3, 'error_rate': 0.25, 'nbs': 0.666667, 'nce': 0.711973}
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        priors: Tensor | None = None,
        precision: Precision = "float64",
        *,
        input: InputKind = "logits",
        ignore_index: int | None = None,
        validate_args: bool = True,
        prefix: str | None = None,
        postfix: str | None = None,
        **kwargs: Any,
    ) -> None:
        members: dict[str, Metric | MetricCollection] = {
            statistic: PosteriorStatistic(
                statistic, num_classes, n_bins, priors, precision,
                input=input, ignore_index=ignore_index, validate_args=validate_args, **kwargs,
            )
            for statistic in STATISTICS
        }
        super().__init__(members, prefix=prefix, postfix=postfix, compute_groups=[list(STATISTICS)])
