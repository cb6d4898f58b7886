"""Non-parametric binary calibrators: histogram binning and isotonic regression (PAV).

Both are binary maps of one class's score: histogram binning of its probability, isotonic
regression of its log-odds (monotone in the probability, and distinct where probabilities round
to 1). For K = 2 they calibrate ``P(class 1)``; for K > 2 they are applied one-vs-rest to every
class column and the results renormalised to sum to one. Neither ever outputs a probability of
exactly 0 or 1, so the log-loss stays finite.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import check_count
from torchcal.calibrators.base import Calibrator, nan_rows_stay_nan
from torchcal.fit import FitRecord
from torchcal.functional.diagnostics import bin_indices, edge_tolerance
from torchcal.functional.isotonic import pool_adjacent_violators
from torchcal.functional.scoring import one_vs_rest_log_odds

__all__ = ["HistogramBinning", "IsotonicCalibration"]


class _OneVsRest(Calibrator):
    """Shared plumbing: one map per calibrated column of the features (probabilities here)."""

    _supports_process_group = False  # quantile bins and PAV need all the scores in one place

    @staticmethod
    def _columns(num_classes: int) -> list[int]:
        return [1] if num_classes == 2 else list(range(num_classes))

    def _features(self, logits: Tensor) -> Tensor:
        # float64 whatever the input: in float32 every probability within ~6e-8 of 1 rounds to 1.0
        # and lands on the top step, so float32 and float64 input would get different maps.
        return torch.softmax(logits.to(torch.float64), dim=1)

    def _map_column(self, column: int, p: Tensor) -> Tensor:
        """Calibrated probabilities for the ``column``-th calibrated column's features ``p: (N,)``."""
        raise NotImplementedError

    def _scores(self, features: Tensor) -> Tensor:
        columns = self._columns(features.shape[1])
        mapped = torch.stack([self._map_column(i, features[:, c]) for i, c in enumerate(columns)], dim=1)
        mapped = mapped.to(features.dtype)
        if features.shape[1] == 2:
            mapped = torch.cat([1 - mapped, mapped], dim=1)
        return nan_rows_stay_nan(features, torch.log(mapped / mapped.sum(dim=1, keepdim=True)))

    @staticmethod
    def _targets(labels: Tensor, columns: list[int], weights: Tensor | None) -> tuple[Tensor, Tensor]:
        """One-vs-rest targets (N, C) and sample weights (N,)."""
        targets = (labels.unsqueeze(1) == torch.tensor(columns, device=labels.device)).to(torch.float64)
        sample_w = torch.ones(labels.shape[0], dtype=torch.float64, device=labels.device)
        return targets, sample_w if weights is None else weights[labels]


class HistogramBinning(_OneVsRest):
    """Replace a probability by the (smoothed) frequency of the class in its bin.

    Args:
        n_bins: number of bins M.
        strategy: ``"uniform"`` (equal width) or ``"quantile"`` (equal mass on the calibration
            data). Bins are right-closed: ``[0, e1], (e1, e2], ..., (e_{M-1}, 1]``, each edge
            raised by float32's round-off (a relative 1e-6), so that a probability on an edge
            lands in the same bin whether its scores are float32 or float64.

    Empty-bin and zero policy: a bin's value is ``(positives + r) / (count + 1)`` where ``r`` is the
    class's (Laplace-smoothed) base rate; an empty bin therefore gets the base rate, and no value
    is ever exactly 0 or 1.
    """

    _buffer_names = ("edges", "values")
    _free_last_dims: ClassVar[dict[str, int]] = {"edges": 1, "values": 1}  # n_bins + 1 edges, n_bins values
    edges: Tensor
    values: Tensor

    def __init__(self, n_bins: int = 15, strategy: str = "uniform") -> None:
        super().__init__()
        n_bins = check_count(n_bins, "n_bins")  # (an int: NumPy's would not load from a weights-only checkpoint)
        if strategy not in ("uniform", "quantile"):
            raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}.")
        self.n_bins = n_bins
        self.strategy = strategy

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        c = len(self._columns(num_classes))
        edges = torch.linspace(0, 1, self.n_bins + 1, dtype=torch.float64).repeat(c, 1)
        centres = (edges[:, 1:] + edges[:, :-1]) / 2
        return {"edges": edges, "values": centres}

    #: The interior edges are raised by float32 round-off, at fit and at apply time, whatever the
    #: scores' dtype: a probability of exactly k / M (grid probabilities: votes, verbalised
    #: confidences), read as log(k / M) in float32 or float64, comes back from the softmax a unit
    #: or two in the last place either side of its edge, and landed in either bin (the same data
    #: as float32 and float64: posteriors up to 0.35 apart).
    _EDGE_TOLERANCE = edge_tolerance(torch.float32)

    def _map_column(self, column: int, p: Tensor) -> Tensor:
        index = bin_indices(p, self.edges[column].to(p.dtype), self._EDGE_TOLERANCE)
        return self.values[column].to(p.dtype)[index]

    def _fit(self, probs, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        columns = self._columns(probs.shape[1])
        targets, sample_w = self._targets(labels, columns, weights)
        p = probs[:, columns]
        if self.strategy == "quantile":
            q = torch.linspace(0, 1, self.n_bins + 1, dtype=torch.float64, device=p.device)
            edges = torch.quantile(p, q, dim=0).T.contiguous()
            edges[:, 0], edges[:, -1] = 0.0, 1.0
        else:
            edges = self.edges
        values = torch.empty(len(columns), self.n_bins, dtype=torch.float64, device=p.device)
        total_w = sample_w.sum()
        for i in range(len(columns)):
            index = bin_indices(p[:, i], edges[i], self._EDGE_TOLERANCE)
            count = torch.zeros(self.n_bins, dtype=torch.float64, device=p.device).index_add_(0, index, sample_w)
            positives = torch.zeros_like(count).index_add_(0, index, sample_w * targets[:, i])
            base_rate = ((sample_w * targets[:, i]).sum() + 1) / (total_w + 2)
            values[i] = (positives + base_rate) / (count + 1)
        self.edges, self.values = edges, values
        return FitRecord(0, 1, float("nan"), 0.0, True, "closed form")

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "n_bins": self.n_bins, "strategy": self.strategy}

    def _set_stored_options(self, state: dict[str, Any]) -> None:
        self.n_bins = int(state.get("n_bins", self.n_bins))
        self.strategy = str(state.get("strategy", self.strategy))
        check_count(self.n_bins, "stored n_bins")
        if self.strategy not in ("uniform", "quantile"):
            raise ValueError(f"stored strategy must be 'uniform' or 'quantile', got {self.strategy!r}.")

    def extra_repr(self) -> str:
        return f"n_bins={self.n_bins}, strategy={self.strategy!r}, " + super().extra_repr()


