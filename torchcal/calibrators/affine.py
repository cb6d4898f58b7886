"""Affine maps of the scores: the DP/affine calibration of Brummer & van Leeuwen, Platt scaling
and vector scaling."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from torchcal._tempered_moments import TEMPERED_LOSSES
from torchcal._validation import stacklevel_outside_package
from torchcal.calibrators._linear import (
    AffineDesign,
    VectorDesign,
    after_newton,
    fit_linear_newton,
    newton_stalled,
)
from torchcal.calibrators.base import Calibrator, sample_weights
from torchcal.calibrators.temperature import (
    fit_inverse_temperature,
    in_units,
    inverse_temperature_start,
    margin_and_unit,
)
from torchcal.distributed import ProcessGroup, all_reduce_
from torchcal.fit import ConvergenceWarning, FitRecord, warn_unconverged

__all__ = ["AffineCalibration", "PlattScaling", "VectorScaling"]


class AffineCalibration(Calibrator):
    """``softmax(alpha * log_softmax(logits) + beta)`` with scalar ``alpha >= 0`` and ``beta: (K,)``.

    The calibration Ferrer & Ramos recommend as the default: a multiclass logistic regression on
    the log-posteriors with one shared scale, so it fixes over/under-confidence and prior shifts
    with K + 1 parameters. ``alpha`` is stored as ``log_alpha``. With ``bias=False`` it is
    temperature scaling (``T = 1/alpha``). Where the scores are anti-informative (the unconstrained
    optimum has ``alpha < 0``), the fit is ``alpha = 0`` (``log_alpha = -inf``): the class
    frequencies alone, ``fit_record_.message`` says so.

    The log-loss fit is Newton's method on ``(alpha, beta)`` with the exact (K+1) x (K+1) Hessian
    (:mod:`torchcal.calibrators._linear`); L-BFGS crawls here because the shared scale and the K
    biases have very different curvatures. Other losses use the generic L-BFGS driver, except
    with ``bias=False``, whose every loss of ``TemperatureScaling`` goes to its 1-D solver.

    Example:
        >>> import torch
        >>> from torchcal import AffineCalibration
        >>> logits = 3 * torch.randn(500, 3) + torch.tensor([1.0, 0.0, -1.0])
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> cal = AffineCalibration().fit(logits, labels)
        >>> cal(logits).logsumexp(dim=1).abs().max() < 1e-5
        tensor(True)
    """

    log_alpha: Tensor
    beta: Tensor

    def __init__(self, bias: bool = True) -> None:
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}.")
        super().__init__()
        self.bias = bias

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        return self.bias

    def _shifts_class_priors(self) -> bool:
        return self.bias

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "bias": self.bias}

    def _set_stored_options(self, state: dict[str, Any]) -> None:
        """Restores ``bias``, which decides whether there is a ``beta`` to load."""
        self.bias = bool(state.get("bias", self.bias))

    def _materialize(self, num_classes: int, device: torch.device | None = None) -> None:
        if not self.bias:  # (the beta of an earlier fit or load with biases: a head without them did not load)
            self._parameters.pop("beta", None)
        super()._materialize(num_classes, device)

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        params = {"log_alpha": torch.zeros(())}
        if self.bias:
            params["beta"] = torch.zeros(num_classes)
        return params

    @property
    def alpha(self) -> float:
        self._check_fitted()
        return math.exp(self.log_alpha.item())

    def _features(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=1)

    def _scores(self, features: Tensor) -> Tensor:
        scores = torch.exp(self.log_alpha.to(features.dtype)) * features
        return scores + self.beta.to(features.dtype) if self.bias else scores

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        if not self.bias and loss in TEMPERED_LOSSES:  # temperature scaling of the log-posteriors
            alpha, record = fit_inverse_temperature(
                features, labels, weights, loss=loss, max_iter=max_iter, process_group=process_group
            )
            with torch.no_grad():
                self.log_alpha.fill_(math.log(alpha) if alpha > 0 else -math.inf)
            return record
        if self.bias and _same_on_every_row(features, process_group):
            # every alpha fits equally (the biases absorb alpha times the one row), and Newton had
            # moved alpha on round-off (6.99 on all-zero logits, reported converged): the priors alone
            warnings.warn(f"{type(self).__name__}: the scores' log-posteriors are the same on every calibration row, so "
                          f"they carry no information: the fit is the class priors alone (alpha = 0).",
                          UserWarning, stacklevel=stacklevel_outside_package())
            prior_only = self._prior_only_if_better(labels, weights, FitRecord(0, 0, math.inf, math.nan, False, ""), process_group)
            if not prior_only.converged:  # (a class without samples: the biases by the fit, the features zeroed)
                with warnings.catch_warnings():  # (said above; the zeroed features are the same on every row too)
                    warnings.filterwarnings("ignore", message=".*the same on every calibration row")
                    record = self._fit_affine(torch.zeros_like(features), labels, weights, loss, max_iter, process_group)
                with torch.no_grad():
                    self.log_alpha.fill_(-math.inf)
                return record
            if loss == "brier":  # (the best constant prediction under either score: the frequencies)
                frequency = torch.softmax(self.beta.detach(), dim=0)
                prior_only = dataclasses.replace(prior_only, loss=float(1 - frequency.square().sum()))
            return prior_only
        _, unit = margin_and_unit(features, process_group)
        if unit == 1.0:
            return self._fit_affine(features, labels, weights, loss, max_iter, process_group)
        # alpha absorbs any scale of the log-posteriors: the fit runs on them / unit (centred per
        # row, which softmax ignores), where alpha's curvature is of order 1. (Log-posteriors 1e-9
        # apart: the float32 start erased their differences, and Newton stopped on its absolute
        # tolerance at alpha 3 % of the optimum's, a log-loss of 1.59 against 1.30, "converged".)
        scaled = in_units(features - features.amax(dim=1, keepdim=True), unit)
        with torch.no_grad():  # a fresh fit starts at alpha = 1 in the new units, a warm one where it was
            self.log_alpha.add_(0.0 if self._at_identity() else math.log(unit))
        try:
            return self._fit_affine(scaled, labels, weights, loss, max_iter, process_group)
        finally:
            with torch.no_grad():
                self.log_alpha.sub_(math.log(unit))

    def _fit_affine(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        """:meth:`_fit` but temperature scaling's, on log-posteriors of typical margins within 2^16 of 1."""
        if loss != "log":  # (from the identity, logits of 1e3 kept alpha = 1: a Brier plateau)
            record = self._fit_nonconvex(features, labels, weights, loss, max_iter, process_group)
            if self.bias:
                with torch.no_grad():
                    self.beta.sub_(self.beta.mean())  # softmax ignores a common shift: fix it, as the log-loss fit does
            return record
        start = torch.cat([self.log_alpha.detach().exp().reshape(1), self.beta.detach()])
        if self._at_identity():
            start[0] = inverse_temperature_start(features.float(), labels, weights, process_group)
        theta, record = fit_linear_newton(
            AffineDesign(), features, labels, weights, start, max_iter=min(max_iter, 100), process_group=process_group
        )
        name = type(self).__name__
        if not theta[0] > 0:
            # The unconstrained optimum flips the scores. The objective is convex, so where Newton
            # found that optimum, the one over alpha >= 0 lies on the boundary alpha = 0: the
            # priors alone (where every class has a sample). Else L-BFGS on log(alpha), which can
            # only approach the boundary (1,000 iterations and a warning where it alone went
            # there), and the boundary if better.
            if record.converged:
                prior_only = self._prior_only_if_better(labels, weights, dataclasses.replace(record, loss=math.inf), process_group)
                if prior_only.loss < math.inf:
                    return prior_only
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # (judged after the boundary)
                record = super()._fit(features, labels, weights, loss, max_iter, process_group)
            return warn_unconverged(self._prior_only_if_better(labels, weights, record, process_group), name)
        with torch.no_grad():
            self.log_alpha.copy_(theta[0].log())
            self.beta.copy_(theta[1:] - theta[1:].mean())  # softmax ignores a common shift: fix it
        if newton_stalled(record, max_iter):  # (degenerate curvature): L-BFGS on from Newton's point
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # (judged after the boundary)
                rest = super()._fit(features, labels, weights, loss, max_iter - record.iterations, process_group)
            return warn_unconverged(self._prior_only_if_better(labels, weights, after_newton(record, rest), process_group), name)
        return warn_unconverged(record, name)

    def _prior_only_if_better(self, labels: Tensor, weights: Tensor | None, record: FitRecord, process_group) -> FitRecord:
        """alpha = 0 with the (weighted) class frequencies as biases, if every class is present
        and its log-loss is below ``record``'s."""
        sample_w = sample_weights(labels, weights, process_group)
        mass = all_reduce_(torch.bincount(labels, weights=sample_w, minlength=self.num_classes), process_group)
        if not bool((mass > 0).all()):
            return record
        log_frequency = (mass / mass.sum()).log()
        loss = float(-(mass * log_frequency).sum())
        if not loss < record.loss:
            return record
        with torch.no_grad():
            self.log_alpha.fill_(-math.inf)
            self.beta.copy_(log_frequency - log_frequency.mean())
        return FitRecord(record.iterations, record.evaluations, loss, 0.0, True, "optimum at alpha = 0 (the class priors alone)")

    def extra_repr(self) -> str:
        return f"bias={self.bias}, " + super().extra_repr()


