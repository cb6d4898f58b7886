"""Full-batch L-BFGS driver and cross-validation, shared by every calibrator.

Calibration objectives are small convex problems over a large, fixed data set, so the right tool
is full-batch L-BFGS with a strong-Wolfe line search (no learning rate to tune), run on the
device where the logits live, with the loss accumulated in float64. :func:`minimize` runs it and
returns a :class:`FitRecord` saying what happened; non-convergence is reported, never hidden.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchcal._lbfgs import LBFGS
from torchcal._validation import (
    as_tensor,
    check_folds,
    check_labels,
    check_logits_and_labels,
    seeded_generator,
    stacklevel_outside_package,
)
from torchcal.distributed import ProcessGroup, agree_across, all_reduce_, least_across, validate_together

if TYPE_CHECKING:
    from torchcal.calibrators.base import Calibrator

__all__ = [
    "ConvergenceWarning", "FitRecord", "content_keys", "cross_validate", "cross_validate_path", "cross_validate_warm_path",
    "fold_indices", "minimize", "newton", "shared_samples", "warn_unconverged",
]


_log = logging.getLogger(__name__)
#: Points whose loose out-of-fold loss lies within this (relative) of the best are fitted again
#: tightly. The calibrators' loose selection fits move those losses by up to 3e-5 on the CIFAR-100
#: sets (Newton-CG to a gradient of 1e-4) and 8e-6 (L-BFGS to a loss change of 1e-8), a tenth of
#: this and less; on small problems (60-1,500 samples) a review found up to 2e-4.
_TIE = 3e-4
#: The race (:func:`cross_validate_path`) starts once the folds fitted so far hold this many test
#: samples: its margin reads the mean of the paired differences as normal, which a few dozen
#: heavy-tailed losses do not bear out. (The earlier relative margin, 0.5 / sqrt(n), dropped
#: lambda = 1 after one fold of 8 samples of a 40-sample Dir-ODIR problem, a point 2 % better in
#: the end than the lambda chosen instead.)
_RACE_MIN_SAMPLES = 200
#: ... and at least this many folds: the test samples of one fold share one fitted model, so a
#: fold's losses move together, which the paired differences' spread over samples does not see.
#: The race's margin is the larger of that spread's and the spread of the folds' summed
#: differences (a review: 500 CIFAR-10 rows, Dir-ODIR, lambda = 10 abandoned after two folds 3.1
#: standard errors behind lambda = 100, [51.3, 22.2] against [41.1, 16.7], and 0.644 against
#: 0.703 over the five, [.., 212.6, 22.2, 13.8] against [.., 261.5, 20.6, 11.5]).
_RACE_MIN_FOLDS = 3
#: The race's margin: standard errors of the mean paired difference between a point's test-sample
#: losses and the best point's on the folds fitted so far. It replaced a relative margin of
#: 0.5 / sqrt(n), which assumed the differences' spread to be half the mean loss: on 10 classes of
#: the CIFAR-100 sets of ../shared/data/real (1,000 samples, MS-ODIR), the losses of accurate
#: classifiers are mostly near 0 with a few large ones, and that margin dropped the eventual best
#: point after 1-3 folds (4.3 %, 2.2 % and 4.2 % behind there) on three sets, choosing points
#: 0.15-3.4 % worse. This one agrees with the unraced path on all 14 real subsets tried, and on
#: the full CIFAR-100 sets it abandons as early (the same selections, times within noise).
_RACE = 3.0


#: A search that stops short of its gradient tolerance because it can no longer decrease the loss
#: (loss or step change below tolerance) has converged if its largest gradient entry is at most
#: this: there the loss's round-off, not the search, ends it. With a larger gradient it has
#: failed (a line search that found no decrease, a badly scaled problem). :func:`newton` and
#: :func:`minimize` share it.
STALL_GRAD = 1e-6
#: A gradient entry measures closeness to the optimum only relative to its parameter's curvature:
#: at the optimum of BetaCalibration's log-loss on logits of scale 100, whose features reach
#: hundreds, round-off leaves gradients of 2e-5. L-BFGS's stop for lack of progress also counts as
#: converged if its quadratic model puts the minimum less than this (relative to the loss; or the
#: caller's ``tol_change``, if larger) below the loss. Stops at an optimum left 4e-14 to 5e-12
#: (Beta and VectorScaling on ../shared/data/real, tests/test_solvers.py), failed line searches
#: 1e-5 and more.
_STALL_DECREASE = 1e-10


def _stall_decrease(tol_change: float, loss: Tensor) -> float:
    return max(tol_change, _STALL_DECREASE * max(1.0, abs(float(loss))))


class ConvergenceWarning(UserWarning):
    """A fit stopped short of convergence: at its iteration or evaluation cap, without progress at
    a large gradient, or at a boundary of the parameter space."""


@dataclass(frozen=True)
class FitRecord:
    """What a fit did: iterations, objective evaluations, final loss and gradient, convergence."""

    iterations: int
    evaluations: int
    loss: float
    grad_max: float
    converged: bool
    message: str


def warn_unconverged(record: FitRecord, name: str) -> FitRecord:
    """``record``, with a warning that names the calibrator (or the solver) where the fit did not converge."""
    if not record.converged:
        warnings.warn(f"{name} did not converge: {record.message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    return record


def minimize(
    objective: Callable[[], Tensor],
    params: Sequence[Tensor],
    *,
    max_iter: int = 1000,
    tol_grad: float = 1e-7,
    tol_change: float = 1e-12,
    history_size: int = 10,
    process_group: ProcessGroup | None = None,
    rough_objective: Callable[[], Tensor] | None = None,
    rough_tol_change: float = 1e-6,
    loose: bool = False,
    gradient: Callable[[], Tensor] | None = None,
    warn: bool = True,
) -> FitRecord:
    """Minimise ``objective()`` over ``params`` in place by full-batch L-BFGS (strong Wolfe).

    Args:
        objective: closure returning the scalar loss as a function of ``params``.
        params: leaf tensors with ``requires_grad=True``; updated in place.
        max_iter: iteration cap; reaching it is reported as non-convergence.
        tol_grad: stop when the largest absolute gradient entry is below this. The fit has
            converged when it is, or when ``tol_change`` stopped it at a gradient below
            ``STALL_GRAD`` or where L-BFGS's model leaves too little to gain (``_STALL_DECREASE``).
        tol_change: stop when the loss or the step changes by less than this.
        history_size: L-BFGS memory. Small histories are cheap and enough for convex problems.
        process_group: for data-parallel fits (see :mod:`torchcal.distributed`). The objective
            must then return this process's share of the global mean (its loss sum divided by the
            global sample count); loss and gradients are summed over the group, so every process
            takes identical steps.
        rough_objective: an approximation of ``objective`` that is cheaper to evaluate (the same
            function in float32, say), minimised first down to ``rough_tol_change``; the search
            then goes on with ``objective`` and keeps its L-BFGS memory, so the cheap passes are
            not repeated. The record's loss and gradient are ``objective``'s; its counts include
            both stages.
        rough_tol_change: ``tol_change`` of the rough stage: about the rough objective's round-off.
        loose: ``tol_change`` is the accuracy of the loss the caller needs (a cross-validation's
            selection fits), so a stop for lack of progress counts as converged at any gradient.
        gradient: where ``params`` are a change of variables of the problem's own parameters (a
            preconditioned search), their gradient at the current ``params`` (this process's
            share under ``process_group``). The record's gradient and the convergence test are
            then the problem's, not the search's coordinates' (one more evaluation; skipped in a
            ``loose`` fit, which does not test the gradient: its record keeps ``params``').
        warn: warn when it stops unconverged with a finite loss (off for a caller that goes on
            from there).

    Returns:
        A :class:`FitRecord` whose message says why the search stopped; a
        :class:`ConvergenceWarning` is issued unless it converged: the iteration cap, the
        evaluation cap (``2 * max_iter`` objective evaluations, line searches included), or no
        progress (loss or step change below ``tol_change``) short of the optimum.
    """
    max_eval = 2 * max_iter
    params = list(params)
    optimizer = LBFGS(params, max_iter=max_iter, max_eval=max_eval, tolerance_grad=tol_grad, tolerance_change=tol_change,
                      history_size=history_size)

    start = [p.detach().clone() for p in params]
    last: list = [None, None]  # the point of the latest evaluation and its loss; p.grad holds its gradient

    def closure_of(objective: Callable[[], Tensor]) -> Callable[[], Tensor]:
        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = objective()
            loss.backward()
            if process_group is not None:
                loss = all_reduce_(loss.detach().clone(), process_group)
                for p in params:
                    if p.grad is not None:
                        all_reduce_(p.grad, process_group)
            last[:] = [p.detach().clone() for p in params], loss.detach()
            return loss

        return closure

    closure = closure_of(objective)
    with torch.enable_grad():
        if rough_objective is not None:
            optimizer.tolerance_change = rough_tol_change
            optimizer.step(closure_of(rough_objective))
            # the rest of the budget: max_iter caps both stages together
            optimizer.tolerance_change = tol_change
            optimizer.max_iter = max(1, max_iter - optimizer.state["n_iter"])
        rough_evaluations = optimizer.state["func_evals"]
        capped = rough_objective is not None and optimizer.state["n_iter"] >= max_iter
        if capped:  # the rough stage used the whole cap: the objective itself where it stopped
            closure()
        else:
            optimizer.step(closure)
        evaluations = optimizer.state["func_evals"] + capped
        # each step() has its own evaluation budget (max_eval)
        out_of_evaluations = not capped and evaluations - rough_evaluations >= max_eval
        # The line search usually accepts the point it evaluated last; if not, evaluate the result.
        if not all(torch.equal(p, at) for p, at in zip(params, last[0])):
            closure()
            evaluations += 1
        loss = last[1]
    iterations = optimizer.state["n_iter"]
    grad_max = max(float(p.grad.abs().max()) for p in params if p.numel() and p.grad is not None)
    if gradient is not None and not loose and math.isfinite(grad_max):
        with torch.enable_grad():
            own = gradient().detach()
        grad_max = float(all_reduce_(own.clone(), process_group).abs().max())
    finite = math.isfinite(float(loss.detach())) and math.isfinite(grad_max)
    stalled = iterations < max_iter and not out_of_evaluations  # stopped by tol_change
    settled, remaining = loose or grad_max <= STALL_GRAD, math.inf
    if finite and stalled and not settled:
        flat_grad = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        remaining = _predicted_decrease(optimizer.state, flat_grad)
        settled = remaining <= _stall_decrease(tol_change, loss)
    converged = finite and (grad_max <= tol_grad or (stalled and settled))
    if not finite:
        message = "the loss or its gradient is not finite: the scores are too large for this fit; kept the starting parameters"
        warnings.warn(f"L-BFGS failed: {message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
    elif grad_max <= tol_grad:
        message = "gradient below tolerance"
    elif converged:
        message = f"no further decrease (loss or step change below tolerance) at gradient {grad_max:.2e}"
        if math.isfinite(remaining):
            message += f", {remaining:.1e} above the minimum of L-BFGS's quadratic model"
    else:
        if iterations >= max_iter:
            message = f"stopped at the iteration cap ({max_iter}) with gradient {grad_max:.2e}"
        elif out_of_evaluations:
            message = (f"ran out of objective evaluations ({max_eval}, line searches included) after {iterations} "
                       f"iteration{'s' * (iterations != 1)} with gradient {grad_max:.2e}")
        else:
            message = (f"no progress after {iterations} iteration{'s' * (iterations != 1)} (the line search's loss or step change fell below "
                       f"{tol_change:g}) with gradient {grad_max:.2e}; the problem may be badly scaled")
        if warn:
            warnings.warn(f"L-BFGS did not converge: {message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    for p in params:
        p.grad = None
    return FitRecord(iterations, evaluations, float(loss.detach()), grad_max, converged, message)


def _predicted_decrease(state: dict, grad: Tensor) -> float:
    """The decrease of the loss that L-BFGS's model (its curvature pairs in ``state``) predicts
    from the point with gradient ``grad`` to the model's minimum: ``grad @ H^-1 @ grad / 2``."""
    steps, changes, rho = state.get("old_stps", []), state.get("old_dirs", []), state.get("ro", [])
    if not steps:
        return math.inf
    q = grad.clone()
    alphas = []
    for s, y, r in zip(reversed(steps), reversed(changes), reversed(rho)):
        alphas.append(r * s.dot(q))
        q -= alphas[-1] * y
    q *= state["H_diag"]
    for s, y, r, a in zip(steps, changes, rho, reversed(alphas)):
        q += s * (a - r * y.dot(q))
    return float(grad.dot(q)) / 2


