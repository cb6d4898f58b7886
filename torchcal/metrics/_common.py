"""Conventions shared by every metric class: how ``update`` reads its inputs, ``plot``, states.

A metric that scores class posteriors subclasses :class:`ScoreMetric` and starts ``update`` with
``self._scores``::

    class MyMetric(ScoreMetric):
        total: Tensor  # states are annotated so that type checkers see tensors, not Modules

        def __init__(self, num_classes: int, **kwargs: Any) -> None:
            super().__init__(num_classes, **kwargs)  # input, ignore_index, validate_args, Metric's kwargs
            add_sum_state(self, "total", num_classes)

        def update(self, scores: Tensor, labels: Tensor) -> None:
            batch = self._scores(scores, labels)
            if batch is None:  # an empty batch, or every label ignored: a no-op
                return
            logits, labels = batch  # (N, K) log-domain scores, (N,) int64 labels in [0, K)
            ...

        def compute(self) -> Tensor:  # ONE float64 tensor: a scalar, or (K,) per class
            ...

What ``_scores`` does, in this order:

1. shapes: scores ``(N, K, d1, ...)`` with labels ``(N, d1, ...)`` (segmentation) become
   ``(N d1 ..., K)`` and ``(N d1 ...,)`` (memory stays O(K + bins) for pixel-level metrics); with
   K = 2, scores of the labels' shape ``(N,)`` or ``(N, d1, d2, ...)`` are the score of class 1, of
   the declared ``input`` kind (a probability, its log, or the log-odds for ``"logits"``);
2. ``ignore_index``: samples with that label are dropped;
3. an empty batch returns ``None``;
4. ``validate_args=True`` (default): ``torchcal._validation`` checks (finite scores, labels in
   [0, K), probabilities on the simplex for ``input="probs"``), and log-domain scores that look
   like probabilities warn, as ``torchcal.heads`` does (the kind was probably mis-declared);
   ``False`` skips all of it in trusted hot loops;
5. ``input="probs"`` becomes ``log(probs)``; ``"logits"`` and ``"log_probs"`` are used as they are
   (any unnormalised log-posteriors).

A metric whose first input is not scores (``ExpectedCost``: decisions) subclasses
:class:`BatchMetric` and calls ``self._flattened(preds, labels)`` for steps 1-3.

``plot(val=None, ax=None)`` is torchmetrics' own plot of a value (``compute()`` when ``val`` is
None, or a list of values over time). Set ``plot_lower_bound``/``plot_upper_bound`` on the class.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, get_args

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from torchcal._validation import (
    as_tensor,
    binary_probability_columns,
    check_count,
    check_labels,
    check_logits_and_labels,
    check_probs,
    compute_dtype,
    floored_log,
    looks_like_probs,
    stable_repr,
    stacklevel_outside_package,
    total_may_be_of_probs,
)
from torchcal.functional.diagnostics import binning_scores, check_binary_kind
from torchcal.functional.scoring import to_log_probs

__all__ = ["BatchMetric", "InputKind", "ScoreMetric", "add_cat_state", "add_sum_state", "check_num_classes"]

InputKind = Literal["logits", "log_probs", "probs"]
_DIGEST_BYTES = 8  # compared by torch.allclose: whole numbers 0..255 that differ are never close
_INPUT_KINDS = get_args(InputKind)
#: One column of log-odds with at least this many rows, all in [0, 1] (every posterior of class 1
#: between 0.5 and 0.73), is taken for probabilities (torchmetrics' binary convention) mis-declared.
_MIN_ROWS_OF_PROBABILITY_COLUMN = 20
ResultT = TypeVar("ResultT", bound=NamedTuple)


def check_num_classes(num_classes: int) -> int:
    """``num_classes`` as an int >= 2, or ``ValueError``."""
    return check_count(num_classes, "num_classes", 2)


def add_sum_state(metric: Metric, name: str, *shape: int) -> None:
    """A float64 accumulator of the given shape, summed across processes."""
    if None in shape:  # a ScoreMetric built with num_classes=None, whose state has a size per class
        raise ValueError(
            f"{type(metric).__name__} needs num_classes, the number of classes K (an integer >= 2): its "
            f"state holds one sum per class; got num_classes=None."
        )
    metric.add_state(name, torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum", persistent=False)


def add_cat_state(metric: BatchMetric, name: str, dtype: torch.dtype, *trailing: int) -> None:
    """A list of per-sample tensors ``(N, *trailing)`` of ``dtype``, concatenated across processes
    (also from a process without samples: see ``BatchMetric._sync_dist``)."""
    if None in trailing:  # (its empty state, before any sample or on a process without one, has this shape)
        raise ValueError(
            f"{type(metric).__name__} needs num_classes, the number of classes K (an integer >= 2): it keeps "
            f"one column per class for every sample; got num_classes=None."
        )
    metric.add_state(name, [], dist_reduce_fx="cat", persistent=False)
    metric._cat_states[name] = (dtype, trailing)


#: What torchmetrics' ``forward`` changes besides the states, and restores only when it succeeds.
_FORWARD_CONTEXT = ("_update_count", "_computed", "_is_synced", "_should_unsync", "_to_sync", "compute_on_cpu", "_enable_grad")


class BatchMetric(Metric):
    """A ``Metric`` with the shared ``ignore_index``, ``validate_args``, extra dimensions, empty
    batches and ``plot`` (see the module docs).

    Args:
        ignore_index: a label whose samples are left out (e.g. 255 for unlabelled pixels).
        validate_args: check every batch; ``False`` skips the checks.
        kwargs: passed to ``torchmetrics.Metric``.
    """

    #: Options that only ``compute`` reads: metrics that differ in nothing else may share one state.
    _compute_only_options: tuple[str, ...] = ()
    options_digest: Tensor
    sample_count: Tensor

    def __init__(self, *, ignore_index: int | None = None, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._cat_states: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # (add_cat_state)
        self._metric_attributes = frozenset(vars(self))  # torchmetrics' own: none of them changes a state
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise ValueError(f"ignore_index must be an integer label or None, got {ignore_index!r}.")
        self.ignore_index, self.validate_args = ignore_index, validate_args
        # A MetricCollection puts metrics whose states are equal after the first update into one
        # compute group, which shares their states from then on. Metrics whose updates differ (two
        # BayesRisk cost matrices, say) can have equal states after one batch by chance (the same
        # decisions under both costs) and would then share wrong ones: this state, a digest of the
        # options the update depends on, keeps them apart.
        self.add_state("options_digest", torch.zeros(_DIGEST_BYTES, dtype=torch.float64), dist_reduce_fx="max", persistent=False)
        self._options_digest: Tensor | None = None
        add_sum_state(self, "sample_count")  # the samples kept by update (see _wrap_compute)
        self._pending_samples = 0  # the batch's, counted once its update has passed its checks (_wrap_update)
        self._batch_only = False  # compute() runs on one batch alone, inside forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """torchmetrics' ``forward``: adds the batch to the state and returns the metric of the
        batch alone, NaN where the batch alone leaves it undefined (see ``_wrap_compute``):
        ``self.log(name, metric(scores, labels))`` with ``BalancedErrorRate`` on CIFAR-100 batches
        of 128, which always miss some class, would otherwise raise at every step (and lose the
        state accumulated so far: torchmetrics has reset it to the batch's by then).

        A batch that its checks refuse raises, and leaves the state accumulated so far as it was
        (torchmetrics' ``forward`` had reset it to the batch's before the checks ran: a NaN logit
        after 2,000 good samples left none)."""
        # (references suffice: torchmetrics' reset puts new tensors and lists in their place)
        kept = {name: getattr(self, name) for name in (*self._defaults, *_FORWARD_CONTEXT) if hasattr(self, name)}
        self._batch_only = True
        try:
            return super().forward(*args, **kwargs)
        except Exception:
            for name, value in kept.items():
                setattr(self, name, value)
            raise
        finally:
            self._batch_only = False

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        """torchmetrics' wrapper (sync across processes, cache) of a ``compute`` that gives NaN
        where the metric is undefined: a scalar where ``compute`` reports it by ``ValueError`` (in
        ``forward``, the batch alone: a class with a positive prior missing from it, one class
        only where the score is normalised by the prior's; on all the data it accumulated, the
        error stands), and NaN in every entry where there are no samples at all on any process
        (an empty maximum or bin sum would read 0: perfectly calibrated)."""

        @functools.wraps(compute)
        def compute_or_nan(*args: Any, **kwargs: Any) -> Any:
            try:
                result = compute(*args, **kwargs)
            except ValueError:
                if self._batch_only or not bool(self.sample_count > 0):
                    return torch.tensor(math.nan, dtype=torch.float64, device=self.sample_count.device)
                raise
            if isinstance(result, Tensor) and result.is_floating_point():  # (no host synchronisation)
                return torch.where(self.sample_count > 0, result, math.nan)
            return result

        return super()._wrap_compute(compute_or_nan)

    def _wrap_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        """torchmetrics' wrapper of ``update``, which counts the batch's samples only once the
        update has returned: a batch refused by its checks (a NaN score) was counted, and a metric
        with no sample then read 0 (smooth ECE: "perfectly calibrated") instead of NaN."""

        @functools.wraps(update)
        def counted(*args: Any, **kwargs: Any) -> None:
            self._pending_samples = 0
            update(*args, **kwargs)
            self.sample_count += self._pending_samples

        return super()._wrap_update(counted)

    def reset(self) -> None:
        """torchmetrics' ``reset``, with every list state a new list: torchmetrics empties them in
        place, and ``Running`` holds the lists of its window's batches (which it then read empty:
        0 or NaN)."""
        for name in self._cat_states:
            setattr(self, name, [])
        super().reset()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """torchmetrics' loading of a state (``persistent(True)``), refused as ``merge_state``
        refuses one accumulated under other options, and with the cached ``compute()`` dropped
        (it returned the value from before the load)."""
        self._check_options_digest(state_dict.get(prefix + "options_digest"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._computed = None

    def _synced_result(self, result: Callable[[], ResultT], result_type: type[ResultT]) -> ResultT:
        """What a ``result()`` method returns: ``result()`` of the data accumulated on every
        process, or, where there are no samples at all, a ``result_type`` with NaN in every field,
        as ``compute()`` gives then (see ``_wrap_compute``) rather than the error of empty sums."""
        with self.sync_context():
            if bool(self.sample_count > 0):
                return result()
        nan = torch.tensor(math.nan, dtype=torch.float64, device=self.sample_count.device)
        return result_type._make([nan] * len(result_type._fields))

    def _cat(self, name: str) -> Tensor:
        """A list state (``add_cat_state``) as one tensor: ``(0, *trailing)`` of its dtype before
        any sample, where ``dim_zero_cat`` would raise (and ``compute()`` give a 0-d NaN, not NaN
        in the metric's usual shape)."""
        values = getattr(self, name)
        if len(values):
            return dim_zero_cat(values)
        dtype, trailing = self._cat_states[name]
        return torch.empty(0, *trailing, dtype=dtype, device=self.device)

    def _stamp_options_digest(self) -> None:
        """Write the digest of the class and of the options the update depends on (public
        attributes, buffers and submodules, such as ``CalibrationLoss``'s calibrator, with their
        parameters; less ``_compute_only_options``) into its state; computed once."""
        if self._options_digest is None or self._options_digest.device != self.options_digest.device:
            skip = self._metric_attributes | set(self._defaults) | {"validate_args", *self._compute_only_options}
            digest = hashlib.sha256(type(self).__qualname__.encode())
            options = {name: value for name, value in vars(self).items() if not name.startswith("_") and name not in skip}
            options.update((name, b) for name, b in self._buffers.items() if name not in skip)
            for prefix, module in self.named_children():
                options[prefix] = type(module).__qualname__
                options.update((f"{prefix}.{name}", t) for name, t in module.state_dict(keep_vars=True).items())
            for name, value in sorted(options.items()):
                digest.update(f"{name}={stable_repr(value)};".encode())
            self._options_digest = torch.tensor(list(digest.digest()[:_DIGEST_BYTES]), dtype=torch.float64, device=self.options_digest.device)
        self.options_digest.copy_(self._options_digest)

    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """torchmetrics' ``merge_state``, refused where the incoming state was accumulated under
        other options the update depends on (its options digest differs): the sums of two
        ``DetectionCost``s with other priors would add up to neither metric."""
        # (other types go to torchmetrics' checks, whose messages name what it takes)
        incoming = (incoming_state.options_digest if isinstance(incoming_state, type(self))
                    else incoming_state.get("options_digest") if isinstance(incoming_state, dict) else None)
        self._check_options_digest(incoming, "merge")
        super().merge_state(incoming_state)
        self._computed = None  # (torchmetrics keeps the value cached before the merge)

    def _check_options_digest(self, incoming: Any, action: str = "load") -> None:
        """Refuse an incoming state whose options digest (where it has one) is not this metric's."""
        if isinstance(incoming, Tensor) and bool(incoming.any()):
            self._stamp_options_digest()
            if not torch.equal(incoming.to(self.options_digest), self.options_digest):
                raise ValueError(f"cannot {action} the state of a {type(self).__name__} accumulated under other options "
                                 "(those its update depends on): build both metrics with the same options.")

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group: Any | None = None) -> None:
        """torchmetrics sends a process's empty list state as an empty float32 vector, which the
        other processes' states (float64 scores, int64 labels, (N, C) columns) do not match: gloo
        aborted the job where a process had no samples. Such a state is sent as an empty tensor
        of its own dtype and trailing shape."""
        for name, (dtype, trailing) in self._cat_states.items():
            if not getattr(self, name):
                getattr(self, name).append(torch.empty(0, *trailing, dtype=dtype, device=self.device))
        self._agree_on_options(process_group)
        super()._sync_dist(dist_sync_fn, process_group)

    def _agree_on_options(self, process_group: Any | None) -> None:
        """Refuse, on every process, to sync states accumulated under other options on another
        process (merge_state refuses them too): the digest state is reduced by its maximum, which
        hid the difference, and two DetectionCosts with other target priors returned a mixture.
        Processes without an update (digest 0) take no part."""
        digest = self.options_digest.to(torch.float64)
        stamped = bool(digest.any())
        extremes = torch.cat([digest if stamped else torch.full_like(digest, -1.0), -digest if stamped else torch.full_like(digest, -256.0)])
        group = process_group or self.process_group or torch.distributed.group.WORLD  # (as torchmetrics syncs)
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
        if bool((extremes[: digest.numel()] < 0).all()):  # (no process has an update: nothing to compare)
            return
        if not torch.equal(extremes[: digest.numel()], -extremes[digest.numel() :]):
            raise ValueError(f"the processes' {type(self).__name__} metrics were built with other options (those its update "
                             "depends on): their states cannot be summed. Build the metric with the same options on every process.")

    def _apply(self, fn: Any, exclude_state: Any = "") -> Any:
        """Moves states and buffers with the module but keeps their dtypes: ``.to(torch.float16)``
        (which Lightning's ``precision="16-true"`` applies to every submodule) would turn the
        float64 sums into half precision, which overflows at 65,504. ``set_dtype`` still casts."""
        if self._dtype_convert:
            return super()._apply(fn, exclude_state)

        def same_dtype(t: Tensor) -> Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        return super()._apply(same_dtype, exclude_state)

    def _flattened(self, preds: Tensor, labels: Tensor, class_dim: bool = False) -> tuple[Tensor, Tensor] | None:
        """Steps 1-3 of the module docs: ``(rows, labels)`` flattened and kept, or None when empty.

        ``class_dim``: ``preds`` carry a class dimension 1 that labels lack (scores), else both
        have the same shape (decisions).
        """
        self._stamp_options_digest()
        preds, labels = as_tensor(preds, "scores" if class_dim else "decisions"), as_tensor(labels, "labels")
        binary_maps = preds.shape == labels.shape and getattr(self, "num_classes", None) in (None, 2)
        if class_dim and preds.ndim >= 3 and labels.shape == preds.shape[:1] + preds.shape[2:]:
            preds = preds.movedim(1, -1).reshape(-1, preds.shape[1])
            labels = labels.reshape(-1)
        elif class_dim and preds.ndim >= 3 and labels.ndim >= 2 and not binary_maps:
            # a map of labels that does not pair with the scores (one-hot labels among them: a map
            # of binary scores needs K = 2); the later checks would blame the scores
            raise _segmentation_labels_error(preds, labels)
        elif class_dim and binary_maps and preds.ndim >= 3 and preds.shape[1] == 2 and _one_hot_along_dim_1(labels):
            # (N, 2, d1, ...) scores of K = 2 classes with one-hot labels, not a map of binary scores
            raise _segmentation_labels_error(preds, labels)
        elif preds.shape == labels.shape and (preds.ndim >= 3 or (preds.ndim == 2 and not (class_dim and self._maybe_one_hot(preds)))):
            # same shapes: one decision, or one binary score, per element; (N, K) scores with
            # (N, K) labels stay as they are where K may be the classes' count (that is one-hot
            # labels, which validation rejects)
            preds, labels = preds.reshape(-1), labels.reshape(-1)
        elif (class_dim and preds.ndim == 2 and preds.shape[1] == 1 and labels.shape == preds.shape[:1]
              and getattr(self, "num_classes", None) == 2):
            preds = preds[:, 0]  # one binary score column, as (N,) scores
        if self.ignore_index is not None and labels.shape[:1] == preds.shape[:1]:
            kept = labels != self.ignore_index
            preds, labels = preds[kept], labels[kept]
        if preds.numel() == 0 and labels.numel() == 0:
            return None
        self._pending_samples = labels.shape[0]  # (counted by _wrap_update if the update passes its checks)
        return preds, labels

    def _maybe_one_hot(self, scores: Tensor) -> bool:
        """Whether 2-D ``scores`` with labels of their shape may be (N, K) class scores: unless
        the metric takes K = 2 and they have another number of columns (a map of binary scores)."""
        return getattr(self, "num_classes", None) != 2 or scores.shape[1] == 2

    def plot(self, val: Tensor | list[Tensor] | None = None, ax: Any = None) -> Any:
        """Plot a value of the metric (``compute()`` when ``val`` is None, or a list of values over
        time), by torchmetrics' plotting helper. Returns ``(fig, ax)``; needs matplotlib.
        """
        return self._plot(val, ax)


