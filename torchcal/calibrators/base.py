"""The contract every calibrator follows.

A calibrator is an ``nn.Module`` mapping scores ``logits: (N, K)`` — logits in the wide sense, i.e.
any unnormalised log-posteriors, so ``log(probs)`` works too (clamped, if a probability is
exactly 0: -inf is refused) — to calibrated log-posteriors (``logsumexp == 0`` per row).

- ``fit(logits, labels, ...)`` fits on held-out data and returns ``self``; what happened is in
  ``fit_record_`` (a :class:`torchcal.fit.FitRecord`).
- ``forward(logits)`` is pure and, for the parametric maps, differentiable. The step maps
  (histogram binning, isotonic regression, Venn-Abers) pass no gradient: their output is detached
  from the input's graph, as ``argmax``'s is. It computes in the input's dtype, or float32 for
  half precision, on the input's device (move the module with ``.to(device)``).
- Fitted parameters are ``nn.Parameter``s or buffers, stored in float64; ``state_dict()`` round
  trips into a fresh, unfitted instance.

Parametric subclasses define the identity-map parameters (:meth:`_identity`), an optional feature
map applied once to the data (:meth:`_features`), the unnormalised calibrated scores
(:meth:`_scores`) and an optional penalty (:meth:`_penalty`); the base class fits them by
:func:`torchcal.fit.minimize`. Subclasses with a faster dedicated solver override :meth:`_fit`.

Data-parallel fits (``fit(..., process_group=...)``): every process passes its own shard; class
counts, losses, gradients and Hessians are summed over the group (:mod:`torchcal.distributed`),
so every process ends with the parameters of one fit on the union of the shards. A calibrator that
cross-validates its regularisation (``reg_lambda=None``: the structured scalings' default, matrix
scaling and Dirichlet calibration with a regulariser) makes its folds per process, each fold the
union of the processes' folds: every process selects the same strength, but it depends on the
sharding and can differ from that of a one-process fit on the same data, and so can the
parameters. A fixed ``reg_lambda`` makes the fit independent of the sharding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch._C._functorch import TransformType

from torchcal._validation import (
    as_tensor,
    check_count,
    check_logits,
    check_logits_and_labels,
    check_priors,
    compute_dtype,
    stable_repr,
    stacklevel_outside_package,
)
from torchcal.distributed import ProcessGroup, agree_across, all_reduce_, validate_together, world_size
from torchcal.fit import ConvergenceWarning, FitRecord, minimize, newton, warn_unconverged
from torchcal.functional.scoring import PER_SAMPLE_SCORES, class_weights_from_counts

__all__ = ["Calibrator"]

#: A converged fit whose mean loss is below this has (all but) separated the calibration data: each
#: sample it misclassified would add at least log(2) / N to the log-loss and 1 / (2 N) to the Brier
#: score, so below 1e-6 that is none up to 500,000 samples, and the parameters grow until the
#: solver's tolerance stops them (both scores fall towards 0 as the map's scale grows).
_SEPARATED_LOSS = 1e-6


# The scores' dtypes as numbers that the processes of a data-parallel fit compare (temperature
# scaling's passes, and their stopping rules, run in the scores' own precision).
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


class Calibrator(nn.Module):
    """Base class of all calibrators. Subclasses implement the hooks described in the module docs."""

    #: class counts the calibrator supports; ``None`` means any K >= 2.
    supported_num_classes: int | None = None
    #: fitted tensors stored as buffers (not optimised) rather than parameters.
    _buffer_names: tuple[str, ...] = ()
    #: fitted tensors whose last sizes depend on the calibration data or on options rather than on
    #: the number of classes alone: name -> how many trailing sizes (not checked when a state_dict
    #: is loaded; every other size is).
    _free_last_dims: ClassVar[dict[str, int]] = {}
    #: whether the fit sees a float64 copy of the data (``False``: the caller's tensor itself, in
    #: its own precision or float32 for half precision, for solvers that accumulate in float64).
    _fit_in_float64: bool = True
    #: whether the fit is a sum over samples, and so can run data-parallel.
    _supports_process_group: bool = True

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        """Whether the classes ``missing``, without calibration samples, leave the fit (with the
        strengths it was fitted with, on its ``features: (N, F)``) without a finite optimum: a
        free per-class bias, unpenalised, drives those classes' scores down without bound."""
        return False

    def _regularisation_advice(self) -> str:
        """What the warning of a fit without a finite optimum advises."""
        return ("Use a regularised calibrator (reg='odir' for MatrixScaling or DirichletCalibration, with reg_lambda and "
                "reg_mu > 0; StructuredVectorScaling; TemperatureScaling).")

    def _shifts_class_priors(self) -> bool:
        """Whether the map has a free term per class (a bias) that lets a fit weighted for deployment
        ``priors`` move its posteriors to those priors; temperature scaling has none."""
        return True

    def _penalised_everywhere(self) -> bool:
        """Whether the fit's penalty (with the strengths it was fitted with) curves every direction
        of the parameters, so the fit has a finite optimum even on separable data."""
        return False

    #: where ``.to()`` last put the module, tensors or not (see ``_apply``); a class default, which
    #: calibrators pickled before it existed also read
    _device = torch.device("cpu")

    def __init__(self) -> None:
        super().__init__()
        self.num_classes: int = 0
        self.fit_record_: FitRecord | None = None
        # public in recent torch releases; older ones (the package allows torch>=2.1) have the private form
        register = getattr(self, "register_state_dict_post_hook", None) or self._register_state_dict_hook
        register(_drop_extra_state_in_legacy_onnx_export)

    # ----------------------------------------------------------------- hooks for subclasses
    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        """Initial (identity-map) values of the fitted tensors, float64."""
        raise NotImplementedError

    def _features(self, logits: Tensor) -> Tensor:
        """Feature map applied to the scores before :meth:`_scores` (computed once per fit)."""
        return logits

    def _scores(self, features: Tensor) -> Tensor:
        """Unnormalised calibrated log-posteriors from features (N, K)."""
        raise NotImplementedError

    def _penalty(self) -> Tensor | float:
        """Regulariser added to the mean loss."""
        return 0.0

    # ----------------------------------------------------------------------- public API
    @property
    def is_fitted(self) -> bool:
        return self.num_classes > 0

    def fit(
        self,
        logits: Tensor,
        labels: Tensor,
        *,
        loss: str = "log",
        priors: Tensor | None = None,
        max_iter: int = 1000,
        warm_start: bool = False,
        process_group: ProcessGroup | None = None,
    ) -> Calibrator:
        """Fit on held-out ``logits: (N, K)`` and ``labels: (N,)``; returns ``self``.

        Args:
            loss: the expected proper scoring rule minimised: ``"log"`` (cross-entropy) or
                ``"brier"``.
            priors: optional (K,) deployment priors; each sample is weighted by
                ``priors[y] / frequency[y]`` (Ferrer & Ramos App. A). (Venn-Abers predictors
                fit unweighted, then move their posteriors to the priors by Bayes' rule.)
            max_iter: iteration cap of the optimiser.
            warm_start: start from the current parameters instead of the identity map (the log-loss
                fit's; a loss that is not convex, Brier, restarts from the better of the identity
                map and the log-loss fit, as ``fit_record_.message`` says).
            process_group: fit data-parallel over a ``torch.distributed`` group (e.g.
                ``torch.distributed.group.WORLD``): every process calls ``fit`` with its own shard
                of the calibration data (at least one sample each), and all end with the
                parameters of one fit on the union of the shards. Only sums over samples travel,
                never the logits. A cross-validated regularisation strength is selected on
                per-process folds, so it can differ from a one-process fit's (see the module docs).
        """
        if process_group is not None and not self._supports_process_group:
            raise NotImplementedError(f"{type(self).__name__} needs all the data in one process; fit it without process_group.")

        def check() -> tuple[Tensor, Tensor]:
            checked = check_logits_and_labels(logits, labels)
            k = checked[0].shape[1]
            if self.supported_num_classes is not None and k != self.supported_num_classes:
                raise ValueError(
                    f"{type(self).__name__} is for K = {self.supported_num_classes} classes, got K = "
                    f"{k}; use a multiclass calibrator such as AffineCalibration."
                )
            if loss not in PER_SAMPLE_SCORES:
                raise ValueError(f"loss must be one of {sorted(PER_SAMPLE_SCORES)}, got {loss!r}.")
            check_count(max_iter, "max_iter")
            if priors is not None:
                check_priors(priors, k)
            return checked

        # (every check on every process at once, then the shapes and dtypes the collectives need)
        logits, labels = validate_together(check, process_group, logits)
        num_classes = logits.shape[1]
        agree_across({"the number of classes K": num_classes, "the scores' dtype": _DTYPE_CODES.get(logits.dtype, 0),
                      "max_iter": max_iter, "loss": sorted(PER_SAMPLE_SCORES).index(loss), "warm_start": float(warm_start),
                      "priors": _digest(priors), "the calibrator (its class, options and, warm-started, its fitted state)":
                      self._setup_digest(warm_start) if process_group is not None else 0.0}, process_group, logits.device)
        counts = all_reduce_(torch.bincount(labels, minlength=num_classes), process_group)
        missing = (counts == 0).nonzero().flatten().tolist()
        if missing:
            warnings.warn(f"classes {missing} have no sample in the calibration data; the fit cannot learn anything "
                          "about their posteriors.", UserWarning, stacklevel=stacklevel_outside_package())
        # Fitting needs autograd even under Lightning's inference_mode; the clone makes the
        # data ordinary tensors and guarantees the caller's tensors are never touched.
        with self._restored_on_error(), torch.inference_mode(False), torch.enable_grad(), torch.autocast(logits.device.type, enabled=False):
            if self._fit_in_float64:
                logits = logits.detach().to(torch.float64, copy=True)
            else:
                logits = logits.detach().to(compute_dtype(logits.dtype))
            labels = labels.detach().clone()
            # A fit fits every parameter, also those the caller froze (attach, load_calibrator):
            # a warm-started refit of a frozen head left them out. They are frozen again after
            # (named before _materialize, whose fresh parameters all require grad).
            frozen = {name for name, p in self.named_parameters() if not p.requires_grad}
            if not (warm_start and self.num_classes == num_classes):
                self._materialize(num_classes, logits.device)
            self.to(device=logits.device, dtype=torch.float64)
            # (priors that carry an autograd graph would carry it into every fit's own graph)
            weights = None if priors is None else class_weights_from_counts(counts, as_tensor(priors, "priors").detach())
            self.num_classes = num_classes
            features = self._features(logits)
            self.requires_grad_(True)
            try:
                self.fit_record_ = self._fit(features, labels, weights, loss, max_iter, process_group=process_group)
            finally:
                for name, p in self.named_parameters():
                    p.requires_grad_(name not in frozen)
        record = self.fit_record_
        # judged after the fit, with the penalty strengths it used (cross-validated ones included);
        # samples that priors weigh zero count for nothing, so their classes are missing too
        unweighted = missing if weights is None else sorted(set(missing) | set((weights == 0).nonzero().flatten().tolist()))
        if unweighted and self._unbounded_without_samples(features if weights is None else features[weights[labels] > 0],
                                                          unweighted, process_group):
            # (the solver stops where the gradient of those scores falls below its tolerance: K = 4,
            # 800 samples without class 3, its probability on its test samples about 1e-9 after
            # MatrixScaling or DirichletCalibration, 1e-16 after VectorScaling)
            why = "have no calibration sample" if unweighted == missing else "have no calibration sample or prior 0"
            warnings.warn(
                f"{type(self).__name__} leaves the scores of classes {unweighted}, which {why}, unpenalised: the fit "
                f"drives them towards 0 (no finite optimum). {self._regularisation_advice()}",
                ConvergenceWarning,
                stacklevel=stacklevel_outside_package(),
            )
            record = self.fit_record_ = dataclasses.replace(
                record, converged=False, message=f"no finite optimum: classes {unweighted} {why} ({record.message})")
        if _STILL_FALLING in record.message:  # (said of the final fit only: beta calibration refits)
            warn_unconverged(record, type(self).__name__)
        if record.converged and record.loss < _SEPARATED_LOSS and not self._penalised_everywhere():
            warnings.warn(
                f"the calibration data are perfectly separated by the fitted {type(self).__name__} (mean {loss} loss "
                f"{record.loss:.1e}): the optimum is at infinity, and the parameters are as large as the solver's "
                f"tolerance let them grow. A penalty on every parameter (reg='l2' with reg_lambda > 0, structured "
                "scaling) or more calibration data give a defined fit.",
                ConvergenceWarning,
                stacklevel=stacklevel_outside_package(),
            )
            self.fit_record_ = dataclasses.replace(record, converged=False, message=f"separable data ({record.message})")
        return self

    @contextlib.contextmanager
    def _restored_on_error(self) -> Iterator[None]:
        """Undo everything a fit changed if it raises (or is interrupted): attributes, the sets of
        parameters and buffers, and their values, dtypes and devices, so a failed fit never leaves a
        module that looks fitted."""
        attributes = self.__dict__.copy()
        members = {name: dict(self.__dict__[name]) for name in ("_parameters", "_buffers")}
        snapshots = [(t, t.data.clone()) for t in self._tensors()]
        try:
            yield
        except BaseException:
            for tensor, value in snapshots:
                tensor.data = value
            self.__dict__.clear()
            self.__dict__.update(attributes)
            for name, contents in members.items():
                self.__dict__[name].clear()
                self.__dict__[name].update(contents)
            raise

    def forward(self, logits: Tensor) -> Tensor:
        """Calibrated log-posteriors (N, K) for ``logits: (N, K)`` (a tensor, or a NumPy array as
        ``fit`` takes)."""
        logits = self._check_input(logits)
        dtype = compute_dtype(logits.dtype)
        # (a head under Lightning's bf16-mixed steps; the meta device has no autocast)
        no_autocast = contextlib.nullcontext() if logits.is_meta else torch.autocast(logits.device.type, enabled=False)
        with no_autocast:
            scores = self._scores(self._features(logits.to(dtype)))
        # A scaled score beyond the dtype's range (a class masked at finfo.min, times 1 / T > 1) is
        # its largest finite value: a probability of 0 whose log stays finite, as every score is.
        # (In place: the scores are the maps' own output, which no backward pass reads.) Maps that
        # compute in float64 (the non-parametric ones, quadratic scaling) normalise there, and a
        # log-posterior below the output dtype's range is its lowest too (it was -inf in float32).
        # (vmap has no batching rule for clamp_, and warns of its slow fallback)
        finfo = torch.finfo(scores.dtype)
        scores = scores.clamp(finfo.min, finfo.max) if _under_vmap() else scores.clamp_(finfo.min, finfo.max)
        return torch.log_softmax(scores, dim=1).clamp_min(torch.finfo(dtype).min).to(dtype)

    def predict_proba(self, logits: Tensor) -> Tensor:
        """Calibrated posteriors (N, K): ``forward(logits).exp()``."""
        return self.forward(logits).exp()

    # ------------------------------------------------------------------------ machinery
    def _fit(
        self,
        features: Tensor,
        labels: Tensor,
        weights: Tensor | None,
        loss: str,
        max_iter: int,
        process_group: ProcessGroup | None = None,
    ) -> FitRecord:
        """Generic fit: minimise the (weighted) mean score plus penalty by L-BFGS.

        ``features: (N, K)``, ``labels: (N,)``, ``weights``: optional (K,) per-class weights.
        """
        return self._fit_lbfgs(features, labels, weights, loss, max_iter, process_group)

    def _fit_lbfgs(
        self,
        features: Tensor,
        labels: Tensor,
        weights: Tensor | None,
        loss: str,
        max_iter: int,
        process_group: ProcessGroup | None = None,
        tol_change: float | None = None,
    ) -> FitRecord:
        """:meth:`_fit`'s L-BFGS, until the loss or the step changes by less than ``tol_change``:
        given, a cross-validation's selection or tie fit, for which that stop is the accuracy it
        needs (``minimize(loose=True)``: no convergence warning); else the final fit's 1e-12."""
        params = [p for p in self.parameters() if p.requires_grad]
        sample_w = sample_weights(labels, weights, process_group)
        penalty_share = 1.0 / world_size(process_group)

        def objective() -> Tensor:
            return self._data_term(features, labels, sample_w, loss) + penalty_share * self._penalty()

        size = sum(p.numel() for p in params)
        finish = tol_change is None and size <= _NEWTON_FINISH_PARAMETERS
        if finish:
            # Newton from the start where the Hessian there is positive semi-definite: vector
            # scaling's prior-weighted Brier fit on the CIFAR-10 ResNet-110 validation logits took
            # L-BFGS 400-980 iterations from the log-loss fit (1-3 s), Newton 6 (0.2 s), to the same
            # loss; elsewhere L-BFGS first, and Newton from where it stopped
            with torch.no_grad():
                start = FitRecord(0, 1, float(all_reduce_(objective().reshape(1), process_group)[0]), math.nan, False, "")
            first = _newton_finish(objective, params, start, max_iter, process_group)
            if first.converged:
                return dataclasses.replace(first, message=f"Newton on the exact {size} x {size} Hessian from the start: "
                                                          f"gradient below tolerance (gradient {first.grad_max:.2e})")
        record = minimize(objective, params, max_iter=lbfgs_share(max_iter) if finish else max_iter,
                          tol_change=1e-12 if tol_change is None else tol_change, loose=tol_change is not None,
                          process_group=process_group, warn=not finish)
        return finish_lbfgs_with_newton(objective, params, record, max_iter, process_group) if finish else record

    def _data_term(self, features: Tensor, labels: Tensor, sample_w: Tensor, loss: str) -> Tensor:
        """This process's weighted sum of the per-sample ``loss`` (float64 scalar)."""
        return weighted_loss_sum(self._scores(features), labels, sample_w, loss)

    def _fit_log_loss(self, features, labels, weights, max_iter, process_group=None, tol_grad=None, tol_decrease=None) -> FitRecord:
        """The log-loss fit :meth:`_fit_nonconvex` starts from (a subclass with a penalised or
        constrained fit overrides it; one with a Newton solver stops it at ``tol_grad`` and
        ``tol_decrease`` where given, the generic fit ignores them)."""
        return self._fit(features, labels, weights, "log", max_iter, process_group)

    def _fit_nonconvex(self, features, labels, weights, loss, max_iter, process_group=None, tol_grad: float | None = None,
                       tol_decrease: float | None = None, tol_change: float | None = None) -> FitRecord:
        """Fit a loss under which the map's objective is not convex (the Brier score): L-BFGS finds a
        local optimum, started from the better (for this objective) of the identity map and the
        log-loss fit, and ``fit_record_.message`` says so. From the identity alone, a map that can
        sharpen its scores (per-class scales, a quadratic term) can end on a plateau where every
        sample gets one class with certainty and the gradient underflows. Only the parameters being
        fitted (``requires_grad``) are reset to the identity; frozen ones keep their values.
        ``tol_grad`` and ``tol_decrease`` are the log-loss fit's, ``tol_change`` L-BFGS's (the
        cross-validation's selection fits stop earlier than the final one)."""

        sample_w = sample_weights(labels, weights, process_group)

        def objective() -> float:
            with torch.no_grad():
                data = self._data_term(features, labels, sample_w, loss)
                return float(all_reduce_(data.reshape(1), process_group)) + float(self._penalty())

        self._fit_log_loss(features, labels, weights, max_iter, process_group, tol_grad, tol_decrease)
        from_log_loss = objective()
        identity = self._identity(self.num_classes)
        fitted = {name: p for name, p in self.named_parameters() if p.requires_grad}
        log_fit = {name: p.detach().clone() for name, p in fitted.items()}
        with torch.no_grad():
            for name, p in fitted.items():
                p.copy_(identity[name])
            if not objective() < from_log_loss:
                for name, p in fitted.items():
                    p.copy_(log_fit[name])
                start = "the log-loss fit"
            else:
                start = "the identity map"
        record = self._fit_lbfgs(features, labels, weights, loss, max_iter, process_group, tol_change)
        # L-BFGS's absolute gradient test, scaled: a move by the parameters' own magnitude changes
        # the loss by about gradient x magnitude, which must be small beside the loss. (Beta
        # calibration's prior-weighted Brier fit on FVCAUS stopped "converged" at a gradient of
        # 6.5e-8, parameters near 1e3 and a loss of 9.75e-4, 1.2 % above the loss at parameters ten
        # times larger; the loss falls towards its infimum as they grow.) Not for the selection
        # fits, loose by design, nor for a loss near 0, which fit() names as separated data; fit()
        # warns.
        magnitude = max(1.0, max(float(p.detach().abs().max()) for p in fitted.values()))
        if (record.converged and tol_change is None and record.loss >= _SEPARATED_LOSS
                and record.grad_max * magnitude > _RELATIVE_STATIONARITY * record.loss):
            record = dataclasses.replace(record, converged=False, message=(
                f"{record.message}; but not relative to the loss ({record.loss:.3g}) at parameters of magnitude up to "
                f"{magnitude:.3g}: {_STILL_FALLING}"))
        found = "a local optimum" if record.converged else "a search for a local optimum"
        note = f"; the {loss} objective of {type(self).__name__} is not convex: {found}, started from {start}"
        return dataclasses.replace(record, message=record.message + note)

    def _setup_digest(self, warm_start: bool) -> float:
        """A number that differs between calibrators of other classes or constructor options, or,
        for a ``warm_start`` fit, other fitted states: what every process of a data-parallel fit
        must share (processes with different heads to start from had each kept their own, reported
        as one converged fit; other options aborted the group or left it waiting)."""
        options = [type(self).__qualname__] + [
            f"{name}={stable_repr(getattr(self, name, None))}" for name in inspect.signature(type(self).__init__).parameters if name != "self"]
        if warm_start:
            options += [f"{name}={stable_repr(value)}" for name, value in self.state_dict().items()]
        return float(int.from_bytes(hashlib.sha256(";".join(options).encode()).digest()[:6], "big"))  # (48 bits: exact in float64)

    def _at_identity(self) -> bool:
        """Whether the tensors being fitted hold the identity map (a fit that is not warm-started);
        a parameter held fixed (``requires_grad`` off, as Beta calibration's refits hold a
        coefficient at 0) does not count."""
        return all(torch.equal(getattr(self, name).cpu(), value.to(torch.float64)) for name, value in self._identity(self.num_classes).items()
                   if not (name in self._parameters and not getattr(self, name).requires_grad))

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Moves the fitted tensors with the module but keeps them in float64: ``.half()`` or
        ``.to(torch.bfloat16)`` (which Lightning's ``precision="16-true"`` / ``"bf16-true"`` apply to
        every submodule, a :class:`~torchcal.heads.CalibratedModel` head included) would round a
        temperature to three digits and a Venn-Abers table's probabilities by up to 0.06. The map
        computes in its input's dtype (float32 for half precision) whatever its tensors' is.

        It also records the device ``fn`` moves to, which a probe tensor shows also where there is
        no tensor to move: a state loaded into an unfitted calibrator that was moved (inside a
        head already on the GPU, say) goes there, as ``nn.Linear``'s parameters stay on theirs;
        it had gone to the CPU."""
        where = next((t.device for t in self._tensors()), self._device)
        try:
            self._device = fn(torch.empty(0, device=where)).device
        except (RuntimeError, AssertionError):  # (a device this process lacks: a module pickled on a GPU)
            self._device = fn(torch.empty(0)).device
        return super()._apply(moving_only(fn), recurse)

    def _materialize(self, num_classes: int, device: torch.device | None = None) -> None:
        """(Re)create the fitted tensors at the identity map for ``num_classes`` classes. A parameter
        that is there already with that shape is kept, set in place (as ``nn.Linear``'s reset is):
        an optimizer built before a refit or a load holds it, and a frozen one stays frozen."""
        for name, value in self._identity(num_classes).items():
            value = value.to(device=device, dtype=torch.float64)
            old = self._parameters.get(name)
            if name in self._buffer_names:
                self.register_buffer(name, value)
            elif old is not None and old.shape == value.shape and not old.is_inference():
                old.data = value  # (an inference tensor, moved by Lightning under inference mode, stays one)
            else:
                self._parameters[name] = nn.Parameter(value)

    def _check_fitted(self) -> None:
        """Raise a clear error before fitted state is read (a property's AttributeError would be
        reported by ``nn.Module`` as the property missing)."""
        if not self.is_fitted:
            raise RuntimeError(
                f"this {type(self).__name__} is not fitted yet: call .fit(logits, labels) on held-out "
                f"data, or load a fitted state_dict."
            )

    def _check_input(self, logits: Tensor) -> Tensor:
        """``logits`` validated for ``forward``, as a tensor."""
        self._check_fitted()
        # (traced, or shapes only: meta and fake tensors have no values to check)
        if isinstance(logits, Tensor) and logits.is_meta and not all(t.is_meta for t in self._tensors()):
            raise ValueError(f"logits on the meta device, but the {type(self).__name__} is not: move it with .to('meta') "
                             f"for a shapes-only run.")
        if not values_readable(logits):
            if logits.ndim != 2 or logits.shape[1] != self.num_classes:
                raise ValueError(f"expected logits of shape (N, {self.num_classes}), got {tuple(logits.shape)}")
            return logits
        logits = as_tensor(logits, "logits")
        if logits.ndim == 2 and logits.shape[0] == 0 and logits.shape[1] == self.num_classes and logits.is_floating_point():
            return logits  # an empty batch gives an empty batch, as in a compiled or exported head (fit needs samples)
        return check_logits(logits, num_classes=self.num_classes, classes_of=f"{type(self).__name__} was fitted on")

    def get_extra_state(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "class": type(self).__name__}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._set_stored_options(state)
        self.num_classes = int(state["num_classes"])

    def _set_stored_options(self, state: dict[str, Any]) -> None:
        """Set the constructor options a stored state records (by ``get_extra_state``): those that
        shape the fitted tensors (Venn-Abers' multiclass scheme, histogram bins) are set before the
        tensors are shaped for loading, so a state loads into an instance built with defaults."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Fitted tensors' shapes depend on K (and on some options): give them the stored shapes before loading.
        extra = state_dict.get(prefix + "_extra_state")
        stored_class = extra.get("class", type(self).__name__) if isinstance(extra, dict) else type(self).__name__
        if stored_class != type(self).__name__:  # (same tensor names, another map: Dirichlet and matrix scaling)
            where = f"at {prefix[:-1]!r} " if prefix else ""
            raise ValueError(f"the state_dict {where}holds a fitted {stored_class}; load it into {stored_class}(), "
                             f"not into {type(self).__name__}().")
        if extra is not None and int(extra["num_classes"]) > 0:
            k = int(extra["num_classes"])
            if self.supported_num_classes is not None and k != self.supported_num_classes:
                raise ValueError(f"the state_dict is for K = {k} classes; {type(self).__name__} is for K = {self.supported_num_classes}.")
            self._set_stored_options(extra)
            device = next((t.device for t in self._tensors()), self._device)
            self._materialize(k, device)  # (the parameters there already stay: the load copies into them)
            for name, tensor in list(self._parameters.items()) + list(self._buffers.items()):
                stored = state_dict.get(prefix + name)
                if tensor is not None and isinstance(stored, Tensor) and stored.shape != tensor.shape:
                    self._check_stored_shape(name, prefix + name, stored.shape, tensor.shape, int(extra["num_classes"]))
                    # (float64 as every fitted tensor, whatever the stored dtype: a dtype cast no longer changes it)
                    dtype = torch.float64 if stored.is_floating_point() else stored.dtype
                    getattr(self, name).data = torch.empty_like(stored, device=tensor.device, dtype=dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _check_stored_shape(self, name: str, key: str, stored: torch.Size, expected: torch.Size, num_classes: int) -> None:
        """Refuse a stored fitted tensor whose shape does not fit the stored number of classes: the
        identity map's shape ``expected``, but for the sizes named in :attr:`_free_last_dims`."""
        free = self._free_last_dims.get(name, 0)
        fixed = len(expected) - free
        if len(stored) == len(expected) and stored[:fixed] == expected[:fixed]:
            return
        shown = [str(size) for size in expected[:fixed]] + ["*"] * free
        needed = "(" + ", ".join(shown) + ("," if len(shown) == 1 else "") + ")"
        raise ValueError(
            f"state_dict entry {key!r} has shape {tuple(stored)}, but {type(self).__name__} with "
            f"num_classes = {num_classes} (the state_dict's _extra_state) needs shape {needed}"
            f"{' (* : any size)' if free else ''}. The state_dict is inconsistent: load one saved by a "
            f"fitted {type(self).__name__}, unchanged."
        )

    def _tensors(self):
        yield from (p for p in self._parameters.values() if p is not None)
        yield from (b for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}" if self.is_fitted else "not fitted"


def check_calibrator(calibrator: Any) -> Calibrator:
    """``calibrator``, if it is a torchcal calibrator; else ``TypeError`` saying what to pass."""
    if isinstance(calibrator, Calibrator):
        return calibrator
    if isinstance(calibrator, type) and issubclass(calibrator, Calibrator):
        raise TypeError(f"calibrator must be a calibrator instance, got the class {calibrator.__name__}; pass "
                        f"{calibrator.__name__}().")
    raise TypeError(f"calibrator must be a torchcal calibrator such as torchcal.TemperatureScaling(), got "
                    f"{type(calibrator).__name__}.")


def _drop_extra_state_in_legacy_onnx_export(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # The legacy (TorchScript) ONNX exporter calls .detach() on every state_dict entry, and a
    # calibrator's extra state (num_classes) is a dict; the traced graph does not need it. A hook on
    # every calibrator covers it wherever it sits (CalibratedModel, nn.Sequential, alone).
    if torch.onnx.is_in_onnx_export():
        state_dict.pop(prefix + "_extra_state", None)


def _is_fake(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a FakeTensor (shape propagation under ``FakeTensorMode``): no values."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _under_vmap() -> bool:
    """Whether a ``torch.func.vmap`` is running (alone, or in ``jacfwd``, ``hessian`` or a
    per-sample gradient): there a tensor's values cannot be read into Python. (Not asked while
    compiling, where dynamo cannot trace the question.)"""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return not torch.compiler.is_compiling() and any(interpreter.key() == TransformType.Vmap for interpreter in retrieve_all_functorch_interpreters())


def nan_rows_stay_nan(features: Tensor, scores: Tensor) -> Tensor:
    """``scores: (N, ...)`` with NaN on every row where ``features: (N, C)`` has a NaN. A step map's
    look-up sends NaN to one of its steps (a confident answer) where the input checks are left
    out (compiled, exported or vmapped heads; see :func:`values_readable`); the parametric maps
    propagate NaN by themselves."""
    unknown = features.isnan().any(1).reshape(-1, *[1] * (scores.ndim - 1))
    return scores.masked_fill(unknown, float("nan"))


def values_readable(x: Any) -> bool:
    """Whether the values of ``x`` can be checked in Python: not while compiling or exporting, not
    for meta and fake tensors (shapes only), not under ``vmap``. Where they cannot, the checks
    are left out: a row with a NaN score comes out NaN (:func:`nan_rows_stay_nan`), one with an
    infinite score as the map's limit there (a certain class, or NaN)."""
    if torch.compiler.is_compiling() or _under_vmap():
        return False
    return not (isinstance(x, Tensor) and (x.is_meta or _is_fake(x)))


def moving_only(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``nn.Module._apply``'s ``fn`` made to change devices and to widen to float64 only: a tensor
    keeps its dtype otherwise (``.double()`` and the fit's own cast still restore a float32 state
    loaded with ``assign=True``)."""

    def same_dtype(t: Tensor) -> Tensor:
        moved = fn(t)
        return moved if moved.dtype in (t.dtype, torch.float64) else t.to(moved.device)

    return same_dtype


#: A non-convex fit's gradient times its largest parameter magnitude: at most this share of its
#: loss to count as converged (:meth:`Calibrator._fit_nonconvex`). Measured on the real logits:
#: 0.074 for beta calibration's Brier fit on FVCAUS (1.2 % above a lower loss), 0.76 for unpenalised
#: Brier matrix scaling on CIFAR-10 ResNet-110 (5.8e-4 above), 1.5e-3 for vector scaling's Brier
#: fit on FVCAUS (6e-7 above: converged for any use).
_RELATIVE_STATIONARITY = 1e-2
#: What the record of a fit that :data:`_RELATIVE_STATIONARITY` stopped says.
_STILL_FALLING = "the loss may still fall as they grow"

#: Final L-BFGS fits of at most this many parameters (Platt, beta and quadratic scaling's Brier fits,
#: affine scaling's up to K = 19, vector scaling's up to 10) end with Newton's method on the exact
#: Hessian, formed by autograd (a pass per parameter, once per Newton step: one or two after
#: L-BFGS; at 32 parameters, affine scaling's Brier fit of 10,000 x 30 logits took 0.53 s
#: against 0.18 s, for a loss 1e-12 lower). L-BFGS's absolute gradient tolerance (1e-7)
#: is loose for a loss near 0: quadratic scaling's Brier fit on the FVCAUS scores (mean Brier
#: 3.5e-4) stopped 9.5e-6 (relative) above its optimum with posteriors 5e-3 off, reporting
#: converged; vector scaling's prior-weighted Brier fit on the CIFAR-10 ResNet-110 validation
#: logits met the iteration cap in one row order and stopped after 205 iterations in another,
#: its weights 3.6e-4 apart (after Newton, 2.7e-9).
_NEWTON_FINISH_PARAMETERS = 20
#: Of such a fit's cap, the iterations kept for Newton: L-BFGS met the whole cap of that vector
#: scaling fit in another row order (after priors that summed to 1 - 1e-16 were divided by their
#: sum), at a gradient of 8e-7, and Newton never ran.
_NEWTON_FINISH_STEPS = 20


def lbfgs_share(max_iter: int) -> int:
    """The part of a fit's ``max_iter`` for L-BFGS where Newton finishes it: all but
    ``_NEWTON_FINISH_STEPS`` (at most half), which :func:`finish_lbfgs_with_newton` has."""
    return max_iter - min(_NEWTON_FINISH_STEPS, max_iter // 2)


def finish_lbfgs_with_newton(objective: Callable[[], Tensor], params: Sequence[Tensor], record: FitRecord, max_iter: int,
                             process_group: ProcessGroup | None) -> FitRecord:
    """An L-BFGS fit's ``record`` (of ``minimize(warn=False)``) finished by :func:`_newton_finish`
    where its loss is finite and it left some of the cap (which counts Newton's steps too), with
    the convergence warning ``minimize`` left to this verdict."""
    if not math.isfinite(record.loss):
        return record
    if record.iterations < max_iter:
        record = _newton_finish(objective, params, record, max_iter, process_group)
    return warn_unconverged(record, "L-BFGS")


def _newton_finish(objective: Callable[[], Tensor], params: Sequence[Tensor], record: FitRecord, max_iter: int,
                   process_group: ProcessGroup | None) -> FitRecord:
    """Newton's method from the L-BFGS fit ``record`` ended at, on ``objective()`` of ``params``
    (this process's share of the loss), where the Hessian there is positive semi-definite (else
    that point is no minimum for Newton to home in on). Kept where it converges no higher; else
    the L-BFGS point and ``record``."""
    start = torch.cat([p.detach().reshape(-1) for p in params])

    def assign(theta: Tensor) -> None:
        with torch.no_grad():
            for p, part in zip(params, theta.split([p.numel() for p in params])):
                p.copy_(part.view_as(p))

    last: dict[str, Tensor] = {}  # the Hessian formed last ("hess") and where ("at"): the check's serves the first step

    def derivatives(theta: Tensor) -> tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]:
        assign(theta)
        loss = objective()
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, create_graph=True)])

        def hessian() -> Tensor:  # a pass per parameter, formed only where a step needs it
            if last and torch.equal(last["at"], theta):
                return last["hess"]
            rows = [torch.autograd.grad(g, params, retain_graph=True, allow_unused=True) for g in grad]
            hess = torch.stack([torch.cat([(h if h is not None else torch.zeros_like(p)).reshape(-1) for h, p in zip(row, params)])
                                for row in rows]).detach()
            last.update(at=theta.clone(), hess=hess)
            return hess

        # Newton's curvature-scaled convergence test reads the diagonal: that of the Hessian formed
        # last, which near the optimum hardly changes (forming it at every point would cost a pass
        # per parameter each time); before any, a unit curvature (the plain test)
        curvature = last["hess"].diagonal().clone() if last else torch.ones_like(grad)
        return loss.detach(), grad.detach(), curvature, hessian

    def value(theta: Tensor) -> Tensor:
        assign(theta)
        with torch.no_grad():
            return objective()

    hess = all_reduce_(derivatives(start)[3](), process_group)
    diagonal = hess.diagonal()
    scale = diagonal.abs().clamp_min(torch.finfo(hess.dtype).tiny).rsqrt()
    # positive semi-definite, scaled to a unit diagonal: flat directions (a shift of every bias) are
    # Newton's ridge's to resolve, a negative curvature is no minimum's
    if not bool(torch.isfinite(hess).all()):
        assign(start)
        return record
    lowest = min(float(diagonal.min()), float(torch.linalg.eigvalsh(scale.unsqueeze(1) * hess * scale).min()))
    if lowest < -1e-10:
        assign(start)
        # L-BFGS's stop on a small change there is no optimum (Brier matrix scaling on the CIFAR-10
        # ResNet-110 validation logits stopped at 0.075824, curvature -8e-9; SciPy reaches 0.075232).
        # A stop on the gradient stays: the loss is flat there (separable data's, which callers name).
        small_change = record.converged and record.message.startswith("no further decrease")
        return dataclasses.replace(record, converged=False, message=(
            f"{record.message}; but the Hessian there has a direction of negative curvature ({lowest:.2g} on its unit "
            f"diagonal): no local optimum")) if small_change else record
    # (from a minimum's neighbourhood Newton converges in a few steps, or the problem is flat there)
    theta, polished = newton(derivatives, value, start, max_iter=min(max_iter - record.iterations, 10),
                             process_group=process_group, warn=False)
    if polished.converged and polished.loss <= record.loss:
        assign(theta)
        size = start.numel()
        return FitRecord(record.iterations + polished.iterations, record.evaluations + polished.evaluations, polished.loss,
                         polished.grad_max, True,
                         f"{record.message}; then Newton on the exact {size} x {size} Hessian: {polished.message} "
                         f"(gradient {polished.grad_max:.2e})")
    assign(start)
    return record


def _digest(priors: Any) -> float:
    """-1 for no priors, else a number that differs between priors that differ (in float64): one a
    process of a data-parallel fit cannot leave out or change alone (the fit then matched no
    single-process fit and said nothing)."""
    if priors is None:
        return -1.0
    raw = as_tensor(priors, "priors").detach().to(device="cpu", dtype=torch.float64).contiguous().numpy().tobytes()
    return float(int.from_bytes(hashlib.sha256(raw).digest()[:6], "big"))  # (48 bits: exact in float64)


def total_samples(labels: Tensor, process_group: ProcessGroup | None = None) -> Tensor:
    """The number of samples over the group's processes, a float64 scalar on ``labels``' device."""
    return all_reduce_(torch.tensor(float(labels.shape[0]), dtype=torch.float64, device=labels.device), process_group)


def weighted_loss_sum(scores: Tensor, labels: Tensor, sample_w: Tensor, loss: str) -> Tensor:
    """``sum_i w_i loss(softmax(scores_i), y_i)`` (float64 scalar) for ``scores: (N, K)``; samples of
    weight 0 count 0 even where their score is infinite."""
    per_sample = PER_SAMPLE_SCORES[loss](torch.log_softmax(scores, dim=1), labels).to(torch.float64)
    return torch.where(sample_w > 0, sample_w * per_sample, torch.zeros_like(per_sample)).sum()


def sample_weights(labels: Tensor, weights: Tensor | None, process_group: ProcessGroup | None = None) -> Tensor:
    """Per-sample weights (N,) float64 whose weighted sum of per-sample scores is the (weighted)
    mean over all samples of the group: ``weights[labels] / N_total`` (``1 / N_total`` without
    class weights)."""
    n_total = total_samples(labels, process_group)
    if weights is None:
        return torch.full(labels.shape, 1.0, dtype=torch.float64, device=labels.device) / n_total
    return weights[labels] / n_total