def _probability_midpoint(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The log-odds of the mean of the probabilities of log-odds ``a`` and ``b``: held-out scores
    between two steps go to the nearer in probability, as when the fit ran on probabilities,
    ``log(s(a) + s(b)) - log(s(-a) + s(-b))`` with ``s`` the sigmoid, in logs (finite where both
    probabilities round to 1)."""
    def log_sigmoid(t: np.ndarray) -> np.ndarray:
        return -np.logaddexp(0.0, -t)

    return np.logaddexp(log_sigmoid(a), log_sigmoid(b)) - np.logaddexp(log_sigmoid(-a), log_sigmoid(-b))


class IsotonicCalibration(_OneVsRest):
    """Isotonic regression by pool-adjacent-violators: the best non-decreasing step map of each
    class's one-vs-rest log-odds (``thresholds`` are log-odds).

    On its own calibration data it attains the minimum of every proper scoring rule over all maps
    that keep the ranking of the scores (the "calp" rows of Ferrer & Ramos Table 2). Outputs are
    clipped to ``[eps, 1 - eps]`` so unseen data never get probability 0 or 1.
    """

    _buffer_names = ("thresholds", "values")
    _free_last_dims: ClassVar[dict[str, int]] = {"thresholds": 1, "values": 1}  # as many steps as the fit found
    thresholds: Tensor
    values: Tensor

    def __init__(self, eps: float = 1e-7) -> None:
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < 0.5:
            raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}.")
        self.eps: float = float(eps)  # (a NumPy scalar in the state would not load with weights_only=True)

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        c = len(self._columns(num_classes))
        return {"thresholds": torch.zeros(c, 1), "values": torch.full((c, 1), 0.5)}

    def _features(self, logits: Tensor) -> Tensor:
        # (probabilities pooled every score whose float64 probability rounds to 1)
        return one_vs_rest_log_odds(logits)

    def _map_column(self, column: int, p: Tensor) -> Tensor:
        thresholds = self.thresholds[column].to(p.dtype)
        # bucketize(right=True) is searchsorted(right=True), which has no ONNX function
        index = (torch.bucketize(p.contiguous(), thresholds, right=True) - 1).clamp_min(0)
        return self.values[column].to(p.dtype)[index]

    def _fit(self, log_odds, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        columns = self._columns(log_odds.shape[1])
        targets, sample_w = self._targets(labels, columns, weights)
        scores, hits, w = log_odds[:, columns].cpu().numpy(), targets.cpu().numpy(), sample_w.cpu().numpy()
        blocks = [pool_adjacent_violators(scores[:, i], hits[:, i], w, _probability_midpoint) for i in range(len(columns))]
        length = max(len(b[0]) for b in blocks)
        thresholds = np.full((len(columns), length), np.inf)
        values = np.empty((len(columns), length))
        for i, (bx, bv) in enumerate(blocks):
            thresholds[i, : len(bx)] = bx
            values[i, : len(bv)] = bv
            values[i, len(bv):] = bv[-1]
        device = log_odds.device
        self.thresholds = torch.from_numpy(thresholds).to(device)
        self.values = torch.from_numpy(values).clip(self.eps, 1 - self.eps).to(device)
        return FitRecord(0, 1, float("nan"), 0.0, True, "closed form")

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "eps": self.eps, "thresholds_on": "log-odds"}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        super().set_extra_state(state)
        self.eps = float(state.get("eps", self.eps))
        if "thresholds_on" not in state and self.is_fitted:
            # a state saved before the thresholds were log-odds holds probabilities: the same map
            # (but where a probability rounded to 1)
            t = self.thresholds
            self.thresholds = torch.where(t.isinf(), t, torch.log(t) - torch.log1p(-t))

    def extra_repr(self) -> str:
        return f"eps={self.eps:g}, " + super().extra_repr()
