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

import torch
from torch import Tensor

from torchcal._validation import check_count, seeded_generator
from torchcal.functional.bootstrap import resample_indices
from torchcal.functional.diagnostics import ReliabilityBins, Strategy, bin_indices, binned_scores

__all__ = ["BinIntervals", "binomial_interval", "consistency_bands", "reliability_intervals"]

Method = Literal["clopper-pearson", "wilson"]


class BinIntervals(NamedTuple):
    """Per-bin lower and upper ends (M,) of the frequency's interval; NaN for empty bins."""

    lower: Tensor
    upper: Tensor


# The continued fraction runs this many terms between convergence checks (a host synchronisation
# each): at the beta quantiles of the intervals it needs a few dozen terms even at n = 1e7, at a
# point near the mean about 4 n^(1/3) (521 at n = 2e6).
_CF_CHUNK = 16
_CF_MAX_TERMS = 1 << 14
# Halley steps of the beta quantile stop below this relative change in x (the prefactor
# x^a (1 - x)^b / B(a, b) carries a relative error of about 1e-16 (a + b), which bounds the
# accuracy of the root for bins of billions).
_QUANTILE_RTOL = 1e-12
_QUANTILE_MAX_STEPS = 100


def _betainc(a: Tensor, b: Tensor, x: Tensor) -> Tensor:
    """The regularised incomplete beta function ``I_x(a, b)`` of float64 tensors (broadcast).

    The continued fraction of Numerical Recipes (6.4) by the modified Lentz method, for
    ``I_{1-x}(b, a) = 1 - I_x(a, b)`` where ``x > (a + 1) / (a + b + 2)``: there it converges
    slowly. Its terms run until every element has converged, checked every ``_CF_CHUNK`` terms.
    """
    swap = x > (a + 1) / (a + b + 2)
    a, b, x = torch.where(swap, b, a), torch.where(swap, a, b), torch.where(swap, 1 - x, x)
    tiny = torch.finfo(torch.float64).tiny

    def guarded(v: Tensor) -> Tensor:
        return torch.where(v.abs() < tiny, tiny, v)

    c = torch.ones_like(x)
    d = 1 / guarded(1 - (a + b) * x / (a + 1))
    fraction = d
    for m in range(1, _CF_MAX_TERMS + 1):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        changes = []
        for term in (even, odd):
            d = 1 / guarded(1 + term * d)
            c = guarded(1 + term / c)
            changes.append(d * c)
            fraction = fraction * changes[-1]
        # (converged terms still change it by a few 1e-15: round-off)
        if m % _CF_CHUNK == 0 and bool((torch.stack(changes) - 1).abs().max() <= 1e-13):
            break
    log_front = a * torch.log(x) + b * torch.log1p(-x) - _log_beta(a, b) - torch.log(a)
    value = torch.exp(log_front) * fraction
    return torch.where(swap, 1 - value, value)


def _log_beta(a: Tensor, b: Tensor) -> Tensor:
    return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)


def _beta_quantile(a: Tensor, b: Tensor, p: Tensor) -> Tensor:
    """The ``p``-quantile ``x`` of Beta(a, b), ``I_x(a, b) = p``, for float64 tensors with
    ``a, b >= 1`` (broadcast).

    Numerical Recipes' ``invbetai``: a normal approximation, then Halley steps kept inside the
    bracket that the signs of ``I_x(a, b) - p`` have given (bisection where a step would leave it).
    """
    z = -torch.special.ndtri(p)  # the start of Numerical Recipes (6.4), in their signs
    shape = (z.square() - 3) / 6
    h = 2 / (1 / (2 * a - 1) + 1 / (2 * b - 1))
    w = z * torch.sqrt(shape + h) / h - (1 / (2 * b - 1) - 1 / (2 * a - 1)) * (shape + 5 / 6 - 2 / (3 * h))
    x = a / (a + b * torch.exp(2 * w))
    x = torch.where((x > 0) & (x < 1), x, 0.5)
    lower, upper = torch.zeros_like(x), torch.ones_like(x)
    log_norm = _log_beta(a, b)
    previous = before = torch.ones_like(x)  # the lengths of the last two steps
    done = torch.zeros_like(x, dtype=torch.bool)
    for _ in range(_QUANTILE_MAX_STEPS):
        error = _betainc(a, b, x) - p
        lower, upper = torch.where(error < 0, x, lower), torch.where(error > 0, x, upper)
        density = torch.exp((a - 1) * torch.log(x) + (b - 1) * torch.log1p(-x) - log_norm)
        newton = error / density
        step = newton / (1 - 0.5 * torch.clamp(newton * ((a - 1) / x - (b - 1) / (1 - x)), max=1))
        # Bisection where the step leaves the bracket (NaN and infinite steps too) or is not half
        # the step before the last, as in Numerical Recipes' rtsafe: Halley crawls through a tail
        # (Beta(1000, 2)'s from 0.6 by 0.2 % a step).
        candidate = x - step
        halley = (lower <= candidate) & (candidate <= upper) & (2 * step.abs() <= before)
        candidate = torch.where(halley, candidate, (lower + upper) / 2)
        # a converged element stays where it is: its round-off steps, not half the one before,
        # would send it to the bisection's midpoint (in a batch, the interval of a bin of 78,054
        # came out as [0.505, 0.442])
        candidate = torch.where(done, x, candidate)
        before, previous = previous, (candidate - x).abs()
        x = candidate
        done |= previous <= _QUANTILE_RTOL * x
        if bool(done.all()):
            break
    return x


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}.")


