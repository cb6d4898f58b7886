"""Affine maps of the scores: the DP/affine calibration of Brummer & van Leeuwen, Platt scaling
and vector scaling."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchcal.calibrators.base import Calibrator

__all__ = ["AffineCalibration", "PlattScaling", "VectorScaling"]


class AffineCalibration(Calibrator):
    """``softmax(alpha * log_softmax(logits) + beta)`` with scalar ``alpha > 0`` and ``beta: (K,)``.

    The calibration Ferrer & Ramos recommend as the default: a multiclass logistic regression on
    the log-posteriors with one shared scale, so it fixes over/under-confidence and prior shifts
    with K + 1 parameters. ``alpha`` is stored as ``log_alpha``. With ``bias=False`` it is
    temperature scaling (``T = 1/alpha``) fitted by the generic optimiser.

    Example:
        >>> import torch
        >>> from torchcal import AffineCalibration
        >>> logits = 3 * torch.randn(500, 3) + torch.tensor([1.0, 0.0, -1.0])
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> cal = AffineCalibration().fit(logits, labels)
        >>> cal(logits).logsumexp(dim=1).abs().max() < 1e-5
        tensor(True)
    """

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.bias = bias

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        params = {"log_alpha": torch.zeros(())}
        if self.bias:
            params["beta"] = torch.zeros(num_classes)
        return params

    @property
    def alpha(self) -> float:
        return math.exp(self.log_alpha.item())

    def _features(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=1)

    def _scores(self, features: Tensor) -> Tensor:
        scores = torch.exp(self.log_alpha.to(features.dtype)) * features
        return scores + self.beta.to(features.dtype) if self.bias else scores

    def extra_repr(self) -> str:
        return f"bias={self.bias}, " + super().extra_repr()


class PlattScaling(AffineCalibration):
    """Platt scaling for K = 2: ``P(class 1) = sigmoid(slope * llr + intercept)``.

    ``llr`` is the log-odds of the input scores, ``logits[:, 1] - logits[:, 0]``. This is affine
    calibration restricted to two classes; ``slope = alpha > 0`` and
    ``intercept = beta[1] - beta[0]``.
    """

    supported_num_classes = 2

    def __init__(self) -> None:
        super().__init__(bias=True)

    @property
    def slope(self) -> float:
        return self.alpha

    @property
    def intercept(self) -> float:
        return (self.beta[1] - self.beta[0]).item()


class VectorScaling(Calibrator):
    """``softmax(w * logits + b)`` with per-class scales ``w: (K,)`` and biases ``b: (K,)``.

    Guo et al.'s vector scaling, applied to the raw logits (not to log-posteriors: the two differ
    because the row normaliser is scaled by different ``w_k``).
    """

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"weight": torch.ones(num_classes), "bias": torch.zeros(num_classes)}

    def _scores(self, features: Tensor) -> Tensor:
        return features * self.weight.to(features.dtype) + self.bias.to(features.dtype)
