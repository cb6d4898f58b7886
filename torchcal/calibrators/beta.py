"""Beta calibration for binary tasks (Kull, Silva Filho & Flach 2017)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from torchcal._validation import stacklevel_outside_package
from torchcal.calibrators._linear import BinaryLogisticDesign, finish_newton, fit_linear_newton
from torchcal.calibrators.affine import PlattScaling
from torchcal.calibrators.base import Calibrator
from torchcal.calibrators.temperature import inverse_temperature_start
from torchcal.distributed import ProcessGroup, all_reduce_
from torchcal.fit import FitRecord

__all__ = ["BetaCalibration"]


class BetaCalibration(Calibrator):
    """``logit P(class 1) = a * log q1 - b * log q0 + c`` for K = 2, with ``a, b >= 0``.

    ``q = softmax(logits)``. It contains the identity (``a = b = 1, c = 0``) and both sigmoid and
    inverse-sigmoid shapes; with ``a = b`` it is Platt scaling on the log-odds. As in the
    reference implementation, the unconstrained fit is refitted with ``a = 0`` (else ``b = 0``) if
    a coefficient comes out negative, and again with both at 0 (the base rate) if the refit turns
    the other negative, which keeps the map monotone; each refit starts from the identity of the
    remaining coefficients. The log-loss fits are convex: Newton's method with the
    exact 3 x 3 Hessian, started from temperature scaling of the log-odds. Under other losses (the
    Brier score) they are not, and each fit starts from the better of the identity and the log-loss
    fit of the same coefficients. Scores of at most two distinct values (or of log-odds within
    about 1e-6 of each other) do not determine ``a`` and ``b`` apart (a line of maps fits them
    equally well, and each extrapolates differently): there the fit warns and is Platt scaling, ``a = b``.
    """

    supported_num_classes = 2
    a: Tensor
    b: Tensor
    c: Tensor

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        return True  # (an unpenalised intercept: the missing class's probability falls without bound)

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"a": torch.ones(()), "b": torch.ones(()), "c": torch.zeros(())}

    def _features(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=1)

    def _scores(self, features: Tensor) -> Tensor:
        dtype = features.dtype
        log_odds = self.a.to(dtype) * features[:, 1] - self.b.to(dtype) * features[:, 0] + self.c.to(dtype)
        return torch.stack([torch.zeros_like(log_odds), log_odds], dim=1)

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        if not _coefficients_identified(features, process_group):
            return self._fit_as_platt_scaling(features, labels, weights, loss, max_iter, process_group)
        try:
            record = self._fit_free(features, labels, weights, loss, max_iter, process_group)
            # a first, as the reference does; a refit with b = 0 can turn a negative (scores that
            # rank the classes the wrong way round), so the check runs until neither is
            while negative := [p for p in (self.a, self.b) if p.requires_grad and p.item() < 0]:
                # The unconstrained fit's other coefficients compensate for the negative one;
                # without it they saturate the scores, and under the Brier score the gradient
                # underflows there: the refit starts afresh.
                negative[0].requires_grad_(False)
                with torch.no_grad():
                    negative[0].zero_()
                    for other, value in self._identity(2).items():
                        if getattr(self, other).requires_grad:
                            getattr(self, other).copy_(value)
                record = self._fit_free(features, labels, weights, loss, max_iter, process_group)
        finally:
            for p in (self.a, self.b):
                p.requires_grad_(True)
        return record

    def _fit_as_platt_scaling(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        """``a = b``: Platt scaling of the log-odds (whose warnings, of scores that are the same on
        every row say, are passed on under this calibrator's name)."""
        warnings.warn(f"{type(self).__name__}: the scores take at most two distinct values (or differ by round-off only), which "
                      f"do not determine a and b apart (a line of maps fits them equally well): fitted with a = b, as Platt "
                      f"scaling of the log-odds.",
                      UserWarning, stacklevel=stacklevel_outside_package())
        platt = PlattScaling()
        platt._materialize(2, features.device)
        platt.num_classes = 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = platt._fit(platt._features(features), labels, weights, loss, max_iter, process_group)
        for w in caught:
            warnings.warn(str(w.message).replace(type(platt).__name__, type(self).__name__), w.category,
                          stacklevel=stacklevel_outside_package())
        with torch.no_grad():
            self.a.fill_(platt.slope)
            self.b.fill_(platt.slope)
            self.c.fill_(platt.intercept)
        return record

    def _fit_free(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        """Fit the coefficients that require grad; the others stay at zero."""
        if loss == "log":  # convex
            return self._fit_log_loss(features, labels, weights, max_iter, process_group)
        return self._fit_nonconvex(features, labels, weights, loss, max_iter, process_group)

    def _fit_log_loss(self, features, labels, weights, max_iter, process_group=None, tol_grad=None, tol_decrease=None) -> FitRecord:
        """Newton's method with the exact Hessian: logistic regression on ``[1, log q1, -log q0]``
        (a coefficient held at 0 has its feature zeroed, and Newton leaves it there). L-BFGS, scale-
        dependent, stopped 2 % above the optimum on log-odds of 1e5 (features of 1e5 next to the
        intercept's 1), its own model predicting nothing left to gain."""
        x = torch.stack([features[:, 1] if self.a.requires_grad else torch.zeros_like(features[:, 1]),
                         -features[:, 0] if self.b.requires_grad else torch.zeros_like(features[:, 0])], dim=1)
        start = torch.stack([self.c, self.a, self.b]).detach()
        if self._at_identity():
            # From temperature scaling of the log-odds, as the full maps start: log-odds of 1e5
            # saturate every row at the identity, and Newton's first steps found no decrease.
            beta = inverse_temperature_start(features, labels, weights, process_group)
            start = start.new_tensor([0.0, beta * self.a.requires_grad, beta * self.b.requires_grad])
        theta, record = fit_linear_newton(BinaryLogisticDesign(), x, labels, weights, start, max_iter=min(max_iter, 100),
                                          process_group=process_group)

        def keep_point() -> None:
            with torch.no_grad():
                for name, value in zip(("c", "a", "b"), theta):
                    getattr(self, name).copy_(value)

        return finish_newton(record, keep_point, lambda cap: Calibrator._fit(self, features, labels, weights, "log", cap, process_group),
                             max_iter, type(self).__name__)


def _coefficients_identified(features: Tensor, process_group: ProcessGroup | None) -> bool:
    """Whether the design ``[1, log q1, -log q0]`` of ``features: (N, 2)`` (log-posteriors) has full
    rank over all shards; it has not where the scores take at most two distinct values. Judged on
    the centred columns: log-odds of 1e-3 leave both columns nearly constant (uncentred, the design
    looked singular to 1e-12), while their centred parts, about llr / 2 each, still differ at
    second order (llr^2 / 8)."""
    columns = torch.stack([features[:, 1], -features[:, 0]], dim=1).to(torch.float64)
    sums = all_reduce_(torch.cat([columns.sum(0), columns.new_tensor([columns.shape[0]])]), process_group)
    centred = columns - sums[:2] / sums[2]
    gram = all_reduce_(centred.T @ centred, process_group)
    scale = gram.diagonal().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    eigenvalues = torch.linalg.eigvalsh(gram / scale[:, None] / scale[None, :])
    # (two distinct rows leave the smallest at round-off, about 1e-16 of the largest; constant ones at 0)
    return bool(eigenvalues[0] > 1e-13 * eigenvalues[-1])
