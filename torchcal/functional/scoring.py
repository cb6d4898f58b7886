"""Expected proper scoring rules: cross-entropy and the Brier score, with prior weighting.

All functions take scores ``logits: (N, K)`` — logits in the wide sense, i.e. any unnormalised
log-posteriors (``log(probs)`` works, clamped if a probability is 0: -inf is refused) — and class
indices ``labels: (N,)``. They compute in float64 and return a float64 scalar tensor.

Prior weighting (Ferrer & Ramos, App. A): with deployment priors ``P``, sample ``t`` of class
``h_t`` gets weight ``P[h_t] / P_data[h_t]`` where ``P_data`` are the class frequencies in the data,
so the score becomes ``sum_h P[h] * (mean score over the samples of class h)``.

Normalised scores divide by the score of the best naive system, the one that ignores its input and
always outputs the priors: the prior entropy for cross-entropy, ``sum_k P_k (1 - P_k)`` for Brier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from torchcal._validation import as_tensor, check_labels, check_logits_and_labels, check_priors, name_classes

__all__ = [
    "PER_SAMPLE_SCORES",
    "SumDecomposition",
    "brier_per_sample",
    "brier_score",
    "class_frequencies",
    "class_sums",
    "class_weights",
    "class_weights_from_counts",
    "cross_entropy",
    "epsr_from_class_sums",
    "epsr_terms",
    "log_loss_per_sample",
    "naive_brier_score",
    "naive_cross_entropy",
    "one_vs_rest_log_odds",
    "prior_weighted_mean",
    "to_log_probs",
    "weighted_mean",
]


def to_log_probs(logits: Tensor) -> Tensor:
    """Normalised log-posteriors ``log_softmax(logits)`` (N, K), computed in float64.

    Example:
        >>> to_log_probs(torch.tensor([[0.0, 0.0]])).exp()
        tensor([[0.5000, 0.5000]], dtype=torch.float64)
    """
    return torch.log_softmax(logits, dim=1, dtype=torch.float64)


def one_vs_rest_log_odds(logits: Tensor) -> Tensor:
    """``log(p_k / (1 - p_k)) = z_k - logsumexp_{j != k} z_j`` of ``softmax(logits)`` (N, K) in
    float64: exact also where ``p_k`` rounds to 1 (log-odds above 37), which only the row's
    largest logit can reach; every other column has ``p_k <= 1/2``, where ``log1p`` is exact."""
    z = logits.to(torch.float64)
    log_p = torch.log_softmax(z, dim=1)
    odds = log_p - torch.log1p(-log_p.exp())
    return odds.scatter(1, z.argmax(dim=1, keepdim=True), top_label_log_odds(z).unsqueeze(1))


def top_label_log_odds(logits: Tensor) -> Tensor:
    """(N,) the log-odds of each row's top label, ``z_top - logsumexp_{j != top} z_j``, in float64:
    the top label's column of :func:`one_vs_rest_log_odds` alone (a K-th of its work)."""
    z = logits.to(torch.float64)
    top = z.argmax(dim=1, keepdim=True)
    return (z.gather(1, top) - z.scatter(1, top, -math.inf).logsumexp(dim=1, keepdim=True)).squeeze(1)


def log_loss_per_sample(log_probs: Tensor, labels: Tensor) -> Tensor:
    """``-log q[y]`` for normalised log-posteriors ``log_probs: (N, K)``; returns (N,)."""
    return -log_probs.gather(1, labels.unsqueeze(1)).squeeze(1)


def brier_per_sample(log_probs: Tensor, labels: Tensor) -> Tensor:
    """``sum_k (q_k - [y == k])^2`` on the 0..2 scale (summed over classes); returns (N,).

    Expanded as ``sum_k q_k^2 - 2 q_y + 1`` so no one-hot matrix is materialised.
    """
    probs = log_probs.exp()
    return (probs * probs).sum(dim=1) - 2 * probs.gather(1, labels.unsqueeze(1)).squeeze(1) + 1


