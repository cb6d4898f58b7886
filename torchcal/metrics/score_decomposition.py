"""Streaming Murphy decomposition of the binned Brier score, on ``CalibrationError``'s bin sums."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from torchcal.functional.diagnostics import Strategy
from torchcal.functional.score_decomposition import murphy_from_bins
from torchcal.metrics.diagnostics import CalibrationError

__all__ = ["BrierDecomposition", "MurphyDecomposition"]


class MurphyDecomposition(CalibrationError):
    """Murphy's REL, RES and UNC, as ``functional.score_decomposition.murphy_decomposition``.

    ``compute()`` returns the (3,) tensor ``[reliability, resolution, uncertainty]``. With
    ``strategy="uniform"`` (default) the state is the per-bin sums, summed across processes.

    Args:
        num_classes: K.
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width, O(M) state) or ``"quantile"`` (equal mass, O(N) state).
        kind: ``"classwise"`` (the multiclass Brier score, default), ``"top-label"`` or ``"binary"``.
        input, ignore_index, validate_args: see ``torchcal.metrics``.

    Example:
        >>> import torch
        >>> metric = MurphyDecomposition(num_classes=2, n_bins=2)
        >>> probs = torch.tensor([[.9, .1], [.8, .2], [.4, .6], [.3, .7]], dtype=torch.float64)
        >>> metric.update(probs[:3].log(), torch.tensor([0, 1, 1]))
        >>> metric.update(probs[3:].log(), torch.tensor([0]))
        >>> metric.compute().round(decimals=4)
        tensor([0.1450, 0.0000, 0.5000], dtype=torch.float64)
    """

    higher_is_better = None  # type: ignore[assignment]  # a decomposition, not one score

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        strategy: Strategy = "uniform",
        kind: Literal["top-label", "binary", "classwise"] = "classwise",
        **kwargs: Any,
    ) -> None:
        fixed = sorted({"norm", "reduction"} & set(kwargs))  # (the decomposition has neither; "norm" was ignored)
        if fixed:
            raise TypeError(f"MurphyDecomposition takes no {' or '.join(fixed)}: it decomposes the Brier score "
                            f"into (refinement, reliability, resolution) terms.")
        super().__init__(num_classes, n_bins=n_bins, strategy=strategy, kind=kind, reduction="sum", **kwargs)

    def compute(self) -> Tensor:
        _, statistics = self._binned()
        return torch.stack(murphy_from_bins(*statistics))


#: The former name, kept as an alias.
BrierDecomposition = MurphyDecomposition
