"""Synthetic posteriors with known ground truth (Ferrer & Ramos, App. C; Ferrer, §4.8).

Features of class ``i`` are Gaussian, ``x ~ N(mu_i, variance * I)``; the exact class
log-likelihoods give perfectly calibrated posteriors for the data priors. Miscalibrated versions
come from known distortions, so a calibration metric or calibrator can be checked against the truth:

- ``mcp`` / ``Mismp``: posteriors computed with mismatched priors (:func:`mismatched_priors`);
- ``mc1``: distorted log-likelihoods ``0.5 * llk + shift`` (:func:`distort_likelihoods`);
- ``mc2`` / ``mcs``: log-posteriors scaled and renormalised (:func:`scale_log_posteriors`).

The recipe follows the authors' code, which settles the papers' ambiguities (reference notes
§C.2): ``variance`` is a variance (the text says "standard deviation 0.15"); class sizes are
truncated, ``int(P_i * N)``; mc1 scales first, then shifts; and the features are drawn with
NumPy's legacy ``RandomState(seed).multivariate_normal`` class after class, so the numbers match
the published tables bit for bit.

Example:
    >>> task = gaussian_task(num_classes=10, num_samples=20_000)
    >>> systems = ferrer_systems(task)
    >>> sorted(systems)[:3]
    ['Datap-cal', 'Datap-mc1', 'Datap-mc2']
    >>> systems["Datap-cal"].shape
    torch.Size([19998, 10])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import as_tensor, check_count, check_priors

__all__ = [
    "GaussianTask",
    "class_priors",
    "distort_likelihoods",
    "ferrer_systems",
    "gaussian_task",
    "log_posteriors",
    "mismatched_priors",
    "scale_log_posteriors",
]


@dataclass(frozen=True)
class GaussianTask:
    """Samples of a Gaussian classification task and their exact class log-likelihoods.

    Attributes:
        features: (N, D) float64 inputs; D = 1 for the ``"line"`` layout, K for ``"simplex"``.
        labels: (N,) int64 classes, sorted (all of class 0 first).
        log_likelihoods: (N, K) float64, ``log p(x | class k)``.
        priors: (K,) float64, the priors the samples were drawn with.
    """

    features: Tensor
    labels: Tensor
    log_likelihoods: Tensor
    priors: Tensor


def class_priors(num_classes: int, first: float = 0.9) -> Tensor:
    """Priors ``P_1 = first`` and ``(1 - first) / (K - 1)`` for every other class; (K,) float64."""
    check_count(num_classes, "num_classes", 2)
    if not 0 <= first <= 1:
        raise ValueError(f"first must be a prior in [0, 1], got {first!r}.")
    rest = (1 - first) / (num_classes - 1)
    return torch.tensor([first] + [rest] * (num_classes - 1), dtype=torch.float64)


def mismatched_priors(num_classes: int, last: float = 0.9) -> Tensor:
    """The "Mismp" priors: ``P_K = last`` and ``(1 - last) / (K - 1)`` for the others; (K,)."""
    check_count(num_classes, "num_classes", 2)
    if not 0 <= last <= 1:
        raise ValueError(f"last must be a prior in [0, 1], got {last!r}.")
    return class_priors(num_classes, last).flip(0)


def gaussian_task(
    num_classes: int,
    num_samples: int = 100_000,
    prior1: float = 0.9,
    variance: float = 0.15,
    layout: Literal["line", "simplex"] = "line",
    seed: int = 0,
) -> GaussianTask:
    """Draw a Gaussian task with priors :func:`class_priors` ``(K, prior1)``.

    Args:
        num_classes: K >= 2.
        num_samples: N before truncation; class ``i`` gets ``int(P_i * N)`` samples.
        prior1: prior of the first class (0.9 in Ferrer §4.8, 0.8 in Ferrer & Ramos App. C).
        variance: per-dimension variance of every class (0.15 in both papers).
        layout: ``"line"``: one feature, class means ``0, 1, ..., K-1`` (Ferrer §4.8);
            ``"simplex"``: K features, means at the one-hot vectors scaled by ``sqrt(0.5)`` so
            that every pair is at distance 1 (Ferrer & Ramos App. C).
        seed: seed of NumPy's legacy ``RandomState``.
    """
    check_count(num_classes, "num_classes", 2)
    check_count(num_samples, "num_samples", 1)
    if not 0 < prior1 < 1 or not 0 < variance < math.inf:
        raise ValueError(f"prior1 must lie in (0, 1) and variance must be positive and finite, got {prior1!r} and {variance!r}.")
    priors = class_priors(num_classes, prior1)
    counts = [int(p * num_samples) for p in priors.tolist()]
    if min(counts) < 1:
        enough = math.ceil(1 / min(priors.tolist()))
        while min(int(p * enough) for p in priors.tolist()) < 1:  # (1 / P in floating point may fall short)
            enough += 1
        raise ValueError(f"num_samples={num_samples} leaves class {counts.index(min(counts))} no sample (class i gets "
                         f"int(P_i * num_samples)); use num_samples >= {enough}.")
    if layout == "line":
        means = np.arange(num_classes, dtype=np.float64)[:, None]
    elif layout == "simplex":
        means = np.eye(num_classes) * math.sqrt(0.5)
    else:
        raise ValueError(f"layout must be 'line' or 'simplex', got {layout!r}.")
    rng = np.random.RandomState(seed)
    covariance = variance * np.eye(means.shape[1])
    features = np.concatenate([rng.multivariate_normal(mu, covariance, size=n) for mu, n in zip(means, counts)])
    x = torch.from_numpy(features)
    mu = torch.from_numpy(means)
    # one class at a time: the (N, K, D) differences took 10 GB at K = 80 (simplex, N = 1e5)
    sq_dist = torch.stack([((x - m) ** 2).sum(-1) for m in mu], dim=1)
    llk = -0.5 * sq_dist / variance - 0.5 * mu.shape[1] * math.log(2 * math.pi * variance)
    labels = torch.repeat_interleave(torch.arange(num_classes), torch.tensor(counts))
    return GaussianTask(features=x, labels=labels, log_likelihoods=llk, priors=priors)


def log_posteriors(log_likelihoods: Tensor, priors: Tensor) -> Tensor:
    """Bayes' rule: ``log_softmax(llk + log P)``; (N, K) from (N, K) and (K,)."""
    log_likelihoods = as_tensor(log_likelihoods, "log_likelihoods")
    if log_likelihoods.ndim != 2:
        raise ValueError(f"log_likelihoods must have shape (N, K), got {tuple(log_likelihoods.shape)}.")
    priors = as_tensor(priors, "priors")
    check_priors(priors, log_likelihoods.shape[1])
    return torch.log_softmax(log_likelihoods + priors.log(), dim=1)


