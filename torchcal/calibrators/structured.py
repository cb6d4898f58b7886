"""Structured vector and matrix scaling (Berta, Holzmüller, Jordan & Bach 2025) and quadratic
scaling for binary tasks.

SVS and SMS act on the *ts-mix* log-posteriors ``x = log((1 - eps) softmax(beta * logits) + eps/K)``:
temperature scaling fitted first (log-loss, unpenalised), then mixed with the uniform distribution
at weight ``eps = 1 / (N + 1)`` for N calibration samples. The mixing bounds every feature below by
``log(eps / K)``, so no confident mistake sends a feature to minus infinity. On these features

- SVS: ``softmax((1 + v) * x + b)``, 2K parameters;
- SMS: ``softmax((I + D + M) @ x + b)``, D diagonal, M off-diagonal, K (K + 1) parameters;

fitted by minimising the mean loss plus ridge penalties on the deviations from the identity whose
strength grows with K and shrinks with N:
``lambda K / N (|b|^2 + |diag|^2) + lambda K (K - 1) / N |M|^2``. The K (K - 1) off-diagonal
entries are shrunk hardest, so SMS departs from SVS only as far as the data insist; that is what
keeps matrix scaling from diverging at K = 100. lambda is cross-validated by default (the paper
fixes lambda = 1, which ``reg_lambda=1.0`` reproduces); in a data-parallel fit (``process_group``)
each process splits its own samples into the folds, so the chosen lambda, and the fit, can differ
from a one-process fit's on the same data. Copies of a sample land in different folds
(:func:`torchcal.fit.fold_indices`), where they favour weak penalties: remove duplicated rows first.

SMS's log-loss fit is multinomial logistic regression on ``[x, 1]`` about the identity, solved by
the Newton-CG solver of Dirichlet calibration (:mod:`torchcal.calibrators._multinomial`). SVS's
log-loss fits up to 256 classes end with Newton's method on the exact (2K)^2 Hessian; on a GPU
(and on a CPU up to 16 classes) they are Newton's from their start. The other fits are L-BFGS in
coordinates in which the curvature is close to the identity: exact 2 x 2 blocks per class for
SVS; for SMS (other losses) the Kronecker-factored curvature of a softmax layer (class covariance x
feature second moments, as K-FAC; two K x K eigendecompositions) plus the exact per-class blocks
of the diagonal and the bias, whose penalty is K - 1 times weaker than that of the off-diagonal
entries. The ts-mix features share a large negative offset (every unlikely class sits near
``log(eps / K)``), which makes plain L-BFGS crawl along that direction; the feature factor takes
it out. Measured at K = 100: about 30 passes over the data instead of 500 (Newton-CG: 16).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchcal._fast_exp import exp_floor
from torchcal._validation import check_folds, check_strength, stacklevel_outside_package
from torchcal.calibrators._linear import (
    BinaryLogisticDesign,
    VectorDesign,
    after_newton,
    finish_newton,
    fit_linear_newton,
    hand_over_to_lbfgs,
    newton_stalled,
)
from torchcal.calibrators._multinomial import (
    DIVERGING,
    MAX_NEWTON_STEPS,
    SELECTION_TOLERANCES,
    TIE_TOLERANCES,
    fit_multinomial_logistic,
    warn_diverging,
)
from torchcal.calibrators.base import Calibrator, sample_weights, total_samples
from torchcal.calibrators.temperature import fit_inverse_temperature
from torchcal.distributed import ProcessGroup, all_reduce_, world_size
from torchcal.fit import ConvergenceWarning, FitRecord, cross_validate_warm_path, fold_indices, minimize
from torchcal.functional.scoring import PER_SAMPLE_SCORES, weighted_terms

__all__ = ["DEFAULT_LAMBDA_GRID", "QuadraticScaling", "StructuredMatrixScaling", "StructuredVectorScaling"]

#: Multipliers of the penalties tried by cross-validation (``reg_lambda=None``, the default):
#: 4^-6 .. 4^2. On the CIFAR-100 logits of ../shared/data/real the out-of-fold loss still fell at
#: 4^-3 (the lower end of a first grid); lambda = 1, the paper's fixed default, was 0.001 to 0.06
#: nats worse than the cross-validated choice there.
DEFAULT_LAMBDA_GRID: tuple[float, ...] = tuple(4.0**e for e in range(-6, 3))
#: L-BFGS's loss-change tolerance per accuracy of ``_fit_map`` (SVS; SMS where the loss is not
#: the log-loss, which Newton-CG fits, see StructuredMatrixScaling._fit_map).
#: - "final": loss changes of 1e-12 can leave gradients of a few 1e-6 at N = 50,000 (weaker
#:   penalties); 1e-13 gets below 1e-6.
#: - "selection", the fits that only select lambda, which run on float32 passes alone (see
#:   _FLOAT32_TOL_CHANGE). Against 1e-9 with float64 passes after the float32 stage, the default
#:   cross-validated SMS fit (then by L-BFGS) on the four CIFAR-100 sets of ../shared/data/real took
#:   20-35 % less time (ResNet-20 8.4 -> 5.9 s, RepVGG-A2 21.1 -> 13.9 s), selected the same lambda
#:   and moved the out-of-fold losses by at most 8e-6 (relative), a hundredth of the smallest gap
#:   between the best point and the next.
#: - "tie": points within fit._TIE (relative) of the best are fitted again to this, and those
#:   losses decide.
_TOL_CHANGE = {"final": 1e-13, "selection": 1e-8, "tie": 1e-11}
#: SVS's final log-loss fit is finished by Newton's method up to this many classes (a (2K)^2
#: Hessian, N (2K)^2 multiply-adds per step).
_NEWTON_POLISH_CLASSES = 256
#: ... and every log-loss fit of SVS (cross-validation's too) by Newton's method alone up to this
#: many classes on a CPU, and on other devices. On one CPU thread at 10,000 samples that fixed fit
#: took 0.84-0.92x the time of L-BFGS's from K = 32 to 100 and 1.18x at 10 and 20, the
#: cross-validated one 1.02x at 10, 0.65x at 32 and 0.35x at 100 (the Hessians' N (2K)^2
#: products); a GPU forms them in microseconds but waits on every L-BFGS read-back.
_NEWTON_CPU_CLASSES = 16
_NEWTON_DEVICE_CLASSES = _NEWTON_POLISH_CLASSES
#: The gradient tolerance of SVS's Newton fits per accuracy of ``_fit_map``.
_NEWTON_TOL_GRAD = {"final": 1e-10, "selection": 1e-6, "tie": 1e-8}
#: The fits run L-BFGS on float32 passes (cheaper than float64 ones) down to this loss change, then
#: on float64 passes from there with the same L-BFGS memory. The float32 passes sum their losses in
#: float64: summed in float32, the sum's round-off (1e-7 of the loss) made the float32 line searches
#: fail below loss changes of about 1e-6, and the float64 stage had to do the rest (at 10,000 x 100,
#: lambda = 1: 19 of 29 passes float64, now 15; on the real CIFAR-100 logits the weak penalties'
#: fits need a third fewer passes). Below 1e-8 the terms' own round-off shows (1e-9: 29 -> 45 passes
#: at lambda = 1).
_FLOAT32_TOL_CHANGE = 1e-8


def _log_loss_residual_(scores: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
    """``sum_i w_i (logsumexp(s_i) - s_i[y_i])`` (float64) for scores ``s: (n, K)``, which it overwrites
    with that sum's gradient ``w_i (softmax(s_i) - e_{y_i})``, formed from the same exponentials
    (so a backward pass is one product, not a softmax over the scores again)."""
    top = scores.amax(dim=1, keepdim=True)
    rows = labels.unsqueeze(1)
    margin = (top - scores.gather(1, rows)).squeeze(1)
    # Subnormal exponentials made float32 passes up to 25x slower on real CIFAR-100 logits at weak
    # penalties (float64: exp is faster here than _fast_exp's exp2).
    residual = scores.sub_(top).clamp_(min=exp_floor(scores.dtype)).exp_()
    total = residual.sum(dim=1)
    residual.mul_((sample_w / total).unsqueeze(1)).scatter_add_(1, rows, -sample_w.unsqueeze(1))
    # summed in float64 whatever the inputs: in float32 the sum's round-off (about 1e-7 of the loss)
    # stopped the float32 stage's line searches at loss changes of 1e-6; the terms' own round-off
    # averages out over the samples
    return sample_w.double() @ (total.log() + margin).double()


class _LinearLogLoss(torch.autograd.Function):
    """The weighted log-loss of the scores ``design @ weight.T`` for ``design: (n, D)`` and
    ``weight: (K, D)``, differentiable in ``weight``: the scores are formed, and turned into the
    residual, in one buffer, so a pass allocates nothing of size (n, K) but that."""

    @staticmethod
    def forward(ctx, design: Tensor, weight: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
        residual = design @ weight.T
        loss = _log_loss_residual_(residual, labels, sample_w)
        ctx.save_for_backward(design, residual)
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        design, residual = ctx.saved_tensors
        return None, (residual.T @ design) * grad_output, None, None


class _VectorLogLoss(torch.autograd.Function):
    """The weighted log-loss of the scores ``(1 + theta[0]) * x + theta[1]`` for ``x: (n, K)``,
    differentiable in ``theta: (2, K)``: the scores are formed, and turned into the residual, in one
    buffer, whose column sums give the gradient in the same pass (half the time of autograd's
    backward through the scores, which also allocated a second (n, K) buffer)."""

    @staticmethod
    def forward(ctx, x: Tensor, theta: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
        residual = torch.addcmul(theta[1], x, 1 + theta[0])
        loss = _log_loss_residual_(residual, labels, sample_w)
        ctx.save_for_backward(torch.stack([torch.linalg.vecdot(residual, x, dim=0), residual.sum(0)]))
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (grad,) = ctx.saved_tensors
        return None, grad * grad_output, None, None


class _StructuredScaling(Calibrator):
    """ts-mix preprocessing, penalised fit and cross-validation shared by SVS and SMS.

    Subclasses define the map on the ts-mix features through a deviation ``theta`` from the
    identity (:meth:`_map_theta`), its penalty weights and its preconditioner.
    """

    _buffer_names = ("inverse_temperature", "mix")
    # fitted tensors, registered by Calibrator._materialize
    inverse_temperature: Tensor
    mix: Tensor
    weight: Tensor
    bias: Tensor

    def __init__(
        self,
        reg_lambda: float | None = None,
        reg_grid: Sequence[float] = DEFAULT_LAMBDA_GRID,
        cv_folds: int = 5,
        cv_seed: int = 0,
    ) -> None:
        super().__init__()
        reg_lambda = None if reg_lambda is None else check_strength(reg_lambda, "reg_lambda")
        try:
            grid = [check_strength(g, "reg_grid") for g in reg_grid]
        except (ValueError, TypeError):
            grid = []
        if reg_lambda is None and not grid:
            raise ValueError(f"reg_grid must be a non-empty sequence of finite lambdas >= 0, got {reg_grid!r}.")
        cv_folds, cv_seed = check_folds(cv_folds, cv_seed, "cv_folds", "cv_seed")
        self.reg_lambda = reg_lambda
        self.reg_grid = grid
        self.cv_folds = cv_folds
        self.cv_seed = cv_seed
        self.reg_lambda_: float | None = None
        self.cv_losses_: list[float] | None = None

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        return self.reg_lambda_ == 0  # (the bias's penalty too)

    def _regularisation_advice(self) -> str:
        return "Use reg_lambda > 0, or None (cross-validated from reg_grid)."

    def _penalised_everywhere(self) -> bool:
        return bool(self.reg_lambda_)

    # --------------------------------------------------------------- the map, per subclass
    def _map_identity(self, num_classes: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def _theta(self) -> Tensor:
        """The fitted map's deviation from the identity."""
        raise NotImplementedError

    def _set_theta(self, theta: Tensor) -> None:
        raise NotImplementedError

    @staticmethod
    def _design(x: Tensor) -> Tensor:
        """What the map reads of the ts-mix features ``x: (n, K)`` (formed once per fit)."""
        return x

    @staticmethod
    def _map_theta(design: Tensor, theta: Tensor) -> Tensor:
        """Scores (n, K) of :meth:`_design`'s output under the deviation ``theta``."""
        raise NotImplementedError

    @classmethod
    def _log_loss(cls, design: Tensor, theta: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
        """The weighted log-loss sum of :meth:`_map_theta`'s scores, differentiable in ``theta``."""
        raise NotImplementedError

    @staticmethod
    def _penalty_weights(num_classes: int, num_samples: float, reg_lambda: float) -> Tensor:
        """The penalty as ``sum(weights * theta^2)``: weights shaped like ``theta``, float64."""
        raise NotImplementedError

    @staticmethod
    def _preconditioner(
        design: Tensor, sample_w: Tensor, theta: Tensor, penalty: Tensor, process_group: ProcessGroup | None
    ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
        """``(to_theta, from_theta)``: a linear change of variables ``theta = to_theta(phi)``
        under which the log-loss curvature at ``theta`` is close to the identity."""
        raise NotImplementedError

    # ------------------------------------------------------------------ calibrator hooks
    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {
            "inverse_temperature": torch.ones((), dtype=torch.float64),
            "mix": torch.zeros((), dtype=torch.float64),
            **self._map_identity(num_classes),
        }

    def _features(self, logits: Tensor) -> Tensor:
        # softmax(beta z) = softmax(beta log_softmax(z)); the log-softmax's log-sum-exp, added
        # to every score, rounds margins of 1e-4 in float32 that beta then multiplies (forward
        # on float32 logits was 2e-2 off the float64 one, against temperature scaling's 4e-6)
        return logits - logits.amax(dim=1, keepdim=True)

    def _ts_mix(self, log_probs: Tensor) -> Tensor:
        """``log((1 - eps) softmax(beta * log_probs) + eps / K)`` for log-posteriors (n, K)."""
        dtype = log_probs.dtype
        beta, eps = self.inverse_temperature.to(dtype), self.mix.to(dtype)
        # As written: where softmax's relative round-off could show (posteriors near or below
        # eps / K), eps / K dominates the sum; a logaddexp form took twice the passes. Nothing in
        # place on softmax's output or under the log, whose backward passes read them (a network
        # fine-tuned through the head raised). The floor only binds at eps = 0, which no fit sets:
        # there posteriors that underflow would be log(0) = -inf.
        mixed = torch.softmax(beta * log_probs, dim=1) * (1 - eps)
        return mixed.add_(eps / self.num_classes).clamp_(min=torch.finfo(dtype).tiny).log()

    def _scores(self, features: Tensor) -> Tensor:
        return self._map_theta(self._design(self._ts_mix(features)), self._theta().to(features.dtype))

    # ------------------------------------------------------------------------- fitting
    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        x = self._fit_ts_mix(features, labels, weights, process_group)
        if self.reg_lambda is None:
            self.cv_losses_, start = self._cross_validate(features, labels, weights, loss, max_iter, process_group)
            self.reg_lambda_ = self.reg_grid[min(range(len(self.reg_grid)), key=self.cv_losses_.__getitem__)]
            with torch.no_grad():  # the final fit starts where the folds ended, near its optimum
                self._set_theta(start)
        else:  # (no selection: a fixed-strength refit had kept an earlier fit's, or a loaded state's)
            self.reg_lambda_, self.cv_losses_ = self.reg_lambda, None
        return self._fit_map(x, labels, weights, loss, max_iter, self.reg_lambda_, process_group)

    def _fit_ts_mix(self, log_probs: Tensor, labels: Tensor, weights: Tensor | None, process_group: ProcessGroup | None) -> Tensor:
        """Fit the temperature and the mixing weight; returns the ts-mix features (n, K)."""
        with warnings.catch_warnings():
            # An infinite or zero temperature is a valid start for the map, which can still scale.
            warnings.simplefilter("ignore", ConvergenceWarning)
            beta, _ = fit_inverse_temperature(log_probs, labels, weights, process_group=process_group)
        n_total = total_samples(labels, process_group)
        with torch.no_grad():
            self.inverse_temperature.fill_(beta)
            self.mix.copy_(1.0 / (n_total + 1.0))
        return self._ts_mix(log_probs)

    def _fit_map(
        self,
        x: Tensor,
        labels: Tensor,
        weights: Tensor | None,
        loss: str,
        max_iter: int,
        reg_lambda: float,
        process_group: ProcessGroup | None,
        accuracy: str = "final",
    ) -> FitRecord:
        """Minimise the mean loss plus penalty over ``theta`` from its current value, by L-BFGS in
        preconditioned coordinates, as accurately as a ``"final"`` fit, a cross-validation's
        ``"selection"`` fit or its ``"tie"`` break needs (``_TOL_CHANGE``)."""
        tol_change = _TOL_CHANGE[accuracy]
        k = x.shape[1]
        design = self._design(x)
        per_sample = PER_SAMPLE_SCORES[loss]
        sample_w = sample_weights(labels, weights, process_group)
        n_total = float(total_samples(labels, process_group))
        penalty = self._penalty_weights(k, n_total, reg_lambda).to(x.device)
        theta = self._theta().detach().clone()
        to_theta, from_theta = self._preconditioner(design, sample_w, theta, penalty, process_group)
        penalty_share = penalty / world_size(process_group)  # the group's sum counts it once
        phi = from_theta(theta).contiguous().requires_grad_(True)

        def objective_at(theta: Tensor, design_d: Tensor, sample_w_d: Tensor) -> Tensor:
            if loss == "log":
                data = self._log_loss(design_d, theta, labels, sample_w_d)
            else:
                data = sample_w_d @ per_sample(torch.log_softmax(self._map_theta(design_d, theta), dim=1), labels)
            return data.to(phi.dtype) + (penalty_share * theta.square()).sum()

        def objective_in(dtype: torch.dtype) -> Callable[[], Tensor]:
            design_d, sample_w_d = design.to(dtype), sample_w.to(dtype)
            return lambda: objective_at(to_theta(phi.to(dtype)), design_d, sample_w_d)

        def gradient() -> Tensor:  # in theta, not in the preconditioned coordinates
            theta = to_theta(phi.detach()).requires_grad_(True)
            return torch.autograd.grad(objective_at(theta.to(design.dtype), design, sample_w.to(design.dtype)), theta)[0]

        # float32 passes are enough down to _FLOAT32_TOL_CHANGE; tighter, they start the fit
        float32_enough = tol_change >= _FLOAT32_TOL_CHANGE
        rough = objective_in(torch.float32) if design.dtype == torch.float64 and not float32_enough else None
        record = minimize(
            objective_in(torch.float32 if float32_enough else design.dtype),
            [phi],
            max_iter=max_iter,
            tol_change=tol_change,
            process_group=process_group,
            rough_objective=rough,
            rough_tol_change=_FLOAT32_TOL_CHANGE,
            loose=accuracy != "final",
            gradient=gradient,
        )
        with torch.no_grad():
            self._set_theta(to_theta(phi.detach()))
        return record

    def _cross_validate(self, log_probs, labels, weights, loss, max_iter, process_group=None) -> tuple[list[float], Tensor]:
        """Out-of-fold loss of every lambda of the grid along the warm-started path of
        :func:`~torchcal.fit.cross_validate_warm_path` (``inf`` for the points it abandoned), and
        the folds' mean deviation ``theta`` at the best lambda (a start for the final fit). Selection
        fits are loose (``_fit_map``'s ``"selection"`` accuracy), near-ties are fitted again more
        tightly (``"tie"``). The ts-mix step is refitted on every training fold, as it is part of
        the calibrator."""
        per_sample = PER_SAMPLE_SCORES[loss]
        folds = []
        for test in fold_indices(labels, self.cv_folds, self.cv_seed, process_group=process_group, scores=log_probs):
            test = test.to(log_probs.device)
            train = torch.ones_like(labels, dtype=torch.bool)
            train[test] = False
            model = copy.deepcopy(self)
            model._materialize(log_probs.shape[1], log_probs.device)
            x_train = model._fit_ts_mix(log_probs[train], labels[train], weights, process_group)
            folds.append((model, x_train, labels[train], model._design(model._ts_mix(log_probs[test])), labels[test]))

        def fit_fold(point: int, fold: int, start: Tensor | None, tight: bool) -> tuple[Tensor, Tensor]:
            model, x_train, y_train, design_test, y_test = folds[fold]
            if start is not None:
                with torch.no_grad():
                    model._set_theta(start)
            model._fit_map(x_train, y_train, weights, loss, max_iter, self.reg_grid[point], process_group,
                           "tie" if tight else "selection")
            with torch.no_grad():
                log_q = torch.log_softmax(model._map_theta(design_test, model._theta()), dim=1)
                return weighted_terms(per_sample(log_q, y_test), y_test, weights), model._theta().detach()

        order = sorted(range(len(self.reg_grid)), key=lambda i: -self.reg_grid[i])
        names = [f"{type(self).__name__} lambda = {lam:g}" for lam in self.reg_grid]
        return cross_validate_warm_path(order, self.reg_grid, len(folds), fit_fold, labels.shape[0], process_group,
                                        point_names=names)

    # --------------------------------------------------------------------------- state
    def get_extra_state(self):
        return {**super().get_extra_state(), "reg_lambda_": self.reg_lambda_, "cv_losses_": self.cv_losses_}

    def set_extra_state(self, state) -> None:
        super().set_extra_state(state)
        self.reg_lambda_, self.cv_losses_ = state.get("reg_lambda_"), state.get("cv_losses_")

    def extra_repr(self) -> str:
        reg = f"lambda={self.reg_lambda_:g}, " if self.reg_lambda_ is not None else ""
        return reg + super().extra_repr()


class StructuredVectorScaling(_StructuredScaling):
    """Structured vector scaling (SVS): ``softmax(weight * x + bias)`` on the ts-mix features ``x``.

    Args:
        reg_lambda: multiplier of the ridge penalty ``K / N (|weight - 1|^2 + |bias|^2)`` added to
            the mean loss; ``None`` (the default) chooses it from ``reg_grid`` by ``cv_folds``-fold
            cross-validation. 1 is the paper's fixed default (and probmetrics'): one fit, no CV
            (and, in a data-parallel fit, no dependence on the sharding: see the module docs).

    Fitted state: ``inverse_temperature`` and ``mix`` (the ts-mix step), ``weight: (K,)``,
    ``bias: (K,)``; ``reg_lambda_`` (and ``cv_losses_`` when cross-validated).

    Example:
        >>> import torch
        >>> from torchcal import StructuredVectorScaling
        >>> logits = 3 * torch.randn(2000, 5)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> svs = StructuredVectorScaling().fit(logits, labels)
        >>> 0.25 < svs.inverse_temperature.item() < 0.45
        True
    """

    def _map_identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"weight": torch.ones(num_classes), "bias": torch.zeros(num_classes)}

    def _theta(self) -> Tensor:
        return torch.stack([self.weight - 1, self.bias])

    def _set_theta(self, theta: Tensor) -> None:
        self.weight.copy_(theta[0] + 1)
        self.bias.copy_(theta[1] - theta[1].mean())  # softmax ignores a common shift: fix it

    def _fit_map(self, x, labels, weights, loss, max_iter, reg_lambda, process_group, accuracy="final") -> FitRecord:
        """L-BFGS (:meth:`_StructuredScaling._fit_map`); a final log-loss fit of at most
        ``_NEWTON_POLISH_CLASSES`` classes runs it only as far as a selection fit (on float32
        passes), then Newton's method with the exact (2K)^2 Hessian. L-BFGS to the final tolerance
        stops once the loss no longer changes, which on ill-conditioned features leaves the
        parameters short of the optimum: on the SST-2 GPT-2 4-shot logits (lambda = 4^-4) at a
        gradient of 6e-7, the weights 3.7e-4 from it; after Newton, the gradient is round-off.

        Where the Hessian is cheap next to L-BFGS's passes and read-backs (``_NEWTON_CPU_CLASSES``,
        ``_NEWTON_DEVICE_CLASSES``), every log-loss fit is Newton's from its start, selection fits
        to ``_NEWTON_TOL_GRAD``'s looser gradients."""
        k = x.shape[1]
        newton_fits = k <= (_NEWTON_CPU_CLASSES if x.device.type == "cpu" else _NEWTON_DEVICE_CLASSES)
        newton_only = loss == "log" and reg_lambda > 0 and newton_fits
        polish = loss == "log" and accuracy == "final" and reg_lambda > 0 and k <= _NEWTON_POLISH_CLASSES
        record = None
        if not newton_only:
            record = super()._fit_map(x, labels, weights, loss, max_iter, reg_lambda, process_group, "selection" if polish else accuracy)
            if not polish or record.iterations >= max_iter:  # (the iteration cap counts both)
                return record
        before = record or FitRecord(0, 0, math.nan, math.nan, True, "")
        n_total = float(total_samples(labels, process_group))
        penalty = self._penalty_weights(k, n_total, reg_lambda).to(x.device).flatten()
        theta, polished = fit_linear_newton(_VectorAboutIdentity(), self._design(x).detach(), labels, weights,
                                            self._theta().detach().flatten(), penalty, max_iter=max_iter - before.iterations,
                                            tol_grad=_NEWTON_TOL_GRAD[accuracy], process_group=process_group)
        used, evaluations = before.iterations + polished.iterations, before.evaluations + polished.evaluations
        with torch.no_grad():  # (Newton's point, its best)
            self._set_theta(theta.view(2, k))
        if newton_stalled(polished, max_iter - before.iterations):  # (L-BFGS on to the accuracy asked, within the cap)
            rest = super()._fit_map(x, labels, weights, loss, max_iter - used, reg_lambda, process_group, accuracy)
            return after_newton(dataclasses.replace(polished, iterations=used, evaluations=evaluations), rest)
        if not polished.converged:
            stages = "Newton" if record is None else f"{record.iterations} L-BFGS iterations ({record.message}), then Newton"
            message = f"stopped at the iteration cap ({max_iter}: {stages})"
            warnings.warn(f"{type(self).__name__} {message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
            return dataclasses.replace(polished, iterations=used, evaluations=evaluations, message=message)
        message = f"Newton: {polished.message}" if record is None else f"{record.message}; then Newton: {polished.message}"
        return FitRecord(used, evaluations, polished.loss, polished.grad_max, True, message)

    @staticmethod
    def _map_theta(design: Tensor, theta: Tensor) -> Tensor:
        return torch.addcmul(theta[1], design, 1 + theta[0])

    @classmethod
    def _log_loss(cls, design: Tensor, theta: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
        return _VectorLogLoss.apply(design, theta, labels, sample_w)

    @staticmethod
    def _penalty_weights(num_classes: int, num_samples: float, reg_lambda: float) -> Tensor:
        return torch.full((2, num_classes), reg_lambda * num_classes / num_samples, dtype=torch.float64)

    @staticmethod
    def _preconditioner(design, sample_w, theta, penalty, process_group):
        # in float32, as SMS's: a change of variables only has to be well conditioned, not exact
        design32 = design.float()
        q = torch.softmax(StructuredVectorScaling._map_theta(design32, theta.float()), dim=1)
        to_theta, from_theta = _per_class_blocks(design32, q, sample_w.float(), penalty, process_group)

        def to_centred_theta(phi: Tensor) -> Tensor:
            # The softmax ignores a shift of every bias, which only the penalty holds (and sets to
            # 0): with the shift left in, L-BFGS crawled along it at weak penalties (lambda = 4^-6,
            # 1,500 x 5: the 1,000-iteration cap at a gradient of 4e-7). Centred, it is gone, and
            # the optimum, whose bias is centred, stays where it was.
            theta = to_theta(phi)
            return torch.stack([theta[0], theta[1] - theta[1].mean()])

        return to_centred_theta, from_theta


def _per_class_blocks(
    x: Tensor, q: Tensor, sample_w: Tensor, penalty: Tensor, process_group: ProcessGroup | None
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """The change of variables of the exact per-class 2 x 2 Hessian blocks in ``theta = [v; b]``
    (2, K) of the map ``(1 + v) * x + b`` at posteriors ``q: (n, K)``, cross-class terms dropped:
    ``B_k = sum_i w_i q_ik (1 - q_ik) [x_ik, 1]^T [x_ik, 1] + 2 diag(penalty[:, k])``. The sums
    are formed from each class's curvature-weighted total ``S``, mean ``m`` and variance ``v``
    of ``x``, ``B = S [[v + m^2, m], [m, 1]]``, the variance as a sum of squares about the mean:
    never negative, so the blocks' determinants ``S^2 v`` are not either. (A constant ``x``,
    scores that say nothing, whose ts-mix fit's beta is 0, makes every block rank one; formed as
    sums of ``x^2``, ``x`` and 1, their float32 round-off made the Cholesky factorisation fail
    under weak penalties, which the jitter below cannot outweigh.)"""
    r = torch.addcmul(q, q, q, value=-1)  # q (1 - q)
    total = all_reduce_(torch.stack([sample_w @ r, sample_w @ (r * x)]).to(penalty.dtype), process_group)
    divisor = torch.where(total[0] > 0, total[0], 1.0)
    mean = total[1] / divisor
    spread = (x - mean.to(x.dtype)).square_().mul_(r)
    variance = all_reduce_((sample_w @ spread).to(penalty.dtype), process_group) / divisor
    sums = total[0].view(-1, 1, 1) * torch.stack([variance + mean.square(), mean, mean, torch.ones_like(mean)], dim=1).view(-1, 2, 2)
    blocks = sums + torch.diag_embed(2 * penalty.T)
    jitter = 1e-12 * blocks.diagonal(dim1=1, dim2=2).amax() + torch.finfo(blocks.dtype).tiny
    chol = torch.linalg.cholesky(blocks + jitter * torch.eye(2, dtype=blocks.dtype, device=x.device))  # B_k = L_k L_k^T

    chol_in = functools.cache(chol.to)

    def to_theta(phi: Tensor) -> Tensor:  # theta_k = L_k^-T phi_k
        return torch.linalg.solve_triangular(chol_in(phi.dtype).mT, phi.T.unsqueeze(2), upper=True).squeeze(2).T

    def from_theta(theta: Tensor) -> Tensor:
        return (chol.mT @ theta.T.unsqueeze(2)).squeeze(2).T

    return to_theta, from_theta


class StructuredMatrixScaling(_StructuredScaling):
    """Structured matrix scaling (SMS): ``softmax(weight @ x + bias)`` on the ts-mix features ``x``,
    with ``weight: (K, K)`` penalised towards the identity.

    Args:
        reg_lambda: multiplier of the ridge penalties ``K / N (|diag(weight) - 1|^2 + |bias|^2)``
            and ``K (K - 1) / N |offdiag(weight)|^2`` added to the mean loss; ``None`` (the
            default) chooses it from ``reg_grid`` by ``cv_folds``-fold cross-validation. 1 is the
            paper's fixed default (and probmetrics'): one fit, no CV (and, in a data-parallel fit,
            no dependence on the sharding: see the module docs).

    Fitted state: ``inverse_temperature`` and ``mix`` (the ts-mix step), ``weight: (K, K)``,
    ``bias: (K,)``; ``reg_lambda_`` (and ``cv_losses_`` when cross-validated).

    Example:
        >>> import torch
        >>> from torchcal import StructuredMatrixScaling
        >>> logits = 3 * torch.randn(2000, 5)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> sms = StructuredMatrixScaling().fit(logits, labels)
        >>> sms.weight.shape, bool(sms.fit_record_.converged)
        (torch.Size([5, 5]), True)
    """

    def _map_identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"weight": torch.eye(num_classes), "bias": torch.zeros(num_classes)}

    def _theta(self) -> Tensor:
        k = self.weight.shape[0]
        eye = torch.eye(k, dtype=self.weight.dtype, device=self.weight.device)
        return torch.cat([self.weight - eye, self.bias.unsqueeze(1)], dim=1)

    def _set_theta(self, theta: Tensor) -> None:
        k = theta.shape[0]
        self.weight.copy_(theta[:, :k] + torch.eye(k, dtype=theta.dtype, device=theta.device))
        self.bias.copy_(theta[:, k] - theta[:, k].mean())  # softmax ignores a common shift: fix it

    @staticmethod
    def _design(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)  # [x, 1]: the bias is W's last column

    @staticmethod
    def _map_theta(design: Tensor, theta: Tensor) -> Tensor:
        return torch.addmm(design[:, :-1], design, theta.T)

    @classmethod
    def _log_loss(cls, design: Tensor, theta: Tensor, labels: Tensor, sample_w: Tensor) -> Tensor:
        k = theta.shape[0]
        weight = theta + torch.eye(k, k + 1, dtype=theta.dtype, device=theta.device)
        return _LinearLogLoss.apply(design, weight, labels, sample_w)

    def _fit_map(self, x, labels, weights, loss, max_iter, reg_lambda, process_group, accuracy="final") -> FitRecord:
        """The log-loss fit is multinomial logistic regression on ``[x, 1]`` about the identity:
        Newton-CG (:func:`~torchcal.calibrators._multinomial.fit_multinomial_logistic`, as for
        Dirichlet calibration), to the gradient tolerances of its cross-validation for the
        ``"selection"`` and ``"tie"`` fits. At 10,000 x 100 (lambda = 1) it reaches the optimum in
        16 passes against 29 of the preconditioned L-BFGS (0.24 against 0.44 s), on the CIFAR-100
        ResNet-20 logits at lambda = 4^-4 in 68 against 199; L-BFGS also stopped 6e-12 above the
        optimum. Other losses, and a Newton-CG fit that stalls, go to L-BFGS."""
        if loss != "log":
            return super()._fit_map(x, labels, weights, loss, max_iter, reg_lambda, process_group, accuracy)
        k = x.shape[1]
        n_total = float(total_samples(labels, process_group))
        tolerances = {"final": {}, "selection": SELECTION_TOLERANCES, "tie": TIE_TOLERANCES}[accuracy]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # (its cap's: see below)
            theta, record = fit_multinomial_logistic(
                x.detach(), labels, sample_weights(labels, weights, process_group), self._theta().detach(),
                self._penalty_weights(k, n_total, reg_lambda), max_iter=min(max_iter, MAX_NEWTON_STEPS),
                process_group=process_group, anchor=torch.eye(k, k + 1, dtype=torch.float64), **tolerances,
            )
        with torch.no_grad():  # (Newton-CG's point, its best, unless not finite)
            if record.converged or bool(torch.isfinite(theta).all()):
                self._set_theta(theta)
        if record.converged:
            return record
        if record.message.startswith(DIVERGING):  # (reg_lambda = 0: no finite optimum)
            return warn_diverging(record, self._regularisation_advice())
        def lbfgs(cap: int) -> FitRecord:  # (the preconditioned L-BFGS of _StructuredScaling)
            return super(StructuredMatrixScaling, self)._fit_map(x, labels, weights, loss, cap, reg_lambda, process_group, accuracy)

        return hand_over_to_lbfgs(record, lbfgs, max_iter, type(self).__name__)

    @staticmethod
    def _penalty_weights(num_classes: int, num_samples: float, reg_lambda: float) -> Tensor:
        k = num_classes
        weights = torch.full((k, k + 1), reg_lambda * k * (k - 1) / num_samples, dtype=torch.float64)
        weights[:, :k].fill_diagonal_(reg_lambda * k / num_samples)
        weights[:, k] = reg_lambda * k / num_samples
        return weights

    @staticmethod
    def _preconditioner(design, sample_w, theta, penalty, process_group):
        # Two levels, added: theta = kron(phi) + diag_and_bias(psi), a redundant change of
        # variables whose implied preconditioner is the sum of the two.
        # kron: the Kronecker-factored curvature A (x) G of the scores' rows, A the mean softmax
        # covariance (K, K), G the second moments of the design [x, 1] (K+1, K+1); with
        # A = U diag(a) U^T and G = V diag(g) V^T, (A (x) G + c)^(-1/2) acts on theta as
        # U ((U^T theta V) / sqrt(a g^T + c)) V^T, c the penalty's curvature in that basis: its
        # exact diagonal, 2 (U^2)^T penalty (V^2). (Its largest entry, the off-diagonal entries'
        # penalty, K - 1 times that of the diagonal and the bias, over-damped every direction that
        # is mostly bias, e.g. the ts-mix features' common offset: 37 -> 29 passes at 10,000 x 100,
        # 46 -> 24 at 10,000 x 10, 46 -> 27 at 50,000 x 100.) The penalty still couples those
        # directions, which the exact per-class 2 x 2 blocks of (diagonal, bias) take (L-BFGS then
        # needs ~30 passes at K = 100 instead of ~65, ~70 instead of ~580 at lambda = 1/16).
        # Both levels are formed in float32 (half the cost; a change of variables only has to be well
        # conditioned, not exact).
        k = theta.shape[0]
        design32, w32 = design.float(), sample_w.float()
        q = torch.softmax(StructuredMatrixScaling._map_theta(design32, theta.float()), dim=1)
        g = design32.T @ (w32.unsqueeze(1) * design32)
        a = torch.diag(w32 @ q) - q.T @ (w32.unsqueeze(1) * q)
        factors = all_reduce_(torch.cat([a.flatten(), g.flatten()]).to(design.dtype), process_group)
        eig_a, u = torch.linalg.eigh(factors[: k * k].view(k, k))
        eig_g, v = torch.linalg.eigh(factors[k * k :].view(k + 1, k + 1))
        curvature = eig_a.clamp_min(0).unsqueeze(1) * eig_g.clamp_min(0).unsqueeze(0)
        ridge = u.square().T @ (2 * penalty.to(u.dtype)) @ v.square()
        ridge += 1e-12 * curvature.amax() + torch.finfo(design.dtype).tiny
        scale = (curvature + ridge).rsqrt()
        diagonal = torch.arange(k, device=design.device)
        block_penalty = torch.stack([penalty[diagonal, diagonal], penalty[:, k]])
        blocks_to_theta, _ = _per_class_blocks(design32[:, :k], q, w32, block_penalty, process_group)

        factors_in = functools.cache(lambda dtype: (u.to(dtype), scale.to(dtype), v.to(dtype)))

        def to_theta(phi: Tensor) -> Tensor:
            u, scale, v = factors_in(phi.dtype)
            theta = u @ (scale * phi[:, : k + 1]) @ v.T
            diag_and_bias = blocks_to_theta(phi[:, k + 1 :].T)
            return theta + torch.cat([torch.diag(diag_and_bias[0]), diag_and_bias[1].unsqueeze(1)], dim=1)

        def from_theta(theta: Tensor) -> Tensor:  # all in the Kronecker part
            return torch.cat([(u.T @ theta @ v) / scale, theta.new_zeros(k, 2)], dim=1)

        return to_theta, from_theta


class _VectorAboutIdentity(VectorDesign):
    """SVS's map ``s = (1 + w) * x + b``, ``theta = [w_1 .. w_K, b_1 .. b_K]``: vector scaling
    about the identity, where its penalty is centred."""

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        return super().scores(x, theta) + x


#: Log-odds beyond this many scales from the centre are saturated by any quadratic map (QuadraticScaling).
_SATURATED = 1e6
#: The lower quantiles of the spreads that give the log-odds' scale, tried in turn (_centre_and_scale).
_SPREAD_TAILS = (0.25, 0.1, 0.01, 0.001)


def _centre_and_scale(llr: Tensor, process_group: ProcessGroup | None) -> tuple[float, float]:
    """A centre and scale of the log-odds ``llr: (N,)`` that one row cannot dominate: the median and
    the spread between the quartiles, or where they coincide (most rows at one value: clipped
    scores) between the 10th and 90th, 1st and 99th, 0.1th and 99.9th percentiles, each in units of
    a normal distribution's standard deviation, and past those the median distance from the median
    of the rows off it; each shard's averaged over a group's by its rows (scale 0: all rows at one
    value). (The mean and standard deviation: one row of log-odds -1e20, a class masked by a large
    negative number, made every other row's standardised value the same, and the fit fell back to
    the intercept, reported converged at log-loss 0.693 where 0.279 is reached.)"""
    ordered = llr.sort().values
    n = ordered.numel()
    levels = [0.5, *(p for tail in _SPREAD_TAILS for p in (tail, 1 - tail))]
    quantiles = ordered[[round(p * (n - 1)) for p in levels]] * n if n else llr.new_zeros(len(levels))
    sums = all_reduce_(torch.cat([quantiles, llr.new_tensor([float(n)])]), process_group)
    m, *pairs = (sums[:-1] / sums[-1]).tolist()
    tied = 1e-12 * max(1.0, abs(m))
    for tail, low, high in zip(_SPREAD_TAILS, pairs[::2], pairs[1::2]):
        if high - low > tied:
            return m, (high - low) / (2 * statistics.NormalDist().inv_cdf(1 - tail))
    off = (llr - m).abs()
    off = off[off > tied]
    local = llr.new_tensor([float(off.median()) * off.numel() if off.numel() else 0.0, float(off.numel())])
    total, count = all_reduce_(local, process_group).tolist()
    return m, (total / count / statistics.NormalDist().inv_cdf(0.75) if count else 0.0)


class QuadraticScaling(Calibrator):
    """Quadratic scaling for K = 2: ``P(class 1) = sigmoid(a + b * llr + c * llr^2)``.

    ``llr = logits[:, 1] - logits[:, 0]`` are the log-odds of the scores. Platt scaling plus a
    quadratic term, so the map need not be monotone; it is the binary calibrator Berta et al.
    (2025) recommend (logistic regression on ``[1, llr, llr^2]``, unpenalised). The log-loss fit is
    Newton's method with the exact 3 x 3 Hessian. Other losses (not convex here) use the generic
    L-BFGS driver, started from the better of the identity and the log-loss fit. Log-odds more
    than a million interquartile ranges from the median (a class masked by a large negative
    number) are saturated by any map: the map is fitted to the other rows, and where its
    quadratic term contradicts those rows' labels, the map without it (Platt's) is the fit if its
    loss over all rows is lower.

    Example:
        >>> import torch
        >>> from torchcal import QuadraticScaling
        >>> gen = torch.Generator().manual_seed(0)
        >>> llr = 3 * torch.randn(4000, generator=gen)
        >>> labels = torch.bernoulli(torch.sigmoid(llr / 3 + 0.5), generator=gen).long()
        >>> qs = QuadraticScaling().fit(torch.stack([torch.zeros_like(llr), llr], 1), labels)
        >>> a, b, c = qs.coefficients.tolist()  # true map: a = 0.5, b = 1/3, c = 0
        >>> abs(a - 0.5) < 0.15 and abs(b - 1 / 3) < 0.05 and abs(c) < 0.02
        True
    """

    supported_num_classes = 2
    coefficients: Tensor  # registered by Calibrator._materialize

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        return True  # (an unpenalised intercept: the missing class's probability falls without bound)

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"coefficients": torch.tensor([0.0, 1.0, 0.0])}

    def _features(self, logits: Tensor) -> Tensor:
        # float64 whatever the input: the map's terms cancel (b llr against c llr^2 at log-odds
        # offset by 1e3), which cost float32 input two digits of its probabilities, and the square
        # of float32 log-odds above 1.8e19 overflowed
        llr = logits[:, 1].to(torch.float64) - logits[:, 0].to(torch.float64)
        return torch.stack([llr, llr.square()], dim=1)

    def _scores(self, features: Tensor) -> Tensor:
        a, b, c = self.coefficients.to(features.dtype).unbind()
        llr = features[:, 0]
        score = a + b * llr + c * features[:, 1]  # (the second column as given: a fit without it passes zeros)
        # where b llr and c llr^2 overflow to -inf and +inf (log-odds near float64's lowest value, a
        # class masked at finfo.min: NaN), the same map in Horner's form, which does not
        score = torch.where(score.isnan(), a + llr * (b + c * llr), score)
        return torch.stack([torch.zeros_like(llr), score], dim=1)

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        # On the standardised log-odds u = (llr - m) / s, the coefficients converted there and
        # back: [1, llr, llr^2] of log-odds of 1e3, or offset by 1e3, are nearly collinear (a 3 x 3
        # Hessian of condition 1e13), and the identity saturates every row there: Newton stopped
        # 5 % above the optimum, reported converged, and L-BFGS on the Brier score above it too.
        # From all-zero coefficients in u (the prior), unless warm-started.
        llr = features[:, 0]
        m, s = _centre_and_scale(llr, process_group)
        if not s > 1e-12 * max(1.0, abs(m)):  # constant log-odds (s is their round-off): only a fits
            u, s = torch.zeros_like(llr), 1.0
        else:
            u = ((llr - m) / s).clamp(-1e300, 1e300)  # (finite: a + u (b + c u) is then never NaN)
        a, b, c = self.coefficients.detach().tolist()
        start = [0.0, 0.0, 0.0] if self._at_identity() else [a + b * m + c * m * m, s * (b + 2 * c * m), c * s * s]
        # Rows beyond _SATURATED scales (a class masked at -1e30) leave the fit: any map that does
        # not vanish saturates them, to loss 0 where its sign there agrees with their labels. With
        # them in, Newton's steps along u^2 ~ 1e60 went nowhere. Where the sign disagrees (a
        # quadratic term opening towards them), the map without it (c = 0) is the other candidate;
        # the one of lower loss over all rows is kept.
        saturated = u.abs() > _SATURATED
        kept = ~saturated
        counts = all_reduce_(torch.stack([saturated.sum(), kept.sum()]).to(torch.float64), process_group).tolist()
        split = counts[0] > 0 and counts[1] > 0
        candidates = []
        try:
            for quadratic in (True, False) if split else (True,):
                with torch.no_grad():
                    self.coefficients.copy_(self.coefficients.new_tensor(start if quadratic else [*start[:2], 0.0]))
                x, y = (u[kept], labels[kept]) if split else (u, labels)
                standardised = torch.stack([x, x.square() if quadratic else torch.zeros_like(x)], dim=1)
                if loss == "log":
                    record = self._fit_log_loss(standardised, y, weights, max_iter, process_group)
                else:
                    record = self._fit_nonconvex(standardised, y, weights, loss, max_iter, process_group)
                if not split:
                    return record
                total = self._loss_in_units(u, labels, weights, loss, process_group)
                candidates.append((total, dataclasses.replace(record, loss=total), self.coefficients.detach().clone()))
                if quadratic and total <= record.loss * counts[1] / sum(counts) * (1 + 1e-12):
                    break  # (the saturated rows cost nothing: this is the fit)
            total, record, coefficients = min(candidates, key=lambda candidate: candidate[0])
            with torch.no_grad():
                self.coefficients.copy_(coefficients)
            if not math.isfinite(total):
                record = dataclasses.replace(record, converged=False, message=(
                    f"no quadratic map gives a finite log-loss: {int(counts[0])} calibration rows have log-odds beyond "
                    f"{_SATURATED:g} scales (masked scores?) on the side where every fitted map contradicts their labels"))
            return record
        finally:
            a_u, b_u, c_u = self.coefficients.detach().tolist()
            c = c_u / (s * s)
            b = b_u / s - 2 * c * m
            with torch.no_grad():
                self.coefficients.copy_(self.coefficients.new_tensor([a_u - b * m - c * m * m, b, c]))

    def _loss_in_units(self, u: Tensor, labels: Tensor, weights: Tensor | None, loss: str, process_group: ProcessGroup | None) -> float:
        """The (weighted) mean ``loss`` over all rows of the map on the standardised log-odds ``u`` (N,)."""
        a, b, c = self.coefficients.detach().to(u.dtype).unbind()
        score = a + u * (b + c * u)  # (+-inf where u^2 overflows: log-softmax's NaN there avoided)
        log_q = -torch.nn.functional.softplus(torch.stack([score, -score], dim=1))
        w = sample_weights(labels, weights, process_group)
        terms = torch.where(w > 0, w * PER_SAMPLE_SCORES[loss](log_q, labels), 0.0)
        return float(all_reduce_(terms.sum(), process_group))

    def _fit_log_loss(self, features, labels, weights, max_iter, process_group=None, tol_grad=None, tol_decrease=None) -> FitRecord:
        """Newton's method on the (standardised) ``features`` from the current coefficients."""
        theta, record = fit_linear_newton(BinaryLogisticDesign(), features, labels, weights, self.coefficients.detach(),
                                          max_iter=min(max_iter, 100), process_group=process_group)

        def keep_point() -> None:
            with torch.no_grad():
                self.coefficients.copy_(theta)

        return finish_newton(record, keep_point, lambda cap: Calibrator._fit(self, features, labels, weights, "log", cap, process_group),
                             max_iter, type(self).__name__)
