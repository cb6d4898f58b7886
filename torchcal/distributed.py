"""All-reduce plumbing for data-parallel fits on ``torch.distributed``.

Every calibrator objective is a mean over samples, so a fit on data sharded across processes
only needs sums: each process reduces its shard to a few numbers (loss, gradient, Hessian, class
counts), and :func:`all_reduce_` adds them up in place. All processes then hold the same totals,
take the same optimiser steps and end with the same parameters as one process fitted on the
union of the shards; the logits themselves never travel. Every shard of a fit needs at least
one sample (an empty one is refused, on every process; a data loader gives each process a share
of the calibration set). The metric classes accept empty shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

__all__ = ["ProcessGroup", "agree_across", "all_reduce_", "validate_together", "world_size"]

T = TypeVar("T")

try:  # torch builds without distributed support still import torchcal
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover
    ProcessGroup = object  # type: ignore[assignment,misc]


_REDUCE_OPS = {"sum": "SUM", "max": "MAX"}


def all_reduce_(tensor: Tensor, group: ProcessGroup | None, op: Literal["sum", "max"] = "sum") -> Tensor:
    """Sum (or max) ``tensor`` in place over the processes of ``group``; a no-op for ``None``.

    Returns ``tensor`` so calls can be chained.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}.")
    if group is None:
        return tensor
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "a process_group was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group first (Lightning and torchrun do this for you)."
        )
    reduce_op = getattr(torch.distributed.ReduceOp, _REDUCE_OPS[op])
    if tensor.is_contiguous():
        torch.distributed.all_reduce(tensor, op=reduce_op, group=group)
    else:  # a backend reads the storage as laid out: a strided view (m[:, 0]) summed other entries
        dense = tensor.contiguous()
        torch.distributed.all_reduce(dense, op=reduce_op, group=group)
        tensor.copy_(dense)
    return tensor


def least_across(value: float, group: ProcessGroup | None, device: torch.device | None = None) -> float:
    """The smallest of the processes' ``value`` (one collective; ``value`` itself without a group)."""
    return -float(all_reduce_(torch.tensor([-float(value)], dtype=torch.float64, device=device), group, op="max")[0])


def agree_across(values: dict[str, float], group: ProcessGroup | None, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` on every process of ``group`` unless each of the named ``values`` is
    the same on all of them (one collective; nothing without a group): a K or a dtype that differs
    between processes gives collectives of mismatched sizes or different numbers of passes,
    which abort the group or leave it waiting."""
    if group is None:
        return
    own = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    extremes = all_reduce_(torch.cat([own, -own]), group, op="max")
    differ = [name for name, high, low in zip(values, extremes[: own.numel()].tolist(), extremes[own.numel() :].tolist()) if high != -low]
    if differ:
        raise ValueError(f"the processes of the group differ in {', '.join(differ)}; every process must pass the same.")


def world_size(group: ProcessGroup | None) -> int:
    """Number of processes in ``group`` (1 for ``None``)."""
    return 1 if group is None else torch.distributed.get_world_size(group)


def validate_together(check: Callable[[], T], group: ProcessGroup | None, data: Any = None) -> T:
    """``check()``, the input validation of a data-parallel call, run by every process of
    ``group`` at once: if it raises on one process it raises on all (there with its own message,
    elsewhere with one that points to it), so that no process waits alone in its next collective
    for one that gave up. Without a group it is ``check()``. ``data``: the tensor whose device
    carries the flag (CPU if it is not a tensor)."""
    if group is None:
        return check()
    error: Exception | None = None
    try:
        result = check()
    except (ValueError, TypeError) as err:
        error = err
    device = data.device if isinstance(data, Tensor) else torch.device("cpu")
    failed = all_reduce_(torch.tensor([float(error is not None)], device=device), group, op="max")
    if error is not None:
        raise error
    if bool(failed.item()):
        raise ValueError(
            "another process of the group refused its shard of the data (its own error says why); "
            "this process stops too rather than wait for it."
        )
    return result