def _segmentation_labels_error(scores: Tensor, labels: Tensor) -> ValueError:
    return ValueError(f"segmentation scores of shape (N, K, d1, ...) = {tuple(scores.shape)} need labels of shape "
                      f"(N, d1, ...) = {tuple(scores.shape[:1] + scores.shape[2:])} (class indices, not one-hot), "
                      f"got {tuple(labels.shape)}.")


def _one_hot_along_dim_1(labels: Tensor) -> bool:
    """Whether ``labels: (N, 2, d1, ...)`` hold a single 1 along dim 1 everywhere (one-hot labels of
    two classes; a map of binary labels with a dimension of size 2 practically never does)."""
    values = labels.to(torch.int64)
    return bool(((values == 0) | (values == 1)).all()) and bool((values.sum(dim=1) == 1).all())


class ScoreMetric(BatchMetric):
    """A ``BatchMetric`` whose ``update`` takes class scores of a declared kind and labels.

    Args:
        num_classes: K, checked against every batch; None takes any K >= 2 (but not binary
            scores given as one column, which need ``num_classes=2``, or a ``kind="binary"``).
        input: what ``update`` receives: ``"logits"`` (default) or ``"log_probs"``, any
            unnormalised log-posteriors, or ``"probs"``, posteriors (rows on the simplex).
        ignore_index, validate_args, kwargs: as ``BatchMetric``.
    """

    def __init__(
        self,
        num_classes: int | None = None,
        *,
        input: InputKind = "logits",
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(ignore_index=ignore_index, validate_args=validate_args, **kwargs)
        self.num_classes = None if num_classes is None else check_num_classes(num_classes)
        if input not in _INPUT_KINDS:
            raise ValueError(f"input must be one of {_INPUT_KINDS} (what update receives), got {input!r}.")
        self.input = input

    def _scores(self, scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor] | None:
        """Log-domain scores (N, K) and int64 labels (N,) of a batch, or None when it is empty."""
        batch = self._flattened(scores, labels, class_dim=True)
        if batch is None:
            return None
        scores, labels = batch
        if scores.ndim == 1 and labels.ndim > 1 and labels.shape[0] == scores.shape[0]:
            check_labels(labels, scores.shape[0], 2)  # (one score column is fine; the labels' shape is not)
        if scores.ndim == 1 and labels.shape == scores.shape:
            # (a kind="binary" metric is of K = 2 classes, as documented: no num_classes needed)
            if self.num_classes is None and getattr(self, "kind", None) != "binary":
                raise ValueError(f"{type(self).__name__} got one score per sample (shape {tuple(scores.shape)}): binary "
                                 f"scores of class 1 as one column need num_classes=2; or give (N, K) scores.")
            if self.num_classes in (None, 2):
                scores = self._binary_columns(scores)
        if self.validate_args and not self._common_case_valid(scores, labels):
            if self.input == "probs":
                check_probs(scores, "scores")
            scores, labels = check_logits_and_labels(
                scores, labels, num_classes=self.num_classes, warn_probs=False,
                classes_of=f"{type(self).__name__} was built for",
            )
            if self.input != "probs" and looks_like_probs(scores):
                warnings.warn(
                    f"the scores look like probabilities (rows in [0, 1] summing to one) but "
                    f"input={self.input!r}, which reads them as log-posteriors and gives wrong numbers; "
                    f"pass input='probs' if they are.",
                    stacklevel=stacklevel_outside_package(),
                )
        elif labels.dtype != torch.int64:
            labels = labels.long()
        if not self.is_differentiable:  # the fused kernels write in place, which autograd refuses
            scores = scores.detach()
        if self.input == "probs":
            scores = floored_log(scores)  # a probability of 0 would give log(0) = -inf
        return scores, labels.to(scores.device)

    def _binary_problems(self, scores: Tensor, labels: Tensor, allowed: Sequence[str] | None = None) -> tuple[Tensor, Tensor] | None:
        """Scores (N, C) float64 and targets (N, C) bool of the binary problems of the metric's
        ``kind`` in a batch (see :func:`~torchcal.functional.diagnostics.binning_scores`), or
        None when it is empty; ``allowed``: the metric's kinds, if not all of them."""
        batch = self._scores(scores, labels)
        if batch is None:
            return None
        logits, labels = batch
        if allowed is not None:
            check_binary_kind(self.kind, logits.shape[1], allowed)  # type: ignore[arg-type]
        return binning_scores(to_log_probs(logits), labels, self.kind)  # type: ignore[arg-type]

    def _common_case_valid(self, scores: Tensor, labels: Tensor) -> bool:
        """Whether log-domain scores (N, K) and int64 labels (N,) are valid and do not look like
        probabilities, from one read-back of three numbers: the scores' sum (finite when every
        entry is; a finite sum that overflows only sends us to the full checks, ~10x cheaper than
        ``isfinite().all()``), which is also far from N unless the rows may sum to one, and the
        labels' range. Anything else goes to the full checks, which raise the precise message."""
        if not (
            self.input != "probs"
            and isinstance(scores, Tensor)
            and scores.is_floating_point()
            and scores.ndim == 2
            and scores.shape[1] == (self.num_classes or max(scores.shape[1], 2))
            and isinstance(labels, Tensor)
            and labels.dtype == torch.int64
            and labels.shape == scores.shape[:1]
            and labels.device == scores.device
        ):
            return False
        low, high = torch.aminmax(labels)
        total = scores.detach().sum(dtype=torch.promote_types(scores.dtype, torch.float32))  # (see _finite_sum)
        total, low, high = torch.stack([total.double(), low.double(), high.double()]).tolist()
        return (math.isfinite(total) and not total_may_be_of_probs(total, scores.shape[0], scores.dtype)
                and low >= 0 and high < scores.shape[1])

    def _binary_columns(self, scores: Tensor) -> Tensor:
        """(N,) scores of class 1, of the declared kind, as two columns (N, 2) of that kind."""
        if self.input == "probs":
            return binary_probability_columns(scores.to(compute_dtype(scores.dtype)), scores.dtype)
        if self.input == "log_probs":  # log(1 - p) = log(-expm1(log p)), exact near p = 1 as well
            if self.validate_args and bool((scores > 0).any()):
                raise ValueError(
                    f"log-probabilities of class 1 must be <= 0, got a maximum of {float(scores.max()):.4g}; "
                    f"pass input='logits' if they are log-odds."
                )
            complement = floored_log(-torch.expm1(scores))
            return torch.stack([complement, scores], dim=1)
        if self.validate_args and scores.shape[0] >= _MIN_ROWS_OF_PROBABILITY_COLUMN:
            low, high = torch.stack(torch.aminmax(scores.detach())).tolist()
            if low >= 0 and high <= 1:
                warnings.warn(
                    f"the scores are one column of {scores.shape[0]} values all in [0, 1]: probabilities of "
                    f"class 1? They are read as log-odds (input={self.input!r}), which gives wrong numbers "
                    f"if they are probabilities; pass input='probs' if they are.",
                    stacklevel=stacklevel_outside_package(),
                )
        return torch.stack([torch.zeros_like(scores), scores], dim=1)  # log-odds of class 1

