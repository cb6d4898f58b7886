"""Bootstrap confidence intervals for any metric (percentile method; Ferrer & Ramos, App. E).

Each replicate draws N samples with replacement and recomputes the metric. Metrics that weigh
classes by priors (``priors=`` given, ``balanced_error_rate``, and the detection metrics ``cllr``,
``min_cllr``, ``detection_cost``, ``min_detection_cost`` and ``equal_error_rate``, which average
per-class rates) are resampled *stratified by class*: each replicate draws N_k samples with
replacement within each class k, so it keeps the data's class counts. Such a metric is a
prior-weighted combination of per-class means, the class frequencies of the data play no part in
it, and a rare class can never vanish from a replicate (which would leave its mean undefined).
Normalised metrics (``normalize=True``: NCE, NBS, NEC) without ``priors`` divide by the naive
system of the data's own class frequencies, which vary from one test set to the next: they are
resampled freely, as Ferrer & Ramos do (stratified, their intervals covered 66-86 % of a nominal
95 % on the SST-2, FVCAUS and AG News logits, drawn from each file as the population). Only where
a class has fewer than ``FEW_PER_CLASS`` samples are they stratified: there the entropy of a free
replicate's frequencies is biased low by about (K - 1) / 2N (with 1,000 classes of 3 samples the
NCE's interval [0.652, 0.663] lay wholly above its estimate 0.640). ``stratify=`` overrides the
choice.

Three paths, chosen automatically, give the same replicates for the same seed:

- fast path, for metrics that are prior-weighted means of a per-sample value (``cross_entropy``,
  ``brier_score``, ``expected_cost``, ``bayes_risk``, ``error_rate``, ``balanced_error_rate``)
  and for ``expected_calibration_error`` with equal-width bins, with any of their options, also
  through ``functools.partial``: the per-sample values (and bins) are computed once, and each
  replicate is a reduction of their per-class (per-bin) sums over the samples it drew, evaluated
  for a chunk of replicates at once;
- column path, for metrics of per-sample columns of binary problems (``smooth_calibration_error``,
  ``debiased_calibration_error``, ``sweep_calibration_error``, and ``expected_calibration_error``
  with equal-mass bins), with any of their options, also through ``functools.partial``: the
  scores and targets (N, C) (C = 1 for the top-label and binary kinds) are computed once from the
  (N, K) logits, and each replicate recomputes the metric from the rows it drew, instead of
  gathering the logits and computing the columns again (the classwise columns are (N, K)
  themselves: there a replicate saves the log-softmax, not the gather);
- general path, for any other ``metric_fn`` or when a ``calibrator`` is given: a loop that calls
  ``metric_fn`` on each resampled data set, handing it a fresh copy of the calibrator.

The column and general paths loop over the replicates; ``progress=True`` shows a progress bar.

The resampled data contain duplicates. A metric that cross-validates the ``calibrator`` inside a
replicate and takes ``groups`` (``cross_validated_calibration_loss``) is given each copy's
original row, so that copies share a fold, as Ferrer & Ramos ask (App. E): folds that spread them
fitted calibrators on copies of the samples they calibrated (isotonic regression on the
AdrenalMNIST logits: replicates of the relative calibration loss averaging +7 % around an
estimate of -1 %, against -15 % grouped).

The percentile interval describes the metric's sampling distribution, which for a binned or
kernel ECE (non-negative, and biased upwards by the noise of finite bins) lies above the true
calibration error: it is no confidence interval for it and need not contain the estimate itself
(all-tied scores with balanced labels: ECE 0, interval [0, 0.175] with 1,000 replicates). For
"is the calibration error zero?" use a test (:mod:`torchcal.functional.calibration_tests`,
:func:`~torchcal.functional.consistency_resampling.consistency_resampling_test`), and for its
size :func:`~torchcal.functional.debiased_ece.debiased_calibration_error`.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import cache, partial
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from torchcal._validation import as_tensor, check_count, check_seed, seeded_generator, stacklevel_outside_package
from torchcal.functional.decisions import (
    balanced_error_rate,
    balanced_error_rate_terms,
    bayes_risk,
    bayes_risk_terms,
    error_rate,
    error_rate_terms,
    expected_cost,
    expected_cost_terms,
)
from torchcal.functional.detection import cllr, detection_cost, equal_error_rate, min_cllr, min_detection_cost
from torchcal.functional.diagnostics import (
    BinDecomposition,
    ColumnDecomposition,
    calibration_error_columns,
    calibration_error_terms,
    expected_calibration_error,
)
from torchcal.functional.scoring import (
    SumDecomposition,
    brier_per_sample,
    brier_score,
    cross_entropy,
    epsr_terms,
    log_loss_per_sample,
    naive_brier_score,
    naive_cross_entropy,
)

__all__ = [
    "BootstrapResult",
    "bootstrap",
    "column_decomposition",
    "float64_metric_value",
    "metric_decomposition",
    "resample_indices",
    "sum_decomposition",
    "sum_reduction",
]

#: Index elements generated per chunk of replicates (bounds the memory of the fast path).
CHUNK_ELEMENTS = 1 << 22

_SUM_DECOMPOSITIONS: dict[Callable[..., Tensor], Callable[..., SumDecomposition]] = {
    cross_entropy: partial(epsr_terms, log_loss_per_sample, naive_cross_entropy),
    brier_score: partial(epsr_terms, brier_per_sample, naive_brier_score),
    expected_cost: expected_cost_terms,
    bayes_risk: bayes_risk_terms,
    error_rate: error_rate_terms,
    balanced_error_rate: balanced_error_rate_terms,
}


@cache
def _column_decompositions() -> dict[Callable[..., Tensor], Callable[..., ColumnDecomposition]]:
    """The metrics of the column path and their ``ColumnDecomposition``s (a function, as
    ``smooth_ece`` imports this module: it cannot be imported at the top)."""
    from torchcal.functional.debiased_ece import (
        debiased_calibration_error,
        debiased_calibration_error_columns,
        sweep_calibration_error,
        sweep_calibration_error_columns,
    )
    from torchcal.functional.smooth_ece import smooth_calibration_error, smooth_calibration_error_columns

    return {
        smooth_calibration_error: smooth_calibration_error_columns,
        debiased_calibration_error: debiased_calibration_error_columns,
        sweep_calibration_error: sweep_calibration_error_columns,
        expected_calibration_error: calibration_error_columns,
    }


class BootstrapResult(NamedTuple):
    estimate: Tensor  # the metric on the original data
    lower: Tensor  # lower end of the percentile interval
    upper: Tensor  # upper end
    replicates: Tensor  # (num_replicates, ...) the metric on each resampled data set


def sum_decomposition(metric_fn: Callable[..., Any]) -> Callable[..., SumDecomposition] | None:
    """The function returning the ``SumDecomposition`` of ``metric_fn``, or None if it has none.

    ``functools.partial`` objects that fix keyword options of a known metric are understood.

    Example:
        >>> from torchcal.functional import bayes_risk, zero_one_costs
        >>> terms = sum_decomposition(partial(bayes_risk, costs=zero_one_costs(2)))
        >>> terms(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([1, 1])).per_sample
        tensor([1., 0.], dtype=torch.float64)
        >>> sum_decomposition(max) is None
        True
    """
    return _registered(_SUM_DECOMPOSITIONS, metric_fn)


def column_decomposition(metric_fn: Callable[..., Any]) -> Callable[..., ColumnDecomposition] | None:
    """The function returning the ``ColumnDecomposition`` of ``metric_fn``, or None if it has none.

    ``functools.partial`` objects that fix keyword options of a known metric are understood.

    Example:
        >>> from torchcal.functional import smooth_calibration_error
        >>> columns = column_decomposition(partial(smooth_calibration_error, kind="classwise"))
        >>> columns(torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])).scores.shape
        torch.Size([5, 3])
        >>> column_decomposition(max) is None
        True
    """
    return _registered(_column_decompositions(), metric_fn)


Decomposition = TypeVar("Decomposition")


def _unwrapped(metric_fn: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(function, keyword options)`` of a ``functools.partial`` that binds keywords only, else
    ``(metric_fn, {})``."""
    if isinstance(metric_fn, partial) and not metric_fn.args:
        return metric_fn.func, metric_fn.keywords
    return metric_fn, {}


