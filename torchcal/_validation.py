"""Input validation shared by every public entry point.

Every check raises ``ValueError`` (or ``TypeError`` for the wrong kind of object) with a message
that names the problem and says how to fix it. Nothing here modifies its input.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import sys
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "as_tensor",
    "check_costs",
    "check_labels",
    "check_logits",
    "check_logits_and_labels",
    "check_priors",
    "check_probs",
    "check_seed",
    "check_strength",
    "compute_dtype",
    "looks_like_probs",
    "total_may_be_of_probs",
]


#: Probabilities below this value, 0 among them, are raised to it before taking logs, so that the
#: scores stay finite (log = -46) and the same in every dtype. Ferrer & Ramos' data preparation
#: uses the same floor.
PROBABILITY_FLOOR = 1e-20


def probability_floor(dtype: torch.dtype) -> float:
    """:data:`PROBABILITY_FLOOR`, or for float16 probabilities 2^-25, half its smallest subnormal
    number: a 0 there stands for any probability below that, and 1e-20 scored rows of true
    posteriors 1e-8 at 46 nats instead of 18 (CIFAR-10 ResNet-110's cross-entropy 5 % high)."""
    info = torch.finfo(dtype)
    return max(PROBABILITY_FLOOR, info.tiny * info.eps / 2)


def binary_probability_columns(p1: Tensor, stored: torch.dtype) -> Tensor:
    """(N, 2) probabilities ``[1 - p1, p1]`` of class-1 probabilities ``p1: (N,)`` (float32 or
    float64) that were stored in ``stored``: half-precision ones held within what their rounding
    leaves possible, above :func:`probability_floor` and below ``1 - eps / 4`` (a bfloat16
    probability rounds to 1 from 1 - 2^-9: its complement is not 1e-20; FVCAUS's bfloat16
    posteriors scored 25 % above their logits)."""
    if stored in (torch.float16, torch.bfloat16):
        p1 = p1.clamp(min=probability_floor(stored), max=1 - torch.finfo(stored).eps / 4)
    return torch.stack([1 - p1, p1], dim=1)


def floored_log(probs: Tensor) -> Tensor:
    """``log(probs)`` with probabilities below :func:`probability_floor` raised to it, in
    :func:`compute_dtype`: half precision in float32, where the floor does not round to 0 (and
    the log is not rounded back to half precision's 8 or 11 bits: 0.03 nats)."""
    return probs.to(compute_dtype(probs.dtype)).clamp_min(probability_floor(probs.dtype)).log()


def finite_log(x: Tensor) -> Tensor:
    """``log(x)`` in float64 with 0 raised to float64's smallest normal number (log about -708):
    a prior of 0 leaves its class finite log-posteriors, which torchcal's metrics need, and every
    positive prior is left as it is (:func:`floored_log`'s floor would move priors below 1e-20)."""
    return x.to(torch.float64).clamp(min=torch.finfo(torch.float64).tiny).log()


def name_classes(classes: list[int], limit: int = 10) -> str:
    """``"class 3"``, ``"classes [1, 4]"``, or the first ``limit`` of many and how many more (an
    error message that lists 700 absent classes of a K = 3,000 problem hides what it says)."""
    if len(classes) == 1:
        return f"class {classes[0]}"
    listed = f"{classes}" if len(classes) <= limit else f"{classes[:limit]} (and {len(classes) - limit} more)"
    return f"classes {listed}"


def as_tensor(x: Any, name: str) -> Tensor:
    """Return ``x`` as a tensor without copying when it already is one (NumPy arrays are wrapped;
    lists and tuples are read as NumPy reads them: float64, not torch's float32)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (list, tuple)):
        if x and all(isinstance(item, Tensor) and item.ndim > 0 for item in x):
            raise TypeError(f"{name} is a {type(x).__name__} of {len(x)} tensors: concatenate the batches first, "
                            f"torch.cat({name}).")
        try:
            x = np.asarray(x)
        except ValueError as error:  # (ragged rows)
            raise ValueError(f"{name} cannot be read as one array: {error}") from None
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers, got a NumPy array of dtype {x.dtype}"
                            f"{' (None or mixed types)' if x.dtype == object else ''}.")
        if not x.dtype.isnative:  # (big-endian data, which torch cannot wrap)
            x = x.astype(x.dtype.newbyteorder("="))
        if any(stride < 0 for stride in x.strides):  # (a reversed view, x[::-1] or np.flip)
            x = np.ascontiguousarray(x)
        return torch.from_numpy(x)
    raise TypeError(f"{name} must be a torch.Tensor or a NumPy array, got {type(x).__name__}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype computations run in: float32 for half precision, else the input's own."""
    return torch.promote_types(dtype, torch.float32)


def _describe_nonfinite(x: Tensor) -> str:
    x = x.detach()
    bad = ~torch.isfinite(x)
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(bad.sum()) - n_nan
    first = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0]) if x.ndim else 0
    return f"{n_nan} NaN and {n_inf} infinite values (first in row {first})"


