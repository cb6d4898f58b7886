"""Beta calibration for binary tasks (Kull, Silva Filho & Flach 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from torchcal.calibrators.base import Calibrator
from torchcal.fit import FitRecord

__all__ = ["BetaCalibration"]


class BetaCalibration(Calibrator):
    """``logit P(class 1) = a * log q1 - b * log q0 + c`` for K = 2, with ``a, b >= 0``.

    ``q = softmax(logits)``. It contains the identity (``a = b = 1, c = 0``) and both sigmoid and
    inverse-sigmoid shapes; with ``a = b`` it is Platt scaling on the log-odds. As in the
    reference implementation, the unconstrained (convex) fit is refitted with ``a = 0`` (then
    ``b = 0``) if a coefficient comes out negative, which keeps the map monotone.
    """

    supported_num_classes = 2
    a: Tensor
    b: Tensor
    c: Tensor

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"a": torch.ones(()), "b": torch.ones(()), "c": torch.zeros(())}

    def _features(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=1)

    def _scores(self, features: Tensor) -> Tensor:
        dtype = features.dtype
        log_odds = self.a.to(dtype) * features[:, 1] - self.b.to(dtype) * features[:, 0] + self.c.to(dtype)
        return torch.stack([torch.zeros_like(log_odds), log_odds], dim=1)

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        for p in (self.a, self.b):
            p.requires_grad_(True)
        record = super()._fit(features, labels, weights, loss, max_iter, process_group)
        for name in ("a", "b"):
            param = getattr(self, name)
            if param.item() < 0:
                with torch.no_grad():
                    param.zero_()
                param.requires_grad_(False)
                record = super()._fit(features, labels, weights, loss, max_iter, process_group)
        for p in (self.a, self.b):
            p.requires_grad_(True)
        return record