def binomial_interval(successes: Tensor, trials: Tensor, confidence: float = 0.95, method: Method = "clopper-pearson") -> BinIntervals:
    """Two-sided interval for a binomial proportion; ``successes`` and ``trials`` of any shape.

    Clopper–Pearson's ends are beta quantiles, ``Beta(k, n - k + 1)``'s ``alpha / 2`` and
    ``Beta(k + 1, n - k)``'s ``1 - alpha / 2``, solved in float64 on the input's device (Halley
    steps on the incomplete beta function's continued fraction: torch has no inverse incomplete
    beta function); the upper end as one minus ``Beta(n - k, k + 1)``'s ``alpha / 2`` quantile, as
    ``1 - alpha / 2`` itself is not resolved in float64 at high confidence (at 1 - 1e-12 the ends
    of k = 50 of 100 were 2e-8 off and not symmetric), and the ends of k = 0 and k = n in closed
    form. Wilson is closed-form in torch. The ends agree with SciPy's ``betaincinv`` to 1e-10 up
    to n = 2e6 and confidences of 1 - 1e-12 (tested); the prefactor's round-off, about 1e-16 n
    relative, shows beyond that (1e-6 at n = 1e9).

    Example:
        >>> lower, upper = binomial_interval(torch.tensor([0., 7.]), torch.tensor([10., 10.]))
        >>> lower.round(decimals=4).tolist(), upper.round(decimals=4).tolist()
        ([0.0, 0.3475], [0.3085, 0.9333])
    """
    _check_confidence(confidence)
    successes, trials = successes.to(torch.float64), trials.to(torch.float64)
    if not bool(((successes >= 0) & (successes <= trials) & torch.isfinite(trials)).all()):
        raise ValueError("successes must lie in [0, trials] (and trials >= 0), element by element, and trials be finite.")
    alpha = 1 - confidence
    empty = trials <= 0
    if method == "clopper-pearson":
        k, n = successes, trials
        # both ends in one solve at alpha / 2, (2, ...): the lower end, and one minus the upper;
        # a = b = 1 stands in where an end is 0 or 1 (k = 0, k = n)
        fixed = torch.stack([k <= 0, k >= n])
        a = torch.where(fixed, 1.0, torch.stack([k, n - k]))
        b = torch.where(fixed, 1.0, torch.stack([n - k + 1, k + 1]))
        lower, upper_complement = _beta_quantile(a, b, torch.full_like(a, alpha / 2)).unbind(0)
        # k = 0: the upper end solves (1 - x)^n = alpha / 2; k = n: the lower end, x^n = alpha / 2
        root = torch.log(torch.tensor(alpha / 2, dtype=torch.float64, device=k.device)) / n.clamp_min(1)
        lower = torch.where(k <= 0, 0.0, torch.where(k >= n, torch.exp(root), lower))
        upper = torch.where(k >= n, 1.0, torch.where(k <= 0, -torch.expm1(root), 1 - upper_complement))
    elif method == "wilson":
        z = torch.special.ndtri(successes.new_tensor(1 - alpha / 2))
        n = trials.clamp_min(1)
        p = successes / n
        centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
        half = z / (1 + z**2 / n) * torch.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
        lower, upper = (centre - half).clamp_min(0), (centre + half).clamp_max(1)
        # exactly 0 at k = 0 and 1 at k = n, where round-off left 1e-17 and 1 - 1e-16: an end beyond
        # the bin's frequency, whose error bar matplotlib refuses as negative
        lower, upper = torch.where(successes <= 0, 0.0, lower), torch.where(successes >= trials, 1.0, upper)
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
    if not isinstance(bins, ReliabilityBins):
        raise TypeError(f"bins must be the ReliabilityBins of reliability_bins(logits, labels), got {type(bins).__name__}; "
                        f"call reliability_intervals(reliability_bins(logits, labels)).")
    if bins.frequency.shape != bins.counts.shape:
        raise ValueError(f"bins.frequency {tuple(bins.frequency.shape)} and bins.counts {tuple(bins.counts.shape)} must "
                         f"have one entry per bin each; pass the ReliabilityBins of reliability_bins().")
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
    binned = binned_scores(logits, labels, n_bins, strategy, kind, class_index, ("top-label", "binary", "class"))
    scores = binned.scores[:, 0]
    index = bin_indices(binned.scores, binned.edges.reshape(-1, n_bins + 1)[:1], binned.tolerance)[:, 0]
    counts = torch.zeros(n_bins, dtype=torch.float64, device=scores.device).index_add_(0, index, torch.ones_like(scores))
    observed_mean = torch.zeros_like(counts).index_add_(0, index, scores) / counts.clamp_min(1)
    generator = seeded_generator(seed)
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
