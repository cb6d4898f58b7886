"""Per-row softmax statistics of a batch of logits, from one exponential per entry.

With ``m = max_k z_k``, ``e = exp(z - m)`` (N, K) and ``S = sum_k e_k``, the streaming metrics need
only row reductions of ``z`` and ``e``: ``log q_y = z_y - m - log S``, ``sum_k q_k^2 = |e|^2 / S^2``
and the confidence ``max_k q_k = 1 / S`` (``e`` is 1 at the maximum). This is ``log_softmax`` done
once, without materialising the log-posteriors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from torchcal._fast_exp import scaled_exp

__all__ = ["SoftmaxRows", "softmax_rows"]

# |exp(z - max)| of a row tied at the maximum is >= sqrt(2); the margin is far above round-off.
_TIED_ROW_NORM = math.sqrt(2) * (1 - 1e-5)


class SoftmaxRows(NamedTuple):
    """(N,) float64 statistics of ``q = softmax(z)`` against the labels ``y``."""

    top: Tensor  #: ``m = max_k z_k``
    total: Tensor  #: ``S = sum_k exp(z_k - m)``; the confidence is ``1 / S``
    norm: Tensor  #: ``|exp(z - m)|``, so that ``sum_k q_k^2 = (norm / S)^2``
    true_logit: Tensor  #: ``z_y``
    correct: Tensor  #: bool: the first maximal class is ``y``

    @property
    def log_loss(self) -> Tensor:
        """``-log q_y``; ``m - z_y`` first, exact when they are close."""
        return (self.top - self.true_logit).add_(self.total.log())

    @property
    def confidence(self) -> Tensor:
        """``max_k q_k = 1 / S``."""
        return self.total.reciprocal()


def softmax_rows(logits: Tensor, labels: Tensor, dtype: torch.dtype) -> SoftmaxRows:
    """The row statistics of ``logits: (N, K)`` (exponentials in ``dtype``) and ``labels: (N,)``.

    Logits more precise than ``dtype`` have their row maxima taken out in their own precision
    first: float64 logits with a per-row offset of 1e4, cast to float32 as they were, lost five
    digits of their differences (the mean log-loss 6e-6 off, relative)."""
    offset = None
    if logits.dtype.itemsize > dtype.itemsize:
        offset = logits.amax(dim=1, keepdim=True)
        z = (logits - offset).to(dtype)
    else:
        z = logits.to(dtype)
    top = z.amax(dim=1, keepdim=True)
    e = z - top
    scaled_exp(e, out=e)  # (N, K), 1 at the maxima
    rows = torch.stack([
        top.squeeze(1), e.sum(dim=1), torch.linalg.vector_norm(e, dim=1), z.gather(1, labels.unsqueeze(1)).squeeze(1)
    ]).to(torch.float64)  # what follows is O(N) work: float64 costs nothing more
    top, total, norm, true_logit = rows
    correct = _first_maximum_is_label(z, labels, true_logit == top, norm)
    if offset is not None:
        top, true_logit = rows[[0, 3]] + offset.squeeze(1).to(torch.float64)
    return SoftmaxRows(top, total, norm, true_logit, correct)


def _first_maximum_is_label(z: Tensor, labels: Tensor, label_is_maximal: Tensor, norm: Tensor) -> Tensor:
    """Whether the first maximal class of each row of ``z: (N, K)`` is its label, given whether the
    label's score is maximal and the row norms ``norm`` of ``exp(z - max)``."""
    if z.device.type != "cpu":  # there an argmax is as cheap as the max, and needs no host sync
        return z.argmax(dim=1) == labels
    # On the CPU argmax costs five passes over z. A tie at the maximum puts two exact 1s in
    # exp(z - max), so |e|^2 >= 2 (a sum of non-negative terms rounds upwards of its parts): only
    # those rows can have a first maximal class other than the label. Untied rows rarely get there.
    correct = label_is_maximal.clone()
    ambiguous = correct & (norm >= _TIED_ROW_NORM)
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero().squeeze(1)
        correct[rows] = z[rows].argmax(dim=1) == labels[rows]
    return correct
