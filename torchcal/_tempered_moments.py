"""A proper loss of ``softmax(beta * z)`` and its first two derivatives in ``beta``, summed over the
rows of the logits, at several ``beta`` at once: the one pass behind temperature scaling's 1-D
solver, the refinement loss and the streaming refinement metric.

With ``w = z - max_k z_k`` (<= 0: no exponential overflows), ``e = exp(beta w)`` and the row power
sums ``S_jp = sum_k e_k^j w_k^p``, the posteriors are ``q = e / S_10``; their mean and variance
of ``w`` are ``m = S_11 / S_10`` and ``v = S_12 / S_10 - m^2``, and ``c = w - m``. Since
``dq_k/dbeta = q_k c_k`` and ``d2q_k/dbeta2 = q_k (c_k^2 - v)``:

- log loss ``-log q_y = log S_10 - beta w_y``: first derivative ``m - w_y``, second ``v``;
- Brier score ``sum_k q_k^2 - 2 q_y + 1``: first derivative ``2 sum_k q_k^2 c_k - 2 q_y c_y``,
  second ``2 sum_k q_k^2 (2 c_k^2 - v) - 2 q_y (c_y^2 - v)``, where ``sum_k q_k^2 c_k^p`` follow
  from ``S_2p`` (``p <= 2``).

Each row costs one exponential per entry and per ``beta``, and the products and sums that form
``S_jp``, in the working precision (float32 for float32 logits, whose exponentials are three times
faster on the CPU than float64's); the rest is O(N) work per ``beta`` and runs in float64, as do
the sums over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from torchcal._fast_exp import applied_scale, scaled_exp

__all__ = ["TEMPERED_LOSSES", "tempered_moments"]

# Elements per chunk of rows. On the CPU a chunk (about 256k elements, 1 MiB in float32) and its
# work buffers stay in cache while the exponentials and the row sums are formed from them, for
# every beta (in CPU time at K = 1,000, half this size was 10-20 % slower; twice it, 10 % faster
# with the metric's 49 betas but 15 % slower with one beta of the Brier score); on a GPU every
# chunk costs a dozen kernel launches per beta, so chunks are as large as the temporaries allow
# (64 MiB each in float32).
_CHUNK_ELEMENTS = 1 << 18
_DEVICE_CHUNK_ELEMENTS = 1 << 24
# (beta, row) pairs whose power sums are gathered before the per-row terms are formed from them at
# once: a dozen small float64 operations per block, which would cost more than the passes
# themselves with one beta and chunks of a hundred rows.
_BLOCK_PAIRS = 1 << 15


class _TemperedLoss(NamedTuple):
    """How a loss is formed from the row power sums."""

    powers: int  #: the largest ``j`` of the sums ``S_jp`` it needs
    terms: Callable[[Tensor, Tensor, Tensor], Tensor]  #: (sums, w_y, betas) -> per-row loss and derivatives


def _mean_and_variance(sums: Tensor) -> tuple[Tensor, Tensor]:
    """``E_q[w]`` and ``Var_q[w]`` (B, R) from the power sums ``sums: (B, J, 3, R)``."""
    s0, s1, s2 = sums[:, 0].unbind(1)
    mean = s1 / s0
    return mean, s2 / s0 - mean.square()


def _log_loss_terms(sums: Tensor, true_centred: Tensor, betas: Tensor) -> Tensor:
    """``-log q_y`` and its two ``beta``-derivatives, (B, 3, R), from ``sums: (B, 1, 3, R)``,
    ``w_y: (R,)`` and ``betas: (B, 1)``."""
    mean, variance = _mean_and_variance(sums)
    return torch.stack([sums[:, 0, 0].log() - betas * true_centred, mean - true_centred, variance], 1)


def _brier_terms(sums: Tensor, true_centred: Tensor, betas: Tensor) -> Tensor:
    """The Brier score ``sum_k q_k^2 - 2 q_y + 1`` and its two ``beta``-derivatives, (B, 3, R),
    from ``sums: (B, 2, 3, R)``, ``w_y: (R,)`` and ``betas: (B, 1)``."""
    mean, variance = _mean_and_variance(sums)
    s0 = sums[:, 0, 0]
    t0, t1, t2 = (sums[:, 1] / s0.square().unsqueeze(1)).unbind(1)  # sum_k q_k^2 w_k^p
    squares = t0  # sum_k q_k^2
    squares_c = t1 - mean * t0  # sum_k q_k^2 c_k
    squares_c2 = t2 - 2 * mean * t1 + mean.square() * t0  # sum_k q_k^2 c_k^2
    q_true = torch.exp(betas * true_centred) / s0
    c_true = true_centred - mean
    return torch.stack([
        squares - 2 * q_true + 1,
        2 * (squares_c - q_true * c_true),
        2 * (2 * squares_c2 - variance * squares) - 2 * q_true * (c_true.square() - variance),
    ], 1)


#: The losses whose tempered moments are known: every one of ``functional.scoring.PER_SAMPLE_SCORES``.
TEMPERED_LOSSES: dict[str, _TemperedLoss] = {
    "log": _TemperedLoss(1, _log_loss_terms),
    "brier": _TemperedLoss(2, _brier_terms),
}


def _power_sums(centred: Tensor, beta: float, work: Tensor, out: Tensor) -> None:
    """``out[j - 1, p] = sum_k e_k^j w_k^p`` (J, 3, R) for ``j <= J``, ``p <= 2``, with
    ``e = exp(beta w)`` and ``w = centred: (R, K)``; ``work: (J, R, K)`` is overwritten."""
    powers = work.shape[0]
    scaled_exp(centred, beta, out=work[0])
    for j in range(1, powers):
        torch.mul(work[j - 1], work[0], out=work[j])
    for p in range(3):
        for j in range(powers):
            if p:
                work[j].mul_(centred)
            torch.sum(work[j], dim=1, out=out[j, p])


def _block_power_sums(logits: Tensor, labels: Tensor, betas: Sequence[float], work: Tensor, sums: Tensor, true_centred: Tensor) -> None:
    """The power sums of the rows of ``logits: (R, K)`` at every beta into ``sums[..., :R]``
    (B, J, 3, R), and ``w_y`` into ``true_centred[:R]``, in chunks of ``work: (1 + J, rows, K)``
    (overwritten), in its dtype."""
    n, rows = logits.shape[0], work.shape[1]
    for start in range(0, n, rows):
        chunk = slice(start, min(start + rows, n))
        # (the maxima in the working precision, so that the difference is taken in it)
        top = logits[chunk].amax(dim=1, keepdim=True).to(work.dtype)
        w = torch.sub(logits[chunk], top, out=work[0, : top.shape[0]])
        torch.gather(w, 1, labels[chunk].unsqueeze(1), out=true_centred[chunk].unsqueeze(1))
        for i, beta in enumerate(betas):
            _power_sums(w, beta, work[1:, : w.shape[0]], sums[i, ..., chunk])


def tempered_moments(
    logits: Tensor,
    labels: Tensor,
    betas: Sequence[float],
    loss: str = "log",
    weights: Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Sums over the rows of ``loss`` of ``softmax(beta * logits)`` and of its first and second
    derivative in ``beta``, at every ``beta`` of ``betas``: (B, 3) float64.

    Args:
        logits: (N, K) scores. labels: (N,) class indices.
        betas: B inverse temperatures (Python floats), all evaluated in one pass over the logits.
        loss: a key of :data:`TEMPERED_LOSSES` (``"log"`` or ``"brier"``).
        weights: optional (N,) float64 per-row weights of the sums (e.g. ``1 / N`` for means).
        dtype: the working precision of the exponentials and row sums; the logits' by default.

    Example:
        >>> import torch
        >>> from torchcal.functional import brier_score
        >>> logits, labels = torch.randn(50, 4, dtype=torch.float64), torch.arange(50) % 4
        >>> beta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        >>> brier = brier_score(beta * logits, labels) * 50
        >>> (slope,) = torch.autograd.grad(brier, beta)
        >>> moments = tempered_moments(logits, labels, [0.7], "brier")
        >>> torch.allclose(moments[0, :2], torch.stack([brier, slope]).detach())
        True
    """
    logits = logits.detach()  # sums for a solver, not a graph (the chunks are written with out=)
    n, k = logits.shape
    dtype = logits.dtype if dtype is None else dtype
    powers, terms = TEMPERED_LOSSES[loss]
    # The exponentials apply each beta rounded to the working precision (by up to 6e-8 in float32),
    # and so do the per-row terms here, lest they mix two betas; the sums are moved back to the
    # betas asked for at the end.
    applied = [applied_scale(beta, dtype, logits.device) for beta in betas]
    beta_column, shifts = logits.new_empty(2, len(betas), 1, dtype=torch.float64)
    for i, (beta, applied_beta) in enumerate(zip(betas, applied)):  # filled: a copy from the host would synchronise a GPU
        beta_column[i].fill_(applied_beta)
        shifts[i].fill_(beta - applied_beta)
    rows = min(n, max(1, (_CHUNK_ELEMENTS if logits.device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS) // k))
    block_rows = min(n, max(rows, _BLOCK_PAIRS // len(betas) // rows * rows))
    # Buffers allocated once per call: chunk-sized temporaries, freed between small long-lived
    # allocations, fragment the CPU heap until it holds about the data's size.
    work = logits.new_empty(1 + powers, rows, k, dtype=dtype)
    sums = logits.new_empty(len(betas), powers, 3, block_rows, dtype=dtype)
    true_centred = logits.new_empty(block_rows, dtype=dtype)
    totals = torch.zeros(len(betas), 3, dtype=torch.float64, device=logits.device)
    for start in range(0, n, block_rows):
        block = slice(start, start + block_rows)
        size = min(block_rows, n - start)
        _block_power_sums(logits[block], labels[block], applied, work, sums, true_centred)
        per_row = terms(sums[..., :size].to(torch.float64), true_centred[:size].to(torch.float64), beta_column)  # (B, 3, R)
        totals += per_row.sum(2) if weights is None else per_row @ weights[block]
    return _moved(totals, shifts)


def _moved(totals: Tensor, shifts: Tensor) -> Tensor:
    """The sums (B, 3) of the loss and its derivatives moved by ``shifts: (B, 1)`` in beta, to first
    order (the loss by the slope, the slope by the curvature): an error of the shift's square,
    4e-15 relative in float32."""
    return totals + torch.cat([totals[:, 1:], torch.zeros_like(totals[:, :1])], 1) * shifts