def _registered(
    registry: Mapping[Callable[..., Any], Callable[..., Decomposition]], metric_fn: Callable[..., Any]
) -> Callable[..., Decomposition] | None:
    """``registry[metric_fn]``, with the keyword options of a ``functools.partial`` of a
    registered metric bound to it; None for other functions."""
    fn, keywords = _unwrapped(metric_fn)
    decomposition = registry.get(fn)
    return partial(decomposition, **keywords) if decomposition is not None and keywords else decomposition


def metric_decomposition(
    metric_fn: Callable[..., Any], metric_kwargs: dict[str, Any]
) -> Callable[..., SumDecomposition | BinDecomposition] | None:
    """The function returning the decomposition of ``metric_fn`` called with ``metric_kwargs`` (a
    ``SumDecomposition``, or a ``BinDecomposition`` for equal-width ECE), or None when a resampling
    method (the bootstrap, consistency resampling) must recompute the metric on every resample.

    Example:
        >>> metric_decomposition(expected_calibration_error, {"n_bins": 10}) is not None
        True
        >>> metric_decomposition(expected_calibration_error, {"strategy": "quantile"}) is None
        True
    """
    terms = sum_decomposition(metric_fn)
    if terms is not None:
        return terms
    fn, keywords = _unwrapped(metric_fn)
    if fn is expected_calibration_error and {**keywords, **metric_kwargs}.get("strategy", "uniform") == "uniform":
        return partial(calibration_error_terms, **keywords)
    return None


