"""``exp`` computed as ``exp2`` on the CPU, where PyTorch's vectorised ``exp2`` is twice as fast,
and a floor for exponents that keeps exponentials clear of subnormal numbers."""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2_E = 1 / math.log(2)


def scaled_exp(x: Tensor, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
    """``exp(scale * x)``, written to ``out`` (which may be ``x`` itself) if given.

    On the CPU it is ``2 ** (x * scale log2(e))``. The product's rounding perturbs the result by
    about ``|scale x|`` ulp, relatively: as much as the rounding of ``x`` itself does, and nothing
    on sums of exponentials of ``x = z - max z`` (the terms near 0 dominate them), which is what
    the callers form. Elsewhere (GPUs) ``exp`` is as fast, and a scale of 1 needs no product.
    """
    on_cpu = x.device.type == "cpu"
    factor = scale * LOG2_E if on_cpu else scale
    if factor != 1:
        x = out = torch.mul(x, factor, out=out)
    return torch.exp2(x, out=out) if on_cpu else torch.exp(x, out=out)


def applied_scale(scale: float, dtype: torch.dtype, device: torch.device) -> float:
    """The ``scale`` that :func:`scaled_exp` applies to a tensor of ``dtype`` on ``device``: its
    multiplier is rounded to ``dtype`` (in float32 by up to 6e-8, relatively).

    Example:
        >>> applied_scale(0.1, torch.float64, torch.device("cpu")) == 0.1
        True
        >>> abs(applied_scale(0.1, torch.float32, torch.device("cpu")) / 0.1 - 1) < 6e-8
        True
    """
    on_cpu = device.type == "cpu"
    factor = torch.tensor(scale * LOG2_E if on_cpu else scale, dtype=dtype).item()
    return factor / LOG2_E if on_cpu else factor


def exp_floor(dtype: torch.dtype) -> float:
    """A lower bound for exponents: half the dtype's exponent range (-43.7 for float32, -354 for
    float64). Exponentials clamped there, and their products with weights, never reach subnormal
    numbers, on which CPU arithmetic is 10-30x slower; the terms dropped change a sum of
    exponentials by a relative 1e-19 (float32) or less."""
    return 0.5 * math.log(torch.finfo(dtype).tiny)