PER_SAMPLE_SCORES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "log": log_loss_per_sample,
    "brier": brier_per_sample,
}


def class_frequencies(labels: Tensor, num_classes: int) -> Tensor:
    """Empirical class priors ``N_k / N`` in float64; (K,) for ``labels: (N,)`` in [0, K).

    Example:
        >>> class_frequencies(torch.tensor([0, 2, 2, 1]), 3)
        tensor([0.2500, 0.2500, 0.5000], dtype=torch.float64)
    """
    if isinstance(num_classes, bool) or not hasattr(num_classes, "__index__") or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
    num_classes = int(num_classes)
    labels = as_tensor(labels, "labels")
    labels = check_labels(labels, labels.shape[0] if labels.ndim else 1, num_classes, samples="there are N = {} labels")
    if labels.numel() == 0:
        raise ValueError("labels is empty (N = 0): class frequencies need at least one sample.")
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    return counts / counts.sum()


def _check_classes_present(counts: Tensor, priors: Tensor) -> None:
    """Raise unless every class with a positive prior has samples; ``counts: (..., K)``."""
    missing = (counts == 0) & (priors > 0)
    if bool(missing.any()):
        classes = missing.reshape(-1, priors.shape[-1]).any(0).nonzero().flatten().tolist()
        raise ValueError(
            f"{name_classes(classes)} {'has' if len(classes) == 1 else 'have'} a positive prior but no sample in the "
            f"data, so {'it' if len(classes) == 1 else 'they'} cannot be re-weighted; give "
            f"{'it' if len(classes) == 1 else 'them'} prior 0 or add samples."
        )


def class_weights(labels: Tensor, num_classes: int, priors: Tensor | None = None) -> Tensor | None:
    """Per-class weights ``P[k] / P_data[k]`` (K,) that re-weight the data to ``priors``.

    Returns ``None`` when ``priors`` is None (plain average). A class with a positive prior but no
    sample cannot be re-weighted and raises ``ValueError``.
    """
    if priors is None:
        return None
    return class_weights_from_counts(torch.bincount(labels, minlength=num_classes), priors)


def class_weights_from_counts(counts: Tensor, priors: Tensor) -> Tensor:
    """``class_weights`` from per-class sample ``counts: (K,)`` (e.g. summed across processes)."""
    priors = check_priors(priors, counts.shape[0], device=counts.device)
    freq = counts.to(torch.float64) / counts.sum()
    _check_classes_present(freq, priors)
    return torch.where(freq > 0, priors / freq.clamp_min(1e-300), torch.zeros_like(priors))


def weighted_mean(per_sample: Tensor, labels: Tensor, weights: Tensor | None) -> Tensor:
    """Mean of ``per_sample`` (N,) in float64, with per-class ``weights`` (K,) if given.

    Samples of weight 0 contribute 0 even when their score is infinite.
    """
    return weighted_terms(per_sample, labels, weights).mean()


def weighted_terms(per_sample: Tensor, labels: Tensor, weights: Tensor | None) -> Tensor:
    """The terms (N,) float64 whose mean is :func:`weighted_mean`: each sample's score times its
    class's weight (0 where that is 0, even for an infinite score)."""
    per_sample = per_sample.to(torch.float64)
    if weights is None:
        return per_sample
    w = weights[labels]
    return torch.where(w > 0, w * per_sample, torch.zeros_like(per_sample))