def _same_on_every_row(features: Tensor, process_group: ProcessGroup | None) -> bool:
    """Whether every row of ``features: (N, K)`` is the same up to a constant (and round-off), on
    all of a group's shards."""
    empty = torch.full(features.shape[1:], -math.inf, dtype=torch.float64, device=features.device)  # (a shard without rows)
    centred = (features - features.amax(dim=1, keepdim=True)).to(torch.float64)
    high = all_reduce_(centred.amax(0) if len(features) else empty, process_group, op="max")
    low = -all_reduce_(-centred.amin(0) if len(features) else empty, process_group, op="max")
    tolerance = 8 * torch.finfo(features.dtype).eps * torch.maximum(high.abs(), low.abs()).clamp_min(1)
    return bool((high - low <= tolerance).all())


class PlattScaling(AffineCalibration):
    """Platt scaling for K = 2: ``P(class 1) = sigmoid(slope * llr + intercept)``.

    ``llr`` is the log-odds of the input scores, ``logits[:, 1] - logits[:, 0]``. This is affine
    calibration restricted to two classes; ``slope = alpha >= 0`` and
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
        self._check_fitted()
        return (self.beta[1] - self.beta[0]).item()


class VectorScaling(Calibrator):
    """``softmax(w * logits + b)`` with per-class scales ``w: (K,)`` and biases ``b: (K,)``.

    Guo et al.'s vector scaling, applied to the raw logits (not to log-posteriors: the two differ
    because the row normaliser is scaled by different ``w_k``). The log-loss fit is Newton's
    method with the exact 2K x 2K Hessian. Other losses (not convex here) use the generic L-BFGS
    driver, started from the better of the identity and the log-loss fit.
    """

    weight: Tensor
    bias: Tensor

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"weight": torch.ones(num_classes), "bias": torch.zeros(num_classes)}

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        return True

    def _scores(self, features: Tensor) -> Tensor:
        return features * self.weight.to(features.dtype) + self.bias.to(features.dtype)

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        # The scales absorb any scale of the logits: the fit runs on them / unit, as affine
        # calibration's does (logits of 1e9 with priors: "converged" at a log-loss of 2.5e6, 0.257 reachable)
        _, unit = margin_and_unit(features, process_group)
        if unit == 1.0:
            return self._fit_vector(features, labels, weights, loss, max_iter, process_group)
        with torch.no_grad():  # a fresh fit starts at w = 1 in the new units, a warm one where it was
            self.weight.mul_(1.0 if self._at_identity() else unit)
        try:
            return self._fit_vector(in_units(features, unit), labels, weights, loss, max_iter, process_group)
        finally:
            with torch.no_grad():
                self.weight.div_(unit)

    def _fit_vector(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        """:meth:`_fit` on logits of typical margins within 2^16 of 1."""
        if loss != "log":
            record = self._fit_nonconvex(features, labels, weights, loss, max_iter, process_group)
            with torch.no_grad():
                self.bias.sub_(self.bias.mean())  # softmax ignores a common shift: fix it, as the log-loss fit does
            return record
        k = features.shape[1]
        start = torch.cat([self.weight.detach(), self.bias.detach()])
        if self._at_identity():
            start[:k] = inverse_temperature_start(features.float(), labels, weights, process_group)
        theta, record = fit_linear_newton(
            VectorDesign(), features, labels, weights, start, max_iter=min(max_iter, 100), process_group=process_group
        )
        with torch.no_grad():
            self.weight.copy_(theta[:k])
            self.bias.copy_(theta[k:] - theta[k:].mean())  # softmax ignores a common shift: fix it
        if newton_stalled(record, max_iter):  # (degenerate curvature): L-BFGS on from Newton's point
            return after_newton(record, super()._fit(features, labels, weights, loss, max_iter - record.iterations, process_group))
        return warn_unconverged(record, type(self).__name__)