def sum_reduction(metric_fn: Callable[..., Any], num_classes: int, **metric_kwargs: Any) -> Callable[[Tensor, Tensor], Tensor]:
    """The reduction ``(sums (..., K), counts (..., K)) -> value`` of a sum-decomposable metric (of
    logits, or of decisions for ``expected_cost``).

    The reduction depends on the options only, not on the data, so it is read off the
    decomposition of one sample per class. ``ValueError`` if ``metric_fn`` is not decomposable.

    Example:
        >>> reduce = sum_reduction(cross_entropy, 2, priors=torch.tensor([0.5, 0.5]))
        >>> float(reduce(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0])))  # per-class means 1 and 3
        2.0
    """
    terms = sum_decomposition(metric_fn)
    if terms is None:
        raise ValueError(
            f"{getattr(metric_fn, '__name__', metric_fn)!s} is not a mean of per-sample values; use one of "
            f"{', '.join(fn.__name__ for fn in _SUM_DECOMPOSITIONS)} (optionally through functools.partial)."
        )
    # one sample per class: logits, or decisions for expected_cost
    takes_decisions = _unwrapped(metric_fn)[0] is expected_cost
    dummy = torch.zeros(num_classes, dtype=torch.int64) if takes_decisions else torch.zeros(num_classes, num_classes, dtype=torch.float64)
    return terms(dummy, torch.arange(num_classes), **metric_kwargs).reduce