def _stalled(iteration: int, evaluations: int, loss: float, grad_max: float) -> FitRecord:
    """The record of a Newton search that can no longer decrease the loss. Near the optimum that
    is round-off (converged); with a large gradient it is a failure, reported so that callers fall
    back to L-BFGS."""
    converged = grad_max <= STALL_GRAD
    return FitRecord(iteration, evaluations, loss, grad_max, converged, "no further decrease" if converged else "line search failed")


#: Newton reuses the factorised Hessian of an earlier step while its full steps still shrink the
#: gradient at least this many times: there Newton converges quadratically, the Hessian has hardly
#: changed, and a step with the old one is as good as one with a new one (SVS at 10,000 x 100:
#: three (2K)^2 Hessians per fit, half its time, became one).
_REUSE_SHRINK = 100.0


def newton(
    derivatives: Callable[[Tensor], tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]],
    objective: Callable[[Tensor], Tensor],
    theta: Tensor,
    *,
    max_iter: int = 100,
    tol_grad: float = 1e-10,
    process_group: ProcessGroup | None = None,
    warn: bool = True,
) -> tuple[Tensor, FitRecord]:
    """Minimise a smooth convex function of ``theta: (P,)`` by Newton's method with backtracking.

    For the small calibration models (up to about a thousand parameters) the exact Hessian is
    cheap next to a pass over the data, and Newton converges in a handful of passes where L-BFGS
    needs hundreds on these badly scaled problems. Everything stays on the parameters' device;
    each iteration reads three numbers back to the host (one synchronisation), plus one per
    backtracking step, which only happens far from the optimum.

    Args:
        derivatives: ``theta -> (loss, grad (P,), curvature (P,), hessian)``: ``curvature`` the
            Hessian's diagonal, ``hessian()`` the Hessian (P, P), formed only when a step needs
            it (not at the last point, nor where an earlier one is reused: ``_REUSE_SHRINK``).
        objective: ``theta -> loss``, used by the line search when a full step is rejected.
        theta: (P,) starting point, float64.
        tol_grad: converged when the largest absolute gradient entry is below this.
        warn: warn when the iteration cap stops it (off for a caller that goes on from there).
        process_group: for data-parallel fits the callables return this process's share of the
            global mean; the shares are summed over the group, so every process takes the same
            steps (see :mod:`torchcal.distributed`).

    Returns:
        The minimiser and a :class:`FitRecord`. Flat directions of the Hessian (e.g. a constant
        added to every class's bias) are resolved by a tiny ridge and leave the loss unchanged.

    Newton's method is invariant to the scale of each parameter, and so is this implementation:
    the system is solved after scaling the Hessian to a unit diagonal (the ridge is relative to
    each parameter's own curvature, so a direction of tiny curvature, e.g. the scale of a feature
    that varies by 1e-7, is not swamped by the others), and convergence needs every gradient entry
    below ``tol_grad`` both as it is and divided by the square root of its curvature (a gradient
    that is small only because the parameter's scale is large does not count as converged).
    """

    def reduced_derivatives(theta: Tensor) -> tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]:
        loss, grad, curvature, hessian = derivatives(theta)
        if process_group is None:
            return loss, grad, curvature, hessian
        p = grad.numel()
        flat = all_reduce_(torch.cat([loss.reshape(1), grad, curvature]), process_group)
        return flat[0], flat[1 : p + 1], flat[p + 1 :], lambda: all_reduce_(hessian(), process_group)

    def reduced_objective(theta: Tensor) -> Tensor:
        return all_reduce_(objective(theta).reshape(1), process_group)[0]

    def gradient_size(grad: Tensor, curvature: Tensor) -> Tensor:
        """The larger of the gradient's largest entry and its largest curvature-scaled entry."""
        scaled = torch.where(curvature > 0, grad.abs() / curvature.clamp_min(1e-300).sqrt(), grad.abs())
        return torch.maximum(grad.abs().max(), scaled.max())

    def factorise(hess: Tensor) -> Callable[[Tensor], Tensor]:
        """``g -> H^-1 g`` for the Hessian scaled to a unit diagonal plus a tiny ridge. Where it
        has no usable curvature (e.g. saturated scores) the solves are not finite, and the step is
        steepest descent (read with the step's other numbers: no synchronisation of its own)."""
        curvature = hess.diagonal().abs()
        scale = torch.where(curvature > 0, curvature, curvature.max()).rsqrt()
        eye = torch.eye(hess.shape[0], dtype=hess.dtype, device=hess.device)
        factors, pivots, _ = torch.linalg.lu_factor_ex(scale.unsqueeze(1) * hess * scale + 1e-12 * eye)
        return lambda g: scale * torch.linalg.lu_solve(factors, pivots, (scale * g).unsqueeze(1)).squeeze(1)

    loss, grad, curvature, hessian = reduced_derivatives(theta)
    evaluations = 1
    grad_max, loss_value, size = torch.stack([grad.abs().max(), loss, gradient_size(grad, curvature)]).tolist()
    solve: Callable[[Tensor], Tensor] | None = None
    reuse = False  # the last step was a full one that shrank the gradient _REUSE_SHRINK-fold
    for iteration in range(max_iter):
        if size <= tol_grad:
            return theta, FitRecord(iteration, evaluations, loss_value, grad_max, True, "gradient below tolerance")
        if not (reuse and solve is not None):
            solve = factorise(hessian())
        step = solve(-grad)
        step = torch.where(torch.isfinite(step).all(), step, -grad)  # no usable curvature
        new_loss, new_grad, new_curvature, new_hessian = reduced_derivatives(theta + step)
        evaluations += 1
        # one host sync per iteration: the trial's loss and gradient, and the step's slope
        trial_loss, trial_grad_max, trial_size, slope = torch.stack(
            [new_loss, new_grad.abs().max(), gradient_size(new_grad, new_curvature), grad @ step]
        ).tolist()
        # Near the optimum the decrease falls below the loss's rounding error: allow for it.
        slack = 1e-14 * max(1.0, abs(loss_value))
        t = 1.0
        while not trial_loss <= loss_value + 1e-4 * t * slope + slack and t > 1e-10:
            t /= 2
            trial_loss = float(reduced_objective(theta + t * step))
            evaluations += 1
        if t <= 1e-10:
            if reuse:  # (an old Hessian's step: once more with a fresh one)
                reuse = False
                continue
            return theta, _stalled(iteration, evaluations, loss_value, grad_max)
        if t < 1.0:
            new_loss, new_grad, new_curvature, new_hessian = reduced_derivatives(theta + t * step)
            evaluations += 1
            trial_loss, trial_grad_max, trial_size = torch.stack([new_loss, new_grad.abs().max(), gradient_size(new_grad, new_curvature)]).tolist()
        if trial_loss >= loss_value and trial_grad_max >= grad_max:
            if reuse:
                reuse = False
                continue
            return theta, _stalled(iteration, evaluations, loss_value, grad_max)
        reuse = t == 1.0 and _REUSE_SHRINK * trial_grad_max <= grad_max
        theta, grad, curvature, hessian = theta + t * step, new_grad, new_curvature, new_hessian
        loss_value, grad_max, size = trial_loss, trial_grad_max, trial_size
        # (host floats only: the log adds no synchronisation)
        _log.debug("Newton (%d parameters) step %d: loss %.10f, max gradient %.1e, step length %g, %d evaluations",
                   theta.numel(), iteration + 1, loss_value, grad_max, t, evaluations)
    if size <= tol_grad:  # (the cap's last step got there)
        return theta, FitRecord(max_iter, evaluations, loss_value, grad_max, True, "gradient below tolerance")
    if warn:
        warnings.warn(f"Newton did not converge in {max_iter} iterations", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    return theta, FitRecord(max_iter, evaluations, loss_value, grad_max, False, f"stopped at the iteration cap ({max_iter})")


def fold_indices(
    labels: Tensor,
    folds: int = 5,
    seed: int = 0,
    stratified: bool = True,
    groups: Tensor | None = None,
    process_group: ProcessGroup | None = None,
    scores: Tensor | None = None,
) -> list[Tensor]:
    """Split sample indices into ``folds`` disjoint test folds.

    Stratified folds deal each class's shuffled samples round-robin, so every fold has nearly the
    same class proportions. With ``groups: (N,)``, whole groups are kept together (the groups, in
    an order drawn from ``seed``, each assigned to the smallest fold) and ``stratified`` is ignored.
    With ``scores: (N, K)`` (logits or log-posteriors), the samples are put in an order given by
    their scores before the seeded shuffle, so each sample lands in the same fold whatever the
    order of the rows, and whether the scores are float32 or float64. (Identical samples are not
    kept together: with scores of a few distinct values they are different samples, and folds of
    whole groups of them were empty or lacked whole score values.)
    In a data-parallel fit every process splits its own samples; with ``process_group`` given, a
    process with too few samples, or with ``groups`` that cannot fill the folds, makes every
    process raise (not only itself, which would leave the others waiting in their next
    collective), and the warning about a class that a fold's training part lacks counts the
    group's samples.
    """
    folds, seed = check_folds(folds, seed)

    def check() -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """The labels, and each sample's group as ``torch.unique`` gives them, or refuse."""
        checked = as_tensor(labels, "labels")
        if scores is not None:
            # (scores of other rows than the labels' had built the folds from uninitialised memory)
            if scores.ndim != 2 or scores.shape[0] != (checked.shape[0] if checked.ndim else 1):
                raise ValueError(f"scores must have shape (N, K) with the labels' N = {checked.shape[0] if checked.ndim else 1} "
                                 f"rows, got {tuple(scores.shape)}.")
            num_classes = scores.shape[1]
        else:  # (any bound: the indices' type, shape and sign are what is checked)
            num_classes = int(checked.max()) + 1 if checked.numel() and not torch.is_floating_point(checked) else 1
        checked = check_labels(checked, checked.shape[0] if checked.ndim else 1, num_classes)
        n = checked.shape[0]
        if process_group is None and n < folds:
            raise ValueError(f"cross-validation with {folds} folds needs at least {folds} samples, got N = {n}.")
        if groups is None:
            return checked, None
        by_group = torch.as_tensor(groups).cpu()
        if by_group.shape != (n,):
            raise ValueError(f"groups must have shape ({n},), got {tuple(by_group.shape)}.")
        if by_group.is_floating_point() and bool(by_group.isnan().any()):  # (torch.unique makes each NaN a group)
            raise ValueError("groups has NaN ids, each of which would be a group of its own: give the samples without "
                             "an id a shared one, or one each.")
        unique, inverse, counts = torch.unique(by_group, return_inverse=True, return_counts=True)
        if unique.numel() < folds:
            raise ValueError(f"{unique.numel()} groups cannot fill {folds} folds; use fewer folds.")
        return checked, (unique, inverse, counts)

    # (every process's checks at once: one that raised alone left the others in their next collective)
    labels, grouping = validate_together(check, process_group, labels if isinstance(labels, Tensor) else None)
    device, n = labels.device, labels.shape[0]
    # (folds that differ between processes aborted the group or left it waiting)
    agree_across({"folds": folds, "seed": seed, "stratified": float(stratified), "groups given": float(grouping is not None)},
                 process_group, device)
    if process_group is not None:
        fewest = least_across(n, process_group, device)
        if fewest < folds:
            raise ValueError(f"cross-validation with {folds} folds needs at least {folds} samples on every process "
                             f"(the fewest: {int(fewest)}), got N = {n} here.")
    gen = seeded_generator(seed)
    assignment = torch.empty(n, dtype=torch.long)
    labels = labels.cpu()
    canonical = torch.arange(n) if scores is None or grouping is not None else order_by_content(scores, labels)
    if grouping is not None:
        unique, inverse, counts = grouping
        # in a random order, each to the smallest fold (as scikit-learn's shuffled GroupKFold; largest
        # first, the seed only broke ties between groups of one size: groups of distinct sizes got
        # the same folds from every seed)
        order = torch.randperm(unique.numel(), generator=gen)
        sizes = [0] * folds
        group_fold = torch.empty(unique.numel(), dtype=torch.long)
        for g in order.tolist():
            f = min(range(folds), key=sizes.__getitem__)
            group_fold[g] = f
            sizes[f] += int(counts[g])
        assignment = group_fold[inverse]
    elif stratified:
        offset = 0
        for k in torch.unique(labels).tolist():
            members = canonical[labels[canonical] == k]
            members = members[torch.randperm(members.numel(), generator=gen)]
            assignment[members] = (torch.arange(members.numel()) + offset) % folds
            offset += members.numel()
        # A fold's training part lacks a class whose samples all fall in that fold: one sample, or (a
        # fold's training part being the group's) one per process, dealt to the same fold.
        width = int(labels.max()) + 1 if n else 0
        if process_group is not None:
            width = int(all_reduce_(torch.tensor([float(width)], device=device), process_group, op="max").item())
        in_fold = torch.zeros(width, folds, dtype=torch.float64).index_put_((labels, assignment), torch.ones(n, dtype=torch.float64),
                                                                             accumulate=True)
        in_fold = all_reduce_(in_fold.to(device), process_group).cpu()
        total = in_fold.sum(1, keepdim=True)
        lacking = ((in_fold == total) & (total > 0)).any(1).nonzero().flatten().tolist()
        if lacking:
            single = bool((total[lacking] == 1).all())
            warnings.warn(
                f"class(es) {lacking} have " + ("a single sample" if single else "all their samples in one fold") +
                ": the training part of its fold will miss it.",
                stacklevel=stacklevel_outside_package(),
            )
    else:
        assignment[canonical] = torch.randperm(n, generator=gen) % folds
    return [(assignment == f).nonzero().flatten() for f in range(folds)]


def content_keys(scores: Tensor) -> Tensor:
    """A key (N,) float64 per sample that depends on its values only: a fixed random projection of
    the float32 roundings of its log-posteriors ``log_softmax(scores)`` (computed in float64, so
    that logits and their log-posteriors give one key; a copy stored in float32 can round
    differently, which :func:`shared_samples` allows for). Identical samples share a key;
    samples with different scores practically never do (samples of equal scores do: with scores
    of a few distinct values, different samples share keys). Log-posteriors are floored at
    float64's smallest normal probability: a class masked at -1e30 swamped every other term of the
    projection, every sample shared one key, and the folds followed the order of the rows."""
    floor = math.log(torch.finfo(torch.float64).tiny)
    return _projected(scores, lambda rows: torch.log_softmax(rows, dim=1).clamp_(min=floor))


def _projected(scores: Tensor, transform: Callable[[Tensor], Tensor]) -> Tensor:
    """(N,) float64: a fixed random projection of the float32 roundings of ``transform`` of the
    rows of ``scores: (N, K)`` in float64, chunk by chunk."""
    direction = torch.randn(scores.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    direction = direction.to(scores.device)
    rows = max(1, (1 << 22) // scores.shape[1])  # float64 temporaries of 32 MB
    return torch.cat([transform(chunk.detach().to(torch.float64)).to(torch.float32).to(torch.float64) @ direction
                      for chunk in scores.split(rows)]).cpu()


def order_by_content(scores: Tensor, labels: Tensor) -> Tensor:
    """A permutation of the samples that depends on their values only: by label, then by their
    :func:`content_keys`, then by their scores below each row's top, then by their mean score
    (rounded to float32): rows that differ by a constant share a key, the same posteriors, but are
    different samples to a map of the raw logits (matrix scaling), and were left in the order of
    the rows. Identical samples are interchangeable."""
    means = scores.detach().to(torch.float64).mean(1).to(torch.float32).cpu()
    # log-posteriors floored at -708 give one key to rows whose other classes all lie further below
    # the top ([1000, 0, -1000] and [1000, -500, -500], of one mean: their folds followed the row
    # order, a fuzz review); the projection of the scores below each row's top tells them apart
    below_top = _projected(scores, lambda rows: rows - rows.amax(dim=1, keepdim=True))
    order = torch.argsort(means, stable=True)
    order = order[torch.argsort(below_top[order], stable=True)]
    order = order[torch.argsort(content_keys(scores)[order], stable=True)]
    return order[torch.argsort(labels[order], stable=True)]


#: Two samples are the same where their labels agree and each of their log-posteriors does within
#: this plus 2^-20 of its magnitude (8 float32 units of its last place): the rows of a file stored
#: again as float32 log-posteriors, or written with six decimals. (Equal float32-rounded keys found
#: 6 % of them; a tolerance relative to a row's largest magnitude, a class masked at -1e30
#: included, took disjoint data for the same.)
SAME_SAMPLE_TOLERANCE = 6e-7
#: Candidates compared per sample at most (those whose projections lie within reach of its own).
_SAME_SAMPLE_CANDIDATES = 64


def shared_samples(logits: Tensor, labels: Tensor, other_logits: Tensor, other_labels: Tensor, *, exclude_self: bool = False) -> Tensor:
    """Which samples of ``logits: (N, K)``, ``labels: (N,)`` appear in the other data as well: one
    of the same label whose log-posteriors lie within round-off (:data:`SAME_SAMPLE_TOLERANCE`);
    (N,) bool. The other samples are sorted by label and by a fixed random projection of their
    log-posteriors; a sample's candidates are those within its tolerance's reach there.
    ``exclude_self``: the other data are these data, and a sample's own row does not count (which
    of them have a near twin)."""
    floor = math.log(torch.finfo(torch.float64).tiny)

    def log_posteriors(scores: Tensor) -> Tensor:
        return torch.log_softmax(scores.detach().to(torch.float64), dim=1).clamp_(min=floor).cpu()

    mine = log_posteriors(logits)
    theirs = mine if exclude_self else log_posteriors(other_logits)
    direction = torch.randn(mine.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tol = SAME_SAMPLE_TOLERANCE + mine.abs() * 2.0**-20  # (N, K)
    key, reach = mine @ direction, tol @ direction.abs()
    labels, other_labels = labels.cpu().long(), other_labels.cpu().long()
    other_key = key if exclude_self else theirs @ direction
    order = torch.argsort(other_key, stable=True)
    order = order[torch.argsort(other_labels[order], stable=True)]
    sorted_key, sorted_labels = other_key[order], other_labels[order]
    lo, hi = torch.zeros_like(labels), torch.zeros_like(labels)
    for label in labels.unique().tolist():
        rows = (labels == label).nonzero().flatten()
        first = int(torch.searchsorted(sorted_labels, label))
        block = sorted_key[first : int(torch.searchsorted(sorted_labels, label, right=True))]
        lo[rows] = first + torch.searchsorted(block, key[rows] - reach[rows])
        hi[rows] = first + torch.searchsorted(block, key[rows] + reach[rows], right=True)
    shared = torch.zeros(labels.shape[0], dtype=torch.bool)
    for offset in range(_SAME_SAMPLE_CANDIDATES):
        open_ = (lo + offset < hi) & ~shared
        if not bool(open_.any()):
            break
        rows = open_.nonzero().flatten()
        candidates = order[lo[rows] + offset]
        shared[rows] = ((mine[rows] - theirs[candidates]).abs() <= tol[rows]).all(1) & ~(exclude_self & (candidates == rows))
    return shared


def cross_validate(
    calibrator: Calibrator,
    logits: Tensor,
    labels: Tensor,
    folds: int = 5,
    seed: int = 0,
    stratified: bool = True,
    groups: Tensor | None = None,
    on_fold: Callable[[int], None] | None = None,
    **fit_options: Any,
) -> Tensor:
    """Out-of-fold calibrated log-posteriors (N, K): each fold is calibrated by a copy of
    ``calibrator`` fitted on the other folds.

    This is how Ferrer & Ramos measure calibration loss on a single evaluation set without ever
    training the calibrator on the samples it is scored on.

    Args:
        calibrator: an unfitted (or fitted; it is copied, never modified) calibrator.
        logits: (N, K) scores. labels: (N,) class indices.
        folds, seed, stratified, groups: see :func:`fold_indices`.
        on_fold: called with the fold's index before each fold's fit (e.g. to show progress).
        **fit_options: passed to every ``fit`` (e.g. ``loss="brier"``, ``priors=...``).

    Example:
        >>> import torch, torchcal
        >>> logits = 3 * torch.randn(200, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels).shape
        torch.Size([200, 4])
    """
    from torchcal.calibrators.base import check_calibrator  # (the calibrators import this module)

    check_calibrator(calibrator)
    logits, labels = validate_together(lambda: check_logits_and_labels(logits, labels), fit_options.get("process_group"), logits)
    out: Tensor | None = None
    splits = fold_indices(labels, folds, seed, stratified, groups, fit_options.get("process_group"), scores=logits)
    for fold, test in enumerate(splits):
        if on_fold is not None:
            on_fold(fold)
        test = test.to(logits.device)
        train = torch.ones(labels.shape[0], dtype=torch.bool, device=logits.device)
        train[test] = False
        try:
            fold_model = copy.deepcopy(calibrator).fit(logits[train], labels[train], **fit_options)
        except ValueError as error:
            missing = sorted(set(range(logits.shape[1])) - set(labels[train].unique().tolist()))
            if not missing:
                raise
            raise ValueError(f"the training part of fold {fold} has no sample of class(es) {missing} (with fewer samples "
                             f"than the {folds} folds, a class can miss a training part; use fewer folds): {error}") from error
        with torch.no_grad():
            calibrated = fold_model(logits[test])
        if out is None:
            out = calibrated.new_empty(logits.shape)
        out[test] = calibrated
    assert out is not None
    return out


def cross_validate_path(
    order: Sequence[int],
    num_folds: int,
    fold_loss: Callable[[int, int], Tensor],
    num_samples: int,
    process_group: ProcessGroup | None = None,
    patience: int = 2,
    point_names: Sequence[str] | None = None,
    refine: Callable[[int, int], Tensor] | None = None,
    tie: float = _TIE,
    race: float | None = _RACE,
) -> list[float]:
    """Out-of-fold loss of the points of a regularisation grid, visited along a path.

    Points are visited in ``order`` (strongest penalty first), every fold's model warm-started
    from its fits at the previous points (:func:`secant_start`), which ``fold_loss(point, fold)``
    does: it fits fold ``fold``'s model at grid point ``point`` and returns the loss of each of
    that fold's test samples (1-D, always in the same order; weighted, so that they sum to the
    fold's share of the loss). Work is saved in three ways. A point whose first folds' losses
    already sum past the best total cannot win (losses are non-negative), and its other folds are
    not fitted. With ``race``, neither are those of a point that trails the best point on the test
    samples of the folds fitted so far by more than ``race`` standard errors of the mean of their
    paired differences (from ``_RACE_MIN_SAMPLES`` samples and ``_RACE_MIN_FOLDS`` folds on; over
    the samples or over the folds, whichever is larger), and by more than ``tie`` of the
    best's loss on them (relative): the tight refits settle the near-ties. Once the loss has risen
    at ``patience`` consecutive points past its best, by more than ``tie`` (relative; a loose
    fit's error is no rise), the path stops: weaker penalties only over-fit further. All three
    leave ``inf`` for the point.

    Args:
        order: grid indices in the order to visit them; the returned list is indexed like the grid,
            whose length is ``max(order) + 1``.
        num_samples: this process's samples over all test folds; in a data-parallel fit the
            losses, their sums and the counts are summed over ``process_group``.
        point_names: how the log (``logging``, logger ``torchcal.fit``) names the grid points.
        refine: like ``fold_loss``, but fitting to a tighter tolerance (from the fold's fit at that
            point). When ``fold_loss`` fits loosely, the points whose loss lies within ``tie``
            (relative) of the best are evaluated again with it, every fold, and those losses
            decide: a near-tie is not settled by the loose fits' error.
        race: ``None`` to abandon only the points that cannot win (see ``_RACE``).

    Returns:
        The mean out-of-fold loss of every grid point (``inf`` where abandoned or not visited).
    """
    losses = [math.inf] * (max(order) + 1)
    names = point_names or [f"grid point {i}" for i in range(len(losses))]

    def summed(*values: Tensor) -> list[float]:
        """Scalars (float64, on the losses' device, which the backend needs) summed over the process group."""
        return all_reduce_(torch.stack(values), process_group).tolist()

    def mean_of(terms: Tensor) -> float:
        """The mean loss over every test sample of the process group, from this process's ``terms``."""
        total, samples = summed(terms.sum(), terms.new_tensor(float(num_samples)))
        return total / samples

    best, best_terms, rises = math.inf, torch.empty(0), 0
    for point in order:
        terms: list[Tensor] = []  # per fold: the loss of each of its test samples
        for fold in range(num_folds):
            terms.append(fold_loss(point, fold).to(torch.float64).flatten())
            so_far = torch.cat(terms)
            mean = mean_of(so_far)
            last = fold + 1 == num_folds
            if not last and mean > best:
                _log.info("regularisation path: %s abandoned after %d of %d folds (cannot beat %.6f)", names[point], fold + 1, num_folds, best)
                break
            if not last and race is not None and math.isfinite(best) and fold + 1 >= _RACE_MIN_FOLDS:
                best_so_far = best_terms[: so_far.numel()]
                difference = so_far - best_so_far  # paired: the same test samples
                by_fold = difference.split([t.numel() for t in terms])
                first, second, paired, level, *fold_sums = summed(
                    difference.sum(), difference.square().sum(), difference.new_tensor(float(difference.numel())),
                    best_so_far.sum(), *(d.sum() for d in by_fold), *(d.new_tensor(float(d.numel())) for d in by_fold))
                spread = math.sqrt(max(second - first * first / paired, 0.0))  # sqrt(n) times the standard error
                sums, counts = fold_sums[: len(terms)], fold_sums[len(terms) :]
                folds = len(terms)
                between = folds / (folds - 1) * sum((d - c * first / paired) ** 2 for d, c in zip(sums, counts))
                spread = max(spread, math.sqrt(between))  # (the same scale: that of the summed differences)
                # (a near-tie is never raced: many samples make even a difference far below the
                # loose fits' error significant, and the tight refits must settle it)
                if paired >= _RACE_MIN_SAMPLES and first > race * spread and first > tie * abs(level):
                    _log.info("regularisation path: %s abandoned after %d of %d folds (behind the best by %.1f standard errors on them)",
                              names[point], fold + 1, num_folds, first / spread if spread > 0 else math.inf)
                    break
        else:
            losses[point] = mean if not math.isnan(mean) else math.inf  # (NaN would confuse every min())
            _log.info("regularisation path: %s, out-of-fold loss %.6f", names[point], mean)
        if losses[point] < best:
            best, best_terms, rises = losses[point], torch.cat(terms), 0
        elif not math.isfinite(best):  # no finite loss yet to rise from
            pass
        elif losses[point] <= best + tie * abs(best):  # within the loose fits' error: no rise
            rises = 0
        else:  # (abandoned, or a loss that is not finite)
            rises += 1
        if rises >= patience:
            _log.info("regularisation path: the loss rose at %d points in a row; weaker penalties are not tried", patience)
            break
    contenders = [point for point, loss in enumerate(losses) if math.isfinite(best) and loss <= best + tie * abs(best)]
    if refine is not None and len(contenders) > 1:
        for point in contenders:
            losses[point] = mean_of(torch.cat([refine(point, fold).to(torch.float64).flatten() for fold in range(num_folds)]))
            _log.info("regularisation path: %s within %g of the best, fitted again tightly: out-of-fold loss %.6f", names[point], tie, losses[point])
    return losses


def cross_validate_warm_path(
    order: Sequence[int],
    strengths: Sequence[float],
    num_folds: int,
    fit_fold: Callable[[int, int, Tensor | None, bool], tuple[Tensor, Tensor]],
    num_samples: int,
    process_group: ProcessGroup | None = None,
    patience: int = 2,
    point_names: Sequence[str] | None = None,
    tie: float = _TIE,
    race: float | None = _RACE,
    fit_folds: Callable[[int, list[Tensor | None], bool], tuple[list[Tensor], list[Tensor]]] | None = None,
) -> tuple[list[float], Tensor]:
    """:func:`cross_validate_path` for calibrators whose fold fits warm-start one another.

    ``fit_fold(point, fold, start, tight)`` fits fold ``fold``'s model at grid point ``point``
    from the parameters ``start`` (where ``None``, from the model's own: its last fit, or its
    starting point), loosely for selection or, with ``tight``, to the tolerance that settles a
    near-tie, and returns the losses of the fold's test samples (see :func:`cross_validate_path`)
    and the fitted parameters. The starts: the fold's fits at the points before, extrapolated in
    ``strengths`` (the lambda of every grid point; see :func:`secant_start`); at the fold's first
    point, the previous fold's fit there (the training sets share most of their samples); for a
    tight refit, the loose fit it refines.

    With ``fit_folds(point, starts, tight)``, every fold of a point is fitted at once, from the
    folds' ``starts`` (``None`` at the first point), returning the folds' test-sample losses and
    parameters; ``fit_fold`` is then not called. The path still reads the losses fold by fold and
    abandons points by the same rules, so that both ways select alike: without the race the
    batched path chose lambda = 0.01 where the folds one by one chose 10 (Dir-ODIR on 40 samples;
    the race had dropped lambda = 1 after its first fold), a selection that depended on the device.

    Returns:
        The out-of-fold losses of :func:`cross_validate_path`, and the folds' mean parameters at
        the best point: a start for the final fit, near its optimum.
    """
    fits: dict[int, dict[int, Tensor]] = {}  # grid point -> fold -> parameters, in the order visited

    def start(point: int, fold: int) -> Tensor | None:
        path = [(strengths[p], thetas[fold]) for p, thetas in fits.items() if fold in thetas]
        return secant_start(path, strengths[point]) if path else fits.get(point, {}).get(fold - 1)

    def fold_loss(point: int, fold: int) -> Tensor:
        loss, fits.setdefault(point, {})[fold] = fit_fold(point, fold, start(point, fold), False)
        return loss

    def refined_loss(point: int, fold: int) -> Tensor:
        loss, fits[point][fold] = fit_fold(point, fold, fits[point][fold], True)
        return loss

    batch_losses: dict[tuple[int, bool], list[Tensor]] = {}  # (point, tight) -> the folds' losses, fitted together

    def fitted_together(point: int, fold: int, tight: bool) -> Tensor:
        assert fit_folds is not None
        if fold == 0:  # (the path asks for a point's folds in order)
            starts: list[Tensor | None] = [fits[point][f] if tight else start(point, f) for f in range(num_folds)]
            batch_losses[point, tight], thetas = fit_folds(point, starts, tight)
            fits[point] = dict(enumerate(thetas))
        return batch_losses[point, tight][fold]

    if fit_folds is not None:
        fold_loss, refined_loss = functools.partial(fitted_together, tight=False), functools.partial(fitted_together, tight=True)

    # The fits' own convergence warnings, one per fold and grid point (36 for SMS at max_iter=1),
    # become one that says how many there were.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        losses = cross_validate_path(order, num_folds, fold_loss, num_samples, process_group, patience, point_names, refined_loss, tie, race)
    unconverged = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    for w in caught:
        if not issubclass(w.category, ConvergenceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if unconverged:
        warnings.warn(f"{len(unconverged)} convergence warning{'s' * (len(unconverged) > 1)} from the cross-validation's fits "
                      f"(the first: {unconverged[0].message}); their out-of-fold losses, and the selection, may be off",
                      ConvergenceWarning, stacklevel=stacklevel_outside_package())
    best = min(range(len(losses)), key=losses.__getitem__)
    return losses, torch.stack(list(fits[best].values())).mean(0)


def secant_start(fits: Sequence[tuple[float, Tensor]], lam: float) -> Tensor | None:
    """A start for a fold's fit at penalty strength ``lam`` along a regularisation path, from its
    fits ``(lambda, theta)`` at the points before: the last two extrapolated linearly in log
    lambda, at most one step of their own length. ``None`` with fewer than two fits, or lambdas
    that are not positive and distinct (start from the last fit then).

    From the previous fit alone, a Dir-ODIR fit a decade weaker took as many passes as a cold one
    (the optimum moves far along the path). The default cross-validated fits on the CIFAR-100
    LeNet-5 logits: Dir-ODIR 1,238 -> 1,022 passes, SMS 2,005 -> 1,834.

    Example:
        >>> import torch
        >>> secant_start([(100.0, torch.tensor([1.0])), (10.0, torch.tensor([2.0]))], 1.0)
        tensor([3.])
    """
    if len(fits) < 2:
        return None
    (lam_1, theta_1), (lam_2, theta_2) = fits[-2:]
    if not (lam > 0 and lam_1 > 0 and lam_2 > 0 and lam_1 != lam_2):
        return None
    ratio = min(1.0, abs(math.log(lam / lam_2) / math.log(lam_2 / lam_1)))
    return theta_2 + ratio * (theta_2 - theta_1)