def _finite_sum(x: Tensor) -> float | None:
    """The sum of ``x`` when every entry is finite, else None. The sum is finite when every entry
    is: a tenth of the cost of ``isfinite(x).all()`` and no mask as large as ``x``; a sum of finite
    entries that overflows goes on to the full check (and is returned as it is, infinite)."""
    # detached: a scalar read from a tensor that requires grad warns; half precision summed in
    # float32, whose sum of N probabilities does not overflow past N = 65,504 as float16's does
    total = float(x.detach().sum(dtype=torch.promote_types(x.dtype, torch.float32)))
    return total if math.isfinite(total) or bool(torch.isfinite(x.detach()).all()) else None


def stacklevel_outside_package() -> int:
    """The ``stacklevel`` of a warning raised by this function's caller that points at the first
    frame outside torchcal, torch and torchmetrics (``Module.__call__`` sits between a user and a
    calibrator's ``forward``, torchmetrics' wrappers between a user and a metric's ``update``):
    the user's line, however deep the call came. Frames are told apart by their
    module's name, not their file, which a symbolic link or a sibling folder would confuse."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("torchcal", "torch", "torchmetrics"):
        frame, level = frame.f_back, level + 1
    return level


def _all_in_range(labels: Tensor, num_classes: int) -> bool:
    """Whether every label lies in [0, K): one read-back of the minimum and maximum."""
    low, high = torch.stack(torch.aminmax(labels)).tolist()
    return low >= 0 and high < num_classes


def check_logits(
    logits: Any, name: str = "logits", num_classes: int | None = None, *, warn_probs: bool = True, classes_of: str = ""
) -> Tensor:
    """Validate scores of shape (N, K): floating dtype, K >= 2, N >= 1, all finite; K equal to
    ``num_classes`` if given, ``classes_of`` saying whose they are ("the calibrator was fitted on").

    Scores are logits in the wide sense: any unnormalised log-posteriors (``log(probs)`` works,
    clamped if a probability is 0: -inf is refused).
    Scores that look like probabilities instead (rows in [0, 1] summing to one) warn unless
    ``warn_probs=False``: read as logits they give plausible but wrong numbers.
    """
    logits = as_tensor(logits, name)
    if not torch.is_floating_point(logits):
        raise ValueError(
            f"{name} must be a floating-point tensor of scores, got dtype {logits.dtype}. "
            f"If these are class indices, pass them as labels; if they are scores, convert with .float()."
        )
    if logits.ndim != 2:
        hint = (
            " A binary task given as one score column can be turned into two columns with "
            "torchcal.data.binary_scores_to_logits."
            if logits.ndim == 1
            else ""
        )
        raise ValueError(f"{name} must have shape (N, K), got shape {tuple(logits.shape)}.{hint}")
    n, k = logits.shape
    if k < 2:
        raise ValueError(
            f"{name} must have K >= 2 class columns, got K = {k}. For a binary task given as one "
            f"column use torchcal.data.binary_scores_to_logits."
        )
    if num_classes is not None and k != num_classes:
        raise ValueError(
            f"{name} has K = {k} classes but {num_classes} were expected"
            + (f" (the number of classes {classes_of})." if classes_of else ".")
        )
    if n == 0:
        raise ValueError(f"{name} is empty (N = 0): at least one sample is needed.")
    total = _finite_sum(logits)
    if total is None:
        raise ValueError(
            f"{name} contain {_describe_nonfinite(logits)}. Scores must be finite: check for a "
            f"diverged network, or replace log(0) = -inf by a large negative number."
        )
    if warn_probs and total_may_be_of_probs(total, n, logits.dtype) and looks_like_probs(logits):
        warnings.warn(
            f"{name} look like probabilities (every row in [0, 1] and summing to one) but are read as "
            f"logits (log-posteriors), which gives wrong numbers; pass their log instead, e.g. "
            f"probs.clamp_min(1e-20).log().",
            stacklevel=stacklevel_outside_package(),
        )
    return logits


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (not a bool, not a float; NumPy's integers too), or
    ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_strength(value: Any, name: str) -> float:
    """``value`` as a float, finite and >= 0 (a penalty strength; NumPy's and 0-d torch numbers
    too, which a state would store as they came: ``torch.load(weights_only=True)`` refuses NumPy
    scalars), or ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be finite and >= 0, got {value}.")
    return value