def resample_indices(num_samples: int, num_replicates: int, seed: int, strata: Tensor | None = None) -> Iterator[Tensor]:
    """Chunks (b, N) of bootstrap indices, drawn from a generator seeded with ``seed``.

    With ``strata: (N,)`` (e.g. the labels) every replicate draws, within each stratum, as many
    samples as it has, with replacement: the strata keep their sizes in every replicate.

    Example:
        >>> [chunk.shape for chunk in resample_indices(4, 3, seed=0)]
        [torch.Size([3, 4])]
        >>> strata = torch.tensor([0, 1, 1, 1])
        >>> all(bool((strata[chunk] == 0).sum(1).eq(1).all()) for chunk in resample_indices(4, 50, 0, strata))
        True
    """
    generator = seeded_generator(seed)
    groups = None if strata is None else [(strata.cpu() == s).nonzero().flatten() for s in strata.cpu().unique()]
    chunk = max(1, CHUNK_ELEMENTS // num_samples)
    for start in range(0, num_replicates, chunk):
        size = min(chunk, num_replicates - start)
        if groups is None:
            yield torch.randint(num_samples, (size, num_samples), generator=generator)
        else:
            yield torch.cat([g[torch.randint(g.shape[0], (size, g.shape[0]), generator=generator)] for g in groups], dim=1)


#: Metrics that average per-class rates whatever their ``priors``: their bootstrap is stratified.
_CLASS_AVERAGES = (balanced_error_rate, cllr, min_cllr, detection_cost, min_detection_cost, equal_error_rate)


#: Below this many samples in some class, a normalised score with the data's class frequencies
#: is resampled within classes (see the module docs).
FEW_PER_CLASS = 10


def normalised_resampling_is_stratified(labels: Tensor, priors: Any | None = None) -> bool:
    """Whether a normalised score is resampled within classes: with ``priors``, always (a
    prior-weighted combination of per-class means); with the data's own class frequencies, where
    some class present in ``labels: (N,)`` has fewer than ``FEW_PER_CLASS`` samples."""
    if priors is not None:
        return True
    counts = torch.unique(labels, return_counts=True)[1]
    return counts.numel() > 0 and int(counts.min()) < FEW_PER_CLASS


def _stratified_by_default(metric_fn: Callable[..., Any], metric_kwargs: dict[str, Any], labels: Tensor) -> bool:
    """Whether the bootstrap of ``metric_fn`` resamples within classes by default: where it
    combines per-class means with priors the data do not set (``priors=`` given, or one of
    ``_CLASS_AVERAGES``), or divides by the naive system of the data's class frequencies
    (``normalize=True``) while some class is rare (:func:`normalised_resampling_is_stratified`)."""
    fn, keywords = _unwrapped(metric_fn)
    options = {**keywords, **metric_kwargs}
    if fn in _CLASS_AVERAGES or options.get("priors") is not None:
        return True
    return options.get("normalize") is True and normalised_resampling_is_stratified(labels)


def _sums_per_replicate(keys: Tensor, values: list[Tensor], num_keys: int, index: Tensor) -> Tensor:
    """Per-key sums (V, b, num_keys) float64 of each of ``values`` over the draws ``index: (b, N)``
    of b replicates; ``keys`` and ``values`` are (N,) or (N, C), a key per sample and column."""
    sums = torch.zeros(len(values), index.shape[0], num_keys, dtype=torch.float64, device=keys.device)
    rows = max(1, CHUNK_ELEMENTS // keys.numel())  # replicates whose draws fit the memory bound
    for start in range(0, index.shape[0], rows):
        part = index[start : start + rows]
        drawn = keys[part].reshape(part.shape[0], -1)
        for total, value in zip(sums[:, start : start + rows], values):
            total.scatter_add_(1, drawn, value[part].reshape(part.shape[0], -1).to(torch.float64))
    return sums


def _or_nan(like: Tensor, value: Callable[..., Tensor], *args: Any) -> Tensor:
    """``value(*args)``, or NaN shaped as ``like`` where the metric is undefined (``ValueError``)."""
    try:
        return value(*args)
    except ValueError:
        return torch.full_like(like, math.nan)


def _reduce_one(terms: SumDecomposition | BinDecomposition, sums: Tensor) -> Tensor:
    """The metric of one replicate from its sums (V, 1, ...)."""
    return terms.reduce(*sums)[0]


def _replicates(terms: SumDecomposition | BinDecomposition, num_replicates: int, seed: int, strata: Tensor | None,
                like: Tensor) -> Tensor:
    """The metric on each of ``num_replicates`` resamples, from the sums of their decompositions
    (NaN, shaped as the estimate ``like``, on a resample where it is undefined)."""
    shape: tuple[int, ...]
    if isinstance(terms, SumDecomposition):  # reduce(sums, counts), each (b, K)
        keys, shape = terms.labels, (terms.num_classes,)
        values = [terms.per_sample, torch.ones_like(terms.per_sample)]
    else:  # reduce(counts, score_sums, target_sums), each (b, C, M)
        keys, shape = terms.keys, terms.shape
        values = [torch.ones_like(terms.scores), terms.scores, terms.targets]
    replicates = []
    rows = max(1, CHUNK_ELEMENTS // math.prod(shape))  # replicates whose sums fit the memory bound
    for index in resample_indices(keys.shape[0], num_replicates, seed, strata):
        for part in index.split(rows):
            sums = _sums_per_replicate(keys, values, math.prod(shape), part.to(keys.device)).reshape(len(values), part.shape[0], *shape)
            try:
                replicates.append(terms.reduce(*sums))
            except ValueError:  # some resample leaves it undefined (see bootstrap): one at a time
                replicates.append(torch.stack([_or_nan(like, _reduce_one, terms, sums[:, i : i + 1]) for i in range(part.shape[0])]))
    return torch.cat(replicates)


def float64_metric_value(value: Any) -> Tensor:
    """A metric's value as a float64 tensor; tuples (e.g. ``CalibrationLossResult``) are stacked.

    Example:
        >>> float64_metric_value((torch.tensor(1.0), 2.0))
        tensor([1., 2.], dtype=torch.float64)
    """
    if isinstance(value, tuple):
        return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in value])
    return torch.as_tensor(value, dtype=torch.float64)


def bootstrap(
    metric_fn: Callable[..., Any],
    logits: Tensor,
    labels: Tensor,
    num_replicates: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    calibrator: Any | None = None,
    stratify: bool | None = None,
    progress: bool = False,
    **metric_kwargs: Any,
) -> BootstrapResult:
    """Percentile bootstrap interval of ``metric_fn(logits, labels, **metric_kwargs)``.

    Args:
        metric_fn: any function of ``(logits, labels, **metric_kwargs)`` returning a tensor or a
            tuple of scalars (stacked into a vector). The torchcal scoring rules, expected-cost
            functions and calibration errors take the fast or the column path (module docs).
        logits: (N, K) scores, or the (N,) decisions for ``expected_cost``; resampled along dim 0.
        labels: (N,) class indices.
        num_replicates: number of bootstrap replicates B.
        confidence: coverage of the interval, e.g. 0.95 for the 2.5 % and 97.5 % percentiles.
        seed: seed of the resampling (the same seed gives the same replicates on every path).
        calibrator: if given, every call of ``metric_fn`` receives ``calibrator=`` a fresh deep
            copy of it, e.g. with ``cross_validated_calibration_loss`` to refit the calibrator
            inside each replicate.
        stratify: resample within each class, keeping the class counts (see the module docs).
            ``None``: stratified where the metric weighs classes by priors, and for a normalised
            score without ``priors`` where some class has fewer than ``FEW_PER_CLASS`` samples.
        progress: show a tqdm progress bar of the replicates on the column and general paths (the
            fast path takes seconds and shows none).
        **metric_kwargs: passed to ``metric_fn`` (e.g. ``priors=``, ``normalize=``, ``costs=``).

    A resample can leave the metric undefined where the data do not (unstratified, a rare class
    drawn no sample: a normalised score's naive reference is then perfect). Such replicates are NaN
    in ``replicates``, the interval is that of the others, and a warning says how many there were
    (``stratify=True`` keeps every class in every resample).

    Example:
        >>> import torch
        >>> from torchcal.functional import cross_entropy
        >>> logits, labels = torch.randn(500, 3), torch.randint(0, 3, (500,))
        >>> result = bootstrap(cross_entropy, logits, labels, num_replicates=200)
        >>> bool(result.lower < result.estimate < result.upper), result.replicates.shape
        (True, torch.Size([200]))
    """
    check_count(num_replicates, "num_replicates", 2)  # a percentile interval needs two replicates
    check_seed(seed)
    if isinstance(confidence, Tensor) and confidence.numel() == 1:
        confidence = float(confidence)
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}.")
    _check_options(metric_fn, metric_kwargs, calibrator)
    # An interval is not differentiable; the fast paths' in-place sums refuse inputs that require grad.
    logits, labels = as_tensor(logits, "logits").detach(), as_tensor(labels, "labels")
    if logits.ndim == 0 or labels.ndim == 0 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"logits and labels must have the same number N of rows to resample, got shapes "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}."
        )

    if stratify is None:
        stratify = _stratified_by_default(metric_fn, metric_kwargs, labels)
    strata = labels if stratify else None
    terms = metric_decomposition(metric_fn, metric_kwargs) if calibrator is None else None
    if terms is not None:
        decomposition = terms(logits, labels, **metric_kwargs)
        estimate = decomposition.evaluate()
        replicates = _replicates(decomposition, num_replicates, seed, strata, estimate)
    else:
        estimate, on_resample = _evaluator(metric_fn, logits, labels, calibrator, metric_kwargs)
        resamples = _resamples(labels.shape[0], num_replicates, seed, strata, progress, _metric_name(metric_fn))
        replicates = torch.stack([_or_nan(estimate, on_resample, index) for index in resamples])
    nan = replicates.isnan().reshape(num_replicates, -1)
    if bool(nan.all(1).all()):
        raise ValueError(f"{_metric_name(metric_fn)} is undefined on every bootstrap resample of these data (e.g. a class "
                         f"drawn no sample); resample within classes (stratify=True).")
    # a metric of several values (posterior_quality's NCE, say) can lose some of them on a resample;
    # those the data themselves leave undefined (NaN estimates) are no news
    undefined = int(nan[:, ~estimate.isnan().reshape(-1)].any(1).sum())
    if undefined:
        some = " (some of its values)" if nan.shape[1] > 1 else ""
        warnings.warn(f"{_metric_name(metric_fn)}{some} is undefined on {undefined} of {num_replicates} bootstrap resamples "
                      f"(a class drawn no sample, say); the interval is that of the other replicates. stratify=True keeps "
                      f"every class in every resample.", stacklevel=stacklevel_outside_package())
    alpha = (1 - confidence) / 2
    levels = torch.tensor([alpha, 1 - alpha], dtype=torch.float64, device=replicates.device)
    lower, upper = (torch.nanquantile if bool(nan.any()) else torch.quantile)(replicates, levels, dim=0)
    return BootstrapResult(estimate, lower, upper, replicates)