def distort_likelihoods(log_likelihoods: Tensor, scale: float = 0.5, shift_first: float = 0.5) -> Tensor:
    """The "mc1" distortion: ``scale * llk``, then ``shift_first`` added to class 0's column."""
    log_likelihoods = as_tensor(log_likelihoods, "log_likelihoods")
    if not log_likelihoods.is_floating_point():  # (an int shift would drop shift_first's fraction)
        log_likelihoods = log_likelihoods.to(torch.float64)
    shift = torch.zeros(log_likelihoods.shape[1], dtype=log_likelihoods.dtype, device=log_likelihoods.device)
    shift[0] = shift_first
    return scale * log_likelihoods + shift


def scale_log_posteriors(log_post: Tensor, scale: float) -> Tensor:
    """``log_softmax(scale * log_post)``: under-confident for ``scale < 1`` (mc2: 0.2),
    over-confident for ``scale > 1`` (mcs: 5.0)."""
    return torch.log_softmax(scale * log_post, dim=1)


def ferrer_systems(task: GaussianTask, mc2_scale: float = 0.2) -> dict[str, Tensor]:
    """The six sets of log-posteriors of Ferrer §4.8 (Tables 4 and 5), keyed like the tables.

    ``Datap-*`` use the data priors and ``Mismp-*`` :func:`mismatched_priors`; ``*-cal`` use the
    exact log-likelihoods, ``*-mc1`` the distorted ones, and ``*-mc2`` scale ``*-cal`` by 0.2.
    Each value is (N, K) float64.
    """
    num_classes = task.priors.shape[0]
    systems: dict[str, Tensor] = {}
    for name, priors in (("Datap", task.priors), ("Mismp", mismatched_priors(num_classes))):
        cal = log_posteriors(task.log_likelihoods, priors)
        systems[f"{name}-cal"] = cal
        systems[f"{name}-mc1"] = log_posteriors(distort_likelihoods(task.log_likelihoods), priors)
        systems[f"{name}-mc2"] = scale_log_posteriors(cal, mc2_scale)
    return dict(sorted(systems.items()))
