"""``exp`` computed as ``exp2``: PyTorch's vectorised ``exp2`` is about twice as fast on the CPU."""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2_E = 1 / math.log(2)


def scaled_exp(x: Tensor, scale: float = 1.0, inplace: bool = False) -> Tensor:
    """``exp(scale * x)`` as ``2 ** (x * scale log2(e))``; with ``inplace=True`` it overwrites ``x``.

    The product's rounding perturbs the result by ``|scale x|`` ulp, relatively: as much as the
    rounding of ``x`` itself does, and nothing on sums of exponentials of ``x = z - max z`` (the
    terms near 0 dominate them), which is what the callers form.
    """
    factor = scale * LOG2_E
    return x.mul_(factor).exp2_() if inplace else torch.exp2(x * factor)