def _evaluator(
    metric_fn: Callable[..., Any], logits: Tensor, labels: Tensor, calibrator: Any | None, metric_kwargs: dict[str, Any]
) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The metric on the data, and the function giving it on the resample ``index: (N,)``: from
    the rows of its columns on the column path, by calling ``metric_fn`` on the general path."""
    columns = column_decomposition(metric_fn) if calibrator is None else None
    if columns is not None:
        decomposition = columns(logits, labels, **metric_kwargs)
        scores, targets = decomposition.scores, decomposition.targets

        def on_rows(index: Tensor) -> Tensor:
            index = index.to(scores.device)
            return float64_metric_value(decomposition.of_rows(scores[index], targets[index]))

        return float64_metric_value(decomposition.evaluate()), on_rows

    # a cross-validating metric keeps a resample's copies of a row in one fold (see the module docs)
    grouped = calibrator is not None and "groups" not in metric_kwargs and _takes_groups(metric_fn)

    def call(x: Tensor, y: Tensor, groups: Tensor | None = None) -> Tensor:
        extra = {} if calibrator is None else {"calibrator": copy.deepcopy(calibrator)}
        if groups is not None:
            extra["groups"] = groups
        return float64_metric_value(metric_fn(x, y, **metric_kwargs, **extra))

    def resampled(index: Tensor) -> Tensor:
        return call(logits[index.to(logits.device)], labels[index.to(labels.device)], index if grouped else None)

    return call(logits, labels), resampled


def _takes_groups(metric_fn: Callable[..., Any]) -> bool:
    """Whether ``metric_fn`` takes a ``groups`` argument (as ``cross_validated_calibration_loss``)."""
    try:
        return "groups" in inspect.signature(metric_fn).parameters
    except (TypeError, ValueError):
        return False


def _resamples(
    num_samples: int, num_replicates: int, seed: int, strata: Tensor | None, progress: bool, metric_name: str
) -> Iterator[Tensor]:
    """The indices (N,) of each replicate's resample (those of ``resample_indices``), one at a
    time, counted on a progress bar when ``progress`` is set (and the output is a terminal)."""
    indices = (index for chunk in resample_indices(num_samples, num_replicates, seed, strata) for index in chunk)
    bar = tqdm(indices, total=num_replicates, desc=f"{metric_name}: bootstrap replicates",
               disable=None if progress else True, leave=False)
    return iter(bar)


def _check_options(metric_fn: Callable[..., Any], metric_kwargs: dict[str, Any], calibrator: Any | None) -> None:
    """Refuse ``metric_kwargs`` that ``metric_fn`` does not take, naming it: the fast paths pass them
    to the metric's decomposition, whose name the error gave (``normalise=True`` for
    ``cross_entropy``: "epsr_terms() got an unexpected keyword argument")."""
    try:
        signature = inspect.signature(metric_fn)
    except (TypeError, ValueError):  # (a callable without a signature: it says so itself when called)
        return
    extra = {} if calibrator is None else {"calibrator": calibrator}
    try:
        signature.bind(None, None, **metric_kwargs, **extra)
    except TypeError as err:
        raise TypeError(f"{_metric_name(metric_fn)} does not take the options {sorted(metric_kwargs)}"
                        f"{' and a calibrator' if extra else ''}: {err}.") from None


def _metric_name(metric_fn: Callable[..., Any]) -> str:
    """The name of a metric function (of the function a ``functools.partial`` wraps)."""
    fn = metric_fn.func if isinstance(metric_fn, partial) else metric_fn
    return getattr(fn, "__name__", type(fn).__name__)