def class_sums(per_sample: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class sums of ``per_sample`` (N,) and per-class counts, both (K,) float64.

    These are the sufficient statistics of every prior-weighted mean: see ``prior_weighted_mean``.

    Example:
        >>> class_sums(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 2, 0]), 3)
        (tensor([5., 0., 2.], dtype=torch.float64), tensor([2., 0., 1.], dtype=torch.float64))
    """
    # index_add_ rather than bincount, which reads the largest label back to the host on a GPU
    sums = torch.zeros(2, num_classes, dtype=torch.float64, device=labels.device)
    sums[0].index_add_(0, labels, per_sample.to(torch.float64))
    sums[1].index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))
    return sums[0], sums[1]


def prior_weighted_mean(sums: Tensor, counts: Tensor, priors: Tensor | None = None) -> Tensor:
    """``sum_h P[h] * sums[h] / counts[h]`` from per-class ``sums`` and ``counts`` (..., K).

    Equals ``weighted_mean`` of the per-sample values; without ``priors`` it is the plain mean
    ``sums.sum() / counts.sum()``. Leading dimensions broadcast (e.g. bootstrap replicates).
    A class with a positive prior and no sample raises ``ValueError``; a class with prior 0
    contributes 0 even when its sum is infinite.

    Example:
        >>> sums, counts = torch.tensor([5.0, 2.0], dtype=torch.float64), torch.tensor([2.0, 1.0], dtype=torch.float64)
        >>> float(prior_weighted_mean(sums, counts)), float(prior_weighted_mean(sums, counts, torch.tensor([.5, .5])))
        (2.3333333333333335, 2.25)
    """
    if priors is None:
        return sums.sum(-1) / counts.sum(-1)
    num_classes = sums.shape[-1]
    priors = check_priors(priors, num_classes, device=sums.device)
    _check_classes_present(counts, priors)
    terms = priors * sums / counts.clamp_min(1)
    return torch.where(priors > 0, terms, torch.zeros_like(terms)).sum(-1)


def naive_cross_entropy(priors: Tensor) -> Tensor:
    """Cross-entropy of the system that always outputs ``priors`` (..., K): the prior entropy (nats)."""
    return -torch.special.xlogy(priors, priors).sum(-1)


def naive_brier_score(priors: Tensor) -> Tensor:
    """Brier score (0..2 scale) of the system that always outputs ``priors`` (..., K)."""
    return (priors * (1 - priors)).sum(-1)


def epsr_from_class_sums(
    sums: Tensor,
    counts: Tensor,
    naive: Callable[[Tensor], Tensor],
    priors: Tensor | None = None,
    normalize: bool = False,
) -> Tensor:
    """An expected proper scoring rule from per-class loss ``sums`` and ``counts`` (..., K).

    ``naive`` maps priors to the score of the naive system (``naive_cross_entropy`` or
    ``naive_brier_score``); it is used only with ``normalize=True``, with the empirical class
    frequencies ``counts / counts.sum()`` when ``priors`` is None.

    Example (a system as good as the naive one has normalised cross-entropy 1):
        >>> counts = torch.tensor([1.0, 3.0], dtype=torch.float64)
        >>> sums = -counts * (counts / 4).log()  # every sample scored -log(prior of its class)
        >>> float(epsr_from_class_sums(sums, counts, naive_cross_entropy, normalize=True))
        1.0
    """
    score = prior_weighted_mean(sums, counts, priors)
    if not normalize:
        return score
    reference = counts / counts.sum(-1, keepdim=True) if priors is None else check_priors(
        priors, sums.shape[-1], device=sums.device
    )
    naive_score = naive(reference)
    if bool((naive_score <= 0).any()):
        raise ValueError(
            "the naive system (always output the priors) has a score of 0 when all the prior mass is "
            "on one class, so the normalised score is undefined; use normalize=False."
        )
    return score / naive_score


class SumDecomposition(NamedTuple):
    """A metric written as ``reduce(*class_sums(per_sample, labels, num_classes))``.

    Every prior-weighted mean of a per-sample value (scoring rules, expected cost) has this form;
    streaming metrics accumulate the per-class sums, and the bootstrap evaluates ``reduce`` on the
    per-class sums of all replicates at once.
    """

    per_sample: Tensor  # (N,)
    labels: Tensor  # (N,)
    num_classes: int
    reduce: Callable[[Tensor, Tensor], Tensor]  # (sums (..., K), counts (..., K)) -> (...)

    def evaluate(self) -> Tensor:
        return self.reduce(*class_sums(self.per_sample, self.labels, self.num_classes))


def epsr_terms(
    per_sample: Callable[[Tensor, Tensor], Tensor],
    naive: Callable[[Tensor], Tensor],
    logits: Tensor,
    labels: Tensor,
    priors: Tensor | None = None,
    normalize: bool = False,
) -> SumDecomposition:
    """Validate the inputs of an EPSR and return its ``SumDecomposition``.

    Example:
        >>> terms = epsr_terms(log_loss_per_sample, naive_cross_entropy, torch.zeros(2, 2), torch.tensor([0, 1]))
        >>> terms.per_sample, float(terms.evaluate())
        (tensor([0.6931, 0.6931], dtype=torch.float64), 0.6931471805599453)
    """
    logits, labels = check_logits_and_labels(logits, labels)
    num_classes = logits.shape[1]
    if priors is not None:
        priors = check_priors(priors, num_classes, device=logits.device)
    log_probs = to_log_probs(logits)
    reduce = partial(epsr_from_class_sums, naive=naive, priors=priors, normalize=normalize)
    return SumDecomposition(per_sample(log_probs, labels), labels, num_classes, reduce)


def _epsr(
    per_sample: Callable[[Tensor, Tensor], Tensor],
    naive: Callable[[Tensor], Tensor],
    logits: Tensor,
    labels: Tensor,
    priors: Tensor | None,
    normalize: bool,
) -> Tensor:
    return epsr_terms(per_sample, naive, logits, labels, priors, normalize).evaluate()


def cross_entropy(
    logits: Tensor, labels: Tensor, priors: Tensor | None = None, normalize: bool = False
) -> Tensor:
    """Mean cross-entropy (log-loss, nats) of the posteriors ``softmax(logits)``.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        priors: optional (K,) deployment priors; re-weights the classes (Ferrer & Ramos App. A).
        normalize: divide by the prior entropy (the naive system's cross-entropy): NCE.

    Example:
        >>> import torch
        >>> from torchcal.functional import cross_entropy
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> labels = torch.tensor([0, 1, 1, 1])
        >>> round(float(cross_entropy(probs.log(), labels)), 6)
        0.400367
        >>> round(float(cross_entropy(probs.log(), labels, normalize=True)), 6)
        0.711973
    """
    return _epsr(log_loss_per_sample, naive_cross_entropy, logits, labels, priors, normalize)


def brier_score(
    logits: Tensor, labels: Tensor, priors: Tensor | None = None, normalize: bool = False
) -> Tensor:
    """Mean Brier score, summed over classes: ``sum_k (q_k - [y == k])^2``, on the 0..2 scale.

    This is K times the "mean over N*K" convention of psrcal and of Ferrer's papers; normalised
    values (``normalize=True``, NBS) are the same under both conventions.

    Args:
        logits: (N, K) scores; any unnormalised log-posteriors.
        labels: (N,) class indices in [0, K).
        priors: optional (K,) deployment priors (class re-weighting).
        normalize: divide by the naive system's Brier score ``sum_k P_k (1 - P_k)``: NBS.

    Example:
        >>> import torch
        >>> from torchcal.functional import brier_score
        >>> probs = torch.tensor([[.8, .2], [.3, .7], [.6, .4], [.1, .9]])
        >>> labels = torch.tensor([0, 1, 1, 1])
        >>> round(float(brier_score(probs.log(), labels)), 6)
        0.25
        >>> round(float(brier_score(probs.log(), labels, normalize=True)), 6)
        0.666667
    """
    return _epsr(brier_per_sample, naive_brier_score, logits, labels, priors, normalize)
