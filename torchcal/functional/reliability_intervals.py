"""Error bars for reliability diagrams.

- ``binomial_interval`` / ``reliability_intervals``: a confidence interval for each bin's
  frequency, treating the bin's targets as binomial: Clopper–Pearson (exact, conservative; the
  default, as PyCalib's ``proportion_confint(method="beta")``) or Wilson (score interval). Unlike
  the bootstrap, neither collapses to zero width in a bin whose targets are all 0 or all 1.
- ``consistency_bands``: Bröcker & Smith 2007's consistency bars, where a calibrated model's
  frequencies would fall: each resample draws surrogate scores with replacement from the observed
  ones and surrogate targets ``y* ~ Bernoulli(s*)`` (i.e. under calibration), and bins them with the
  observed bins; the band of bin m is ``sbar_m + quantiles(ybar*_m - sbar*_m)``, around the
  diagonal at the bin's mean score. All resamples at once on the scores' device.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import check_count
from torchcal.functional.bootstrap import resample_indices
from torchcal.functional.diagnostics import ReliabilityBins, Strategy, bin_indices, binned_scores

__all__ = ["BinIntervals", "binomial_interval", "consistency_bands", "reliability_intervals"]

Method = Literal["clopper-pearson", "wilson"]


class BinIntervals(NamedTuple):
    """Per-bin lower and upper ends (M,) of the frequency's interval; NaN for empty bins."""

    lower: Tensor
    upper: Tensor


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}.")


def binomial_interval(successes: Tensor, trials: Tensor, confidence: float = 0.95, method: Method = "clopper-pearson") -> BinIntervals:
    """Two-sided interval for a binomial proportion; ``successes`` and ``trials`` of any shape.

    Clopper–Pearson uses the beta quantiles of SciPy (on the CPU: torch has no inverse incomplete
    beta function), then returns to the input's device; Wilson is closed-form in torch.

    Example:
        >>> lower, upper = binomial_interval(torch.tensor([0., 7.]), torch.tensor([10., 10.]))
        >>> lower.round(decimals=4).tolist(), upper.round(decimals=4).tolist()
        ([0.0, 0.3475], [0.3085, 0.9333])
    """
    _check_confidence(confidence)
    successes, trials = successes.to(torch.float64), trials.to(torch.float64)
    if not bool(((successes >= 0) & (successes <= trials)).all()):
        raise ValueError("successes must lie in [0, trials] (and trials >= 0), element by element.")
    alpha = 1 - confidence
    empty = trials <= 0
    if method == "clopper-pearson":
        from scipy.special import betaincinv  # the beta quantile; scipy.special imports quickly

        k, m = successes.cpu().numpy(), trials.cpu().numpy()
        with np.errstate(invalid="ignore"):  # k = 0 and k = n give NaN, replaced below
            lower = torch.from_numpy(betaincinv(k, m - k + 1, alpha / 2)).to(successes.device)
            upper = torch.from_numpy(betaincinv(k + 1, m - k, 1 - alpha / 2)).to(successes.device)
        lower = torch.where(successes <= 0, torch.zeros_like(lower), lower)
        upper = torch.where(successes >= trials, torch.ones_like(upper), upper)
    elif method == "wilson":
        z = torch.special.ndtri(successes.new_tensor(1 - alpha / 2))
        n = trials.clamp_min(1)
        p = successes / n
        centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
        half = z / (1 + z**2 / n) * torch.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
        lower, upper = (centre - half).clamp_min(0), (centre + half).clamp_max(1)
    else:
        raise ValueError(f'method must be "clopper-pearson" or "wilson", got {method!r}.')
    nan = torch.full_like(lower, float("nan"))
    return BinIntervals(torch.where(empty, nan, lower), torch.where(empty, nan, upper))


def reliability_intervals(bins: ReliabilityBins, confidence: float = 0.95, method: Method = "clopper-pearson") -> BinIntervals:
    """``binomial_interval`` of each bin's frequency in ``ReliabilityBins`` (M,); NaN for empty bins.

    Example:
        >>> from torchcal.functional import reliability_bins
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> intervals = reliability_intervals(reliability_bins(probs.log(), torch.tensor([0, 1, 1, 0]), n_bins=2))
        >>> intervals.upper.round(decimals=4).tolist()
        [nan, 0.9324]
    """
    successes = (bins.frequency * bins.counts).round()
    return binomial_interval(successes, bins.counts, confidence, method)


def consistency_bands(
    logits: Tensor,
    labels: Tensor,
    n_bins: int = 15,
    strategy: Strategy = "uniform",
    kind: Literal["top-label", "binary", "class"] = "top-label",
    class_index: int | None = None,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> BinIntervals:
    """Bröcker & Smith's consistency bands (M,) for ``reliability_bins`` with the same arguments.

    The observed labels only fix which bins exist (the targets of ``kind``); the band is where
    the bin's frequency would lie, with that probability, if the model were calibrated. NaN for
    empty bins and for bins no resample populates.

    Example:
        >>> import torch
        >>> q = torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> labels = torch.bernoulli(q, generator=torch.Generator().manual_seed(1)).long()
        >>> band = consistency_bands(torch.stack([(1 - q).log(), q.log()], 1), labels, n_bins=5, kind="binary")
        >>> bool(((band.lower < torch.tensor([.1, .3, .5, .7, .9])) & (torch.tensor([.1, .3, .5, .7, .9]) < band.upper)).all())
        True
    """
    _check_confidence(confidence)
    check_count(num_resamples, "num_resamples", 2)  # a percentile band needs two resamples
    if kind == "classwise":
        raise ValueError('consistency_bands describes one binary problem: use kind="class" with a class_index.')
    binned = binned_scores(logits, labels, n_bins, strategy, kind, class_index)
    scores = binned.scores[:, 0]
    index = bin_indices(binned.scores, binned.edges.reshape(-1, n_bins + 1)[:1], binned.tolerance)[:, 0]
    counts = torch.zeros(n_bins, dtype=torch.float64, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    observed_mean = torch.zeros_like(counts).index_add_(0, index, scores) / counts.clamp_min(1)
    generator = torch.Generator().manual_seed(seed)
    # NaN where a resample leaves the bin empty: a positive NaN, not 0 / 0's, whose sign bit CUDA's
    # sort puts before the numbers, against what nanquantile assumes (pytorch#190781; on an H200
    # with torch 2.11 a band's end moved from 1 to 0)
    empty = torch.tensor(float("nan"), dtype=torch.float64, device=scores.device)
    deviations = []
    for draws in resample_indices(scores.shape[0], num_resamples, seed):
        draws = draws.to(scores.device)
        surrogate = scores[draws]  # (b, N)
        uniform = torch.rand(draws.shape, generator=generator, dtype=torch.float64).to(scores.device)
        outcome = (uniform < surrogate).to(torch.float64)
        keys = index[draws]
        sums = torch.zeros(3, draws.shape[0], n_bins, dtype=torch.float64, device=scores.device)
        for total, value in zip(sums, (torch.ones_like(surrogate), surrogate, outcome)):
            total.scatter_add_(1, keys, value)
        deviations.append(torch.where(sums[0] > 0, (sums[2] - sums[1]) / sums[0].clamp_min(1), empty))
    alpha = (1 - confidence) / 2
    levels = torch.tensor([alpha, 1 - alpha], dtype=torch.float64, device=scores.device)
    lower, upper = torch.nanquantile(torch.cat(deviations), levels, dim=0)
    nan = torch.full_like(lower, float("nan"))
    return BinIntervals(torch.where(counts > 0, observed_mean + lower, nan), torch.where(counts > 0, observed_mean + upper, nan))