def check_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an int (not a bool, not a float; NumPy's integers too) in the range a
    ``torch.Generator`` takes, or ``ValueError`` naming it."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {seed!r}.")
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"{name} must lie in [-2**63, 2**64), the range of a torch.Generator's seed, got {int(seed)}.")
    return int(seed)


def seeded_generator(seed: Any, name: str = "seed") -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`check_seed`'s ``seed``."""
    return torch.Generator().manual_seed(check_seed(seed, name))


def check_folds(folds: Any, seed: Any, folds_name: str = "folds", seed_name: str = "seed") -> tuple[int, int]:
    """A cross-validation's fold count (an int >= 2) and seed (an int >= 0) as ints, or
    ``ValueError`` naming the argument."""
    return check_count(folds, folds_name, minimum=2), check_count(seed, seed_name, minimum=0)


def check_labels(labels: Any, num_samples: int, num_classes: int, name: str = "labels", counted: str = "classes",
                 samples: str = "the scores have N = {} rows") -> Tensor:
    """Validate class indices: an integer (N,) tensor with values in [0, K) (``counted``: what
    the indices count, for the message: ``"classes"``, or ``"decisions"`` for decisions in [0, M);
    ``samples``: the message's clause on N, a format string of it)."""
    labels = as_tensor(labels, name)
    if torch.is_floating_point(labels) or torch.is_complex(labels):
        raise ValueError(
            f"{name} must be an integer tensor of class indices, got dtype {labels.dtype}. "
            f"If they are whole numbers stored as floats, pass {name}.long()."
        )
    if labels.dtype != torch.int64:
        # bool, uint8, int8, int16, int32: gather/index_add need int64 indices, and uint8 or bool
        # tensors used as indices would be read as masks.
        labels = labels.long()
    if labels.ndim != 1:
        raise ValueError(
            f"{name} must have shape (N,), got shape {tuple(labels.shape)}"
            + (f"; use {name}.reshape(-1)." if labels.numel() == num_samples else ".")
        )
    if labels.shape[0] != num_samples:
        raise ValueError(
            f"{name} has {labels.shape[0]} entries but {samples.format(num_samples)}; "
            f"they must describe the same samples."
        )
    if num_samples and not _all_in_range(labels, num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        raise ValueError(
            f"{name} must lie in [0, {num_classes}) for {'K' if counted == 'classes' else 'M'} = {num_classes} {counted}; found "
            f"{bad.numel()} out-of-range value(s), e.g. {int(bad[0])}."
        )
    return labels


def check_logits_and_labels(
    logits: Any, labels: Any, num_classes: int | None = None, *, warn_probs: bool = True, classes_of: str = ""
) -> tuple[Tensor, Tensor]:
    """Validate a (scores, labels) pair and put the labels on the scores' device."""
    logits = check_logits(logits, num_classes=num_classes, warn_probs=warn_probs, classes_of=classes_of)
    labels = check_labels(labels, logits.shape[0], logits.shape[1]).to(logits.device)
    return logits, labels


def check_probs(probs: Any, name: str = "probs", atol: float | None = None) -> Tensor:
    """Validate probabilities of shape (N, K): non-negative rows summing to one."""
    probs = check_logits(probs, name, warn_probs=False)
    values = probs.detach()
    if bool((values < 0).any()) or bool((values > 1).any()):
        raise ValueError(f"{name} must lie in [0, 1]; found values outside. Did you pass logits?")
    atol = _simplex_atol(probs.dtype) if atol is None else atol
    sums = values.sum(dim=1, dtype=torch.float64)
    worst = int((sums - 1).abs().argmax())
    if abs(float(sums[worst]) - 1) > atol:
        raise ValueError(
            f"rows of {name} must sum to one (within {atol:g}); row {worst} sums to "
            f"{float(sums[worst]):.6g}. Pass logits instead, or renormalise the rows."
        )
    return probs


def _simplex_atol(dtype: torch.dtype) -> float:
    """How far from one the rows of probabilities of this dtype may sum."""
    # each rounded probability is off by at most eps / 2 of itself, so a row's sum by eps / 2:
    # 3.9e-3 in bfloat16, 4.9e-4 in float16
    return {torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(dtype, 1e-4)


def looks_like_probs(scores: Tensor) -> bool:
    """Whether scores ``(N, K)`` declared as log-posteriors look like probabilities instead: every
    entry in [0, 1] and rows summing to one as ``check_probs`` accepts them.

    One pass (the sum) when the rows cannot all sum to one, as for nearly all logits.

    Example:
        >>> looks_like_probs(torch.tensor([[0.2, 0.8]])), looks_like_probs(torch.tensor([[0.2, 0.8]]).log())
        (True, False)
    """
    values = scores.detach()
    if not total_may_be_of_probs(float(values.sum(dtype=torch.float64)), values.shape[0], values.dtype):
        return False
    low, high = torch.stack(torch.aminmax(values)).tolist()
    sums = values.sum(dim=1, dtype=torch.float64)
    return low >= 0 and high <= 1 and bool(((sums - 1).abs() <= _simplex_atol(values.dtype)).all())


def total_may_be_of_probs(total: float, rows: int, dtype: torch.dtype) -> bool:
    """Whether scores (rows, K) of ``dtype`` whose entries sum to ``total`` may be probabilities,
    their rows summing to one within ``check_probs``' tolerance: the one-number pre-test of
    :func:`looks_like_probs` (logits sum to about ``rows`` only by coincidence)."""
    return abs(total - rows) <= _simplex_atol(dtype) * rows


def check_priors(priors: Any, num_classes: int, device: torch.device | None = None) -> Tensor:
    """Validate class priors: K non-negative numbers summing to one within the tolerance of a row
    of probabilities of their dtype (1e-4 in single and double precision: priors written to six
    decimals, 0.333333 three times, are accepted). Returned in float64, divided by their sum:
    priors that sum to 1 + 1e-7 would scale every prior-weighted value by it (an expected cost
    above the largest cost)."""
    given = as_tensor(priors, "priors")
    if given.is_complex():
        raise ValueError(f"priors must be real numbers, got {given.dtype}.")
    priors = given.to(dtype=torch.float64, device=device)
    if priors.shape != (num_classes,):
        raise ValueError(
            f"priors must have shape ({num_classes},) for K = {num_classes} classes, got {tuple(priors.shape)}."
        )
    if not bool(torch.isfinite(priors).all()) or bool((priors < 0).any()):
        raise ValueError("priors must be finite and non-negative.")
    total = float(priors.detach().sum())
    atol = _simplex_atol(given.dtype)
    if abs(total - 1) > atol:
        raise ValueError(f"priors must sum to one (within {atol:g}), got sum {total:.8g}; divide them by their sum.")
    return priors if total == 1 else priors / total


def check_costs(costs: Any, num_classes: int | None, device: torch.device | None = None) -> Tensor:
    """Validate a cost matrix of shape (K, M): rows are true classes, columns decisions; any K for
    ``num_classes=None``. Float64."""
    costs = as_tensor(costs, "costs")
    if costs.is_complex():
        raise ValueError(f"costs must be real numbers, got {costs.dtype}.")
    costs = costs.to(dtype=torch.float64, device=device)
    if costs.ndim != 2 or costs.shape[0] != (num_classes or costs.shape[0]) or costs.shape[1] < 1:
        raise ValueError(
            f"costs must have shape (K, M) = ({num_classes or 'K'}, M) with rows for the true classes and "
            f"columns for the decisions, got {tuple(costs.shape)}."
        )
    if not bool(torch.isfinite(costs).all()):
        raise ValueError("costs must be finite.")
    if bool((costs < 0).any()):
        raise ValueError(
            "costs must be non-negative; subtract each row's minimum (this leaves Bayes decisions unchanged)."
        )
    return costs


def stable_repr(value: Any) -> str:
    """``repr(value)`` that is the same in every process for equal options: a tensor by the hash of
    its bytes (its repr rounds; NumPy has no bfloat16; the repr of a (K, K) cost matrix's bytes is
    four times their size), a function by its qualified name and a ``functools.partial`` by its
    parts (their reprs hold memory addresses: a ``CalibrationLoss`` saved in one process was
    refused by an identical one in another)."""
    if isinstance(value, Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return repr((value.dtype, tuple(value.shape), hashlib.sha256(raw.numpy().data).hexdigest()))
    if isinstance(value, functools.partial):
        return f"partial({stable_repr(value.func)}, {stable_repr(value.args)}, {stable_repr(value.keywords)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {stable_repr(item)}" for key, item in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(stable_repr(item) for item in value) + ")"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)
