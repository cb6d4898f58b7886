"""One streaming metric for cross-entropy, Brier score, top-label ECE and error rate in one pass.

Each batch costs a single softmax-sized pass: every quantity is a reduction of the logits ``z`` and
of ``e = exp(z - max_k z_k)`` (``_softmax_rows``), without materialising ``log_probs`` or a second
(N, K) temporary. State: per-class sums of log-loss, Brier and correct decisions and per-class
counts (4, K), and per-bin correct sums, counts and confidence sums (3, M): float64, summed across
processes, so memory is O(K + M) whatever N is, and priors apply exactly at ``compute()``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import Metric

from torchcal._validation import check_logits_and_labels, check_priors
from torchcal.functional.diagnostics import (
    calibration_error_from_bins,
    edge_tolerance,
    uniform_bin_indices,
    uniform_edges,
)
from torchcal.functional.scoring import (
    epsr_from_class_sums,
    naive_brier_score,
    naive_cross_entropy,
    prior_weighted_mean,
)
from torchcal.metrics._common import add_sum_state, check_num_classes
from torchcal.metrics._softmax_rows import softmax_rows

__all__ = ["PosteriorQuality"]

Precision = Literal["float64", "float32"]
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class PosteriorQuality(Metric):
    """Cross-entropy, Brier score, top-label ECE and error rate of ``softmax(logits)``, fused.

    ``compute()`` returns a dict of float64 scalars:

    - ``cross_entropy``, ``nce``: as ``functional.cross_entropy(..., priors, normalize)``;
    - ``brier``, ``nbs``: as ``functional.brier_score(..., priors, normalize)`` (0..2 scale);
    - ``error_rate``: the error of the first maximal class, prior-weighted like the scores
      (``functional.error_rate`` without priors, ``bayes_risk(..., zero_one_costs(K), priors)``
      with them; the functional forms also tie decisions within float64 round-off);
    - ``ece``: ``functional.expected_calibration_error(kind="top-label", n_bins=n_bins)``, always
      over the samples as they are (not prior-weighted).

    ``nce``/``nbs`` divide by the naive system's score under ``priors``, or the empirical class
    frequencies; they are NaN when that score is 0 (all the prior mass on one class).

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
        validate_args: check every batch (finite floating scores of shape (N, K), labels in
            [0, K)) with ``torchcal._validation``; ``False`` skips the checks in trusted hot loops.
        kwargs: passed to ``torchmetrics.Metric``.

    Example:
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> metric = PosteriorQuality(num_classes=2, n_bins=10)
        >>> metric.update(probs[:1].log(), torch.tensor([0]))
        >>> metric.update(probs[1:].log(), torch.tensor([1, 1, 1]))
        >>> {name: round(float(value), 6) for name, value in metric.compute().items()}
        {'cross_entropy': 0.400367, 'nce': 0.711973, 'brier': 0.25, 'nbs': 0.666667, 'error_rate': 0.25, 'ece': 0.3}
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        priors: Tensor | None = None,
        precision: Precision = "float64",
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_classes = check_num_classes(num_classes)
        if precision not in _DTYPES:
            raise ValueError(f'precision must be "float64" or "float32", got {precision!r}.')
        self.precision, self.validate_args, self.n_bins = precision, validate_args, n_bins
        uniform_edges(n_bins)  # validates n_bins
        self.register_buffer("priors", None if priors is None else check_priors(priors, num_classes), persistent=False)
        # Rows: log-loss, Brier and correct sums and the count of each class / correct sum, count
        # and confidence sum of each bin. One tensor each, so an update is two index_add_ calls.
        add_sum_state(self, "class_sums", 4, num_classes)
        add_sum_state(self, "bin_sums", 3, n_bins)

    def _validated(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        # The common case costs one read-back of three numbers: the whole-tensor sum (~10x cheaper
        # than isfinite().all(), and finite when every entry is; a finite sum that overflows only
        # sends us to the full check) and the labels' range. Anything unusual goes to the full
        # validator, which raises the precise message.
        if (
            isinstance(logits, Tensor)
            and logits.is_floating_point()
            and logits.ndim == 2
            and logits.shape[0] > 0
            and logits.shape[1] == self.num_classes
            and isinstance(labels, Tensor)
            and labels.dtype == torch.int64
            and labels.shape == logits.shape[:1]
            and labels.device == logits.device
        ):
            low, high = torch.aminmax(labels)
            total, low, high = torch.stack([logits.sum().double(), low.double(), high.double()]).tolist()
            if math.isfinite(total) and low >= 0 and high < self.num_classes:
                return logits, labels
        return check_logits_and_labels(logits, labels, num_classes=self.num_classes)

    def update(self, logits: Tensor, labels: Tensor) -> None:
        """Accumulate ``logits: (N, K)`` and ``labels: (N,)``."""
        if self.validate_args:
            logits, labels = self._validated(logits, labels)
        rows = softmax_rows(logits, labels, _DTYPES[self.precision])
        log_loss, confidence = rows.log_loss, rows.confidence
        brier = (rows.norm * confidence).square_().add_(1).sub_(log_loss.neg().exp_(), alpha=2)
        # Rows 0-3 are the class sums (log-loss, Brier, correct, count), rows 2-4 the bin sums
        # (correct, count, confidence): one stack, two index_add_ calls.
        terms = torch.stack([log_loss, brier, rows.correct.to(torch.float64), torch.ones_like(confidence), confidence])
        self.class_sums.index_add_(1, labels, terms[:4])
        self.bin_sums.index_add_(1, uniform_bin_indices(confidence, self.n_bins, edge_tolerance(logits.dtype, confidence.dtype)), terms[2:])

    def compute(self) -> dict[str, Tensor]:
        log_loss, brier, correct, counts = self.class_sums
        reference = counts / counts.sum() if self.priors is None else self.priors
        result = {}
        for name, state, naive in (
            ("cross_entropy", log_loss, naive_cross_entropy),
            ("brier", brier, naive_brier_score),
        ):
            score = epsr_from_class_sums(state, counts, naive, self.priors)
            naive_score = naive(reference)
            normalized = score / naive_score if bool(naive_score > 0) else torch.full_like(score, float("nan"))
            result[name] = score
            result["nce" if name == "cross_entropy" else "nbs"] = normalized
        result["error_rate"] = prior_weighted_mean(counts - correct, counts, self.priors)
        bin_correct, bin_counts, bin_confidence = self.bin_sums.unsqueeze(1)
        result["ece"] = calibration_error_from_bins(bin_counts, bin_confidence, bin_correct)
        return result

