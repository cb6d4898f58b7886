"""Helpers shared by the metric classes."""

from __future__ import annotations

import torch
from torchmetrics import Metric


def check_num_classes(num_classes: int) -> int:
    """``num_classes`` as an int >= 2, or ``ValueError``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}.")
    return num_classes


def add_sum_state(metric: Metric, name: str, *shape: int) -> None:
    """A float64 accumulator of the given shape, summed across processes."""
    metric.add_state(name, torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum", persistent=False)
