"""Unknown deployment priors (label shift): estimate the class priors of unlabelled target data and
adapt calibrated posteriors to them.

Under label shift the class-conditional score distributions are those of the calibration (source)
data and only the class priors change, from ``pi_s`` to ``pi_t``. Bayes' rule then turns source
posteriors into target posteriors, ``q(k | x) ∝ p(k | x) pi_t[k] / pi_s[k]``
(:func:`adapt_to_priors`). With known target priors that is all; the scoring functions and
``Calibrator.fit`` already take deployment ``priors`` (Ferrer & Ramos, App. A). When they are unknown,
:func:`estimate_priors` finds them from unlabelled target scores by maximum likelihood (Saerens,
Latinne & Decaestecker 2002).

That likelihood's logarithm, ``L(pi) = mean_n log(sum_k a[n, k] pi[k])`` with ``a[n, k] = p(k | x_n)
/ pi_s[k]``, is concave on the simplex. The EM step of Saerens et al., ``pi <- pi * grad L(pi)``
(the mean of the posteriors adapted to ``pi``), raises it at every step but converges linearly, and
slowly where the classes' scores overlap: on CIFAR-100 LeNet-5 scores resampled to Dirichlet(0.5)
priors it is still 1.2e-3 off after 1,000 steps and takes 57,000 to change no prior by more than
1e-13. So :func:`estimate_priors` takes ten EM steps from the source priors (cheap, and most of the
way where the scores are confident), then projected Newton steps (Bertsekas 1982) on ``f(x) = -L(x)
+ sum(x)`` over ``x >= 0``, whose minimiser is the maximum of ``L`` on the simplex: classes at or
near 0 that the gradient pushes further down are cut to 0, the others take a Newton step with the
Hessian ``mean_n a_n a_n^T / (a_n . x)^2`` of their block (N K_f^2 operations), and an Armijo line
search runs along the projection arc. It converges quadratically and leaves classes absent from the
target at exactly 0: ten Newton steps on the LeNet-5 problem (0.05 s on one thread), seven at
K = 1,000 and N = 20,000 (6 s, mostly the Hessians). SQUAREM-accelerated EM (Varadhan & Roland
2008), the alternative measured, took 681 iterations (0.9 s) and 1,361 (126 s) there.

Both steps assume the source posteriors are calibrated, and the estimate is sensitive to it.
Alexandari, Kundaje & Shrikumar (2020) find bias-corrected temperature scaling (BCTS),
``softmax(z / T + b)``, the calibrator to use: it is :class:`~torchcal.AffineCalibration`
(``softmax(alpha * log_softmax(z) + beta)`` is the same family, since ``log_softmax`` only subtracts
a per-row constant), the default of :class:`LabelShiftAdapter`. The source priors are those the calibrator was fitted
for: the class frequencies of its calibration data, or the ``priors`` given to its ``fit`` (which
needs a calibrator with a per-class bias: temperature scaling cannot move its posteriors to them).
Without a bias the posteriors need not average to the frequencies either; the adapter and
``torchcal calibrate --target`` warn where they do not
(:func:`warn_unless_calibrated_to_frequencies`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from torchcal._validation import (
    as_tensor,
    check_count,
    check_logits,
    check_logits_and_labels,
    check_priors,
    compute_dtype,
    stacklevel_outside_package,
)
from torchcal.calibrators.affine import AffineCalibration
from torchcal.calibrators.base import Calibrator, check_calibrator, moving_only
from torchcal.distributed import ProcessGroup, all_reduce_, validate_together
from torchcal.fit import ConvergenceWarning, FitRecord

__all__ = ["LabelShiftAdapter", "PriorEstimate", "adapt_to_priors", "estimate_priors", "smoothed_priors"]

# EM steps before the Newton steps: from the source priors they make most of the way where the
# scores are confident, and Newton's first steps there are short (CIFAR-10 ResNet-110: 13 Newton
# steps from the source priors, 1 after ten EM steps; 20 of the CIFAR-100 classes: 16, 8)
_EM_STEPS = 10
# priors below this count as 0: their standard error is NaN, and below it Newton steps may treat them as 0
_BOUNDARY = 1e-6
# the run has converged once the mean log-likelihood is this close to its maximum (the largest entry of
# its gradient is 1 up to round-off): where the likelihood is flat, as for posteriors that carry no
# information, Newton's regularised steps would otherwise wander along it, driven by round-off, to
# the iteration cap. Priors it leaves unsettled then move by sqrt(2 gap / curvature), a tiny
# fraction, sqrt(2 gap N), of their standard error.
_OPTIMAL_GAP = 16 * torch.finfo(torch.float64).eps
# Priors below this that the gradient pushes down when the EM steps alone reach the maximum (EM
# shrinks such a prior by its gradient each step, to 1e-20 in ten steps) are set to 0, where the
# maximum has them: moving a prior x_k whose gradient g_k is below 1 to the others raises L by
# x_k (1 - g_k) to first order.
_VANISHING_PRIOR = 1e-10
# a class at 0 whose gradient is this close to 1 costs no likelihood to move mass to: its data may
# not tell it from a free class (copies of a class's scores, rounded to float32, are not exact
# copies), so it joins the free ones in the search for directions the data leave unidentified
_FLAT_GRADIENT = 1e-6
_ARMIJO = 1e-4  # sufficient decrease: a fraction of the one the gradient predicts
_MAX_HALVINGS = 40  # of the step length, in one line search
_ROUND_OFF = 64 * torch.finfo(torch.float64).eps  # relative, of the objective's value
_RIDGES = (1e-12, 1e-9, 1e-6, 1e-3, 1.0)  # relative to the Hessian's diagonal
# source posteriors whose mean differs from a class's frequency by more than sqrt(2 log(K / this))
# standard errors are not calibrated to the frequencies (warn_unless_calibrated_to_frequencies):
# about this chance of a false alarm among K calibrated classes (3.9 at K = 2, 4.8 at K = 100)
_UNCALIBRATED_FALSE_ALARMS = 1e-3
_CHUNK_ELEMENTS = 1 << 22  # of the (rows, K) posteriors that check forms at a time


class PriorEstimate(NamedTuple):
    """Result of :func:`estimate_priors`.

    ``priors``: (K,) estimated target priors, float64. ``stderr``: (K,) their standard errors from
    the observed information of the target likelihood; they do not include the uncertainty of the
    calibration itself. NaN for priors at the boundary (at most 1e-6), and for every class when
    fewer than two are off it; inf for priors the data leave unidentified (e.g. two classes whose
    posteriors are always proportional, where only the sum of their priors is informed), also where
    one of those is at 0 with nothing in the likelihood to hold it there, and for priors whose
    standard error would exceed 1, the width of the simplex. ``record``: the run: iterations
    (EM and Newton steps), evaluations (passes over the target scores: one per EM step; per Newton
    step one for the gradient, one for the Hessian and one per step length its line search tried),
    the final negative mean log-likelihood ratio against "no shift" (``loss``; <= 0), and
    ``grad_max``, the largest entry of the mean log-likelihood's gradient minus one: 0 at the
    maximum, and by concavity a bound on how far the mean log-likelihood is below it.
    """

    priors: Tensor
    stderr: Tensor
    record: FitRecord


def _source_priors(source_priors: Any, num_classes: int, device: torch.device, name: str = "source_priors",
                   counted: bool = False) -> Tensor:
    """``source_priors`` checked, in float64; ``name`` is what the error messages call them, and
    ``counted`` says they are class frequencies (a class at 0 needs samples, not a prior)."""
    source = check_priors(source_priors, num_classes, device=device)
    zero = (source == 0).nonzero().flatten().tolist()
    if zero:
        which = f"classes {zero} have" if len(zero) > 1 else f"class {zero[0]} has"
        raise ValueError(
            f"{name} must be positive, but {which} 0: posteriors calibrated for a prior of 0 say nothing about "
            "such a class, so they cannot be re-weighted to another; drop it from the scores or "
            + ("add samples of it." if counted else "give it a small positive prior (the calibration data then need samples of it).")
        )
    return source


def adapt_to_priors(logits: Tensor, source_priors: Tensor, target_priors: Tensor) -> Tensor:
    """Posteriors calibrated for ``source_priors`` moved to ``target_priors`` by Bayes' rule.

    Args:
        logits: (N, K) calibrated scores (any unnormalised log-posteriors).
        source_priors: (K,) priors the posteriors are calibrated for (all positive).
        target_priors: (K,) deployment priors; a class at 0 ends at ``exp(-708)``, not at
            probability 0 (whose log, -inf, torchcal's metrics refuse).

    Returns:
        (N, K) log-posteriors ``log_softmax(logits + log(target / source))``, in the input's compute
        dtype (float32 for half precision).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> adapt_to_priors(logits, torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.8])).exp()
        tensor([[0.2000, 0.8000],
                [0.6488, 0.3512]])
    """
    logits = check_logits(logits)
    source = _source_priors(source_priors, logits.shape[1], logits.device)
    target = check_priors(target_priors, logits.shape[1], device=logits.device)
    return _shift(logits, source, target)


def _shift(logits: Tensor, source: Tensor, target: Tensor) -> Tensor:
    """``log_softmax(logits + log(target / source))`` in the compute dtype, without input checks;
    a class of target prior 0 gets the log-posterior ``log(tiny)``, about -708, whatever its
    logit (a logit 720 above the others' had left it at probability 1)."""
    dtype = compute_dtype(logits.dtype)
    absent = target == 0  # (-inf in the softmax, then the floor; at least one prior is positive)
    offset = torch.where(absent, -math.inf, target.to(torch.float64).log() - source.to(torch.float64).log())
    shifted = torch.log_softmax(logits.to(dtype) + offset.to(dtype), dim=1)
    return shifted.masked_fill(absent, math.log(torch.finfo(torch.float64).tiny))  # (finite_log(0))


def smoothed_priors(priors: Any, num_samples: float | Tensor, pseudocount: float = 0.5) -> Tensor:
    """Priors estimated from ``num_samples`` target samples, with ``pseudocount`` samples added to
    every class: ``(N pi + c) / (N + K c)``, (K,).

    The likelihood's maximum (:func:`estimate_priors`) puts a class at exactly 0 wherever the
    target scores are explained without it, also when a few of its samples are there. CIFAR-100
    ResNet-20 logits (``cifar100_resnet20_ferrer``; BCTS fitted on 5,000 rows, the other 5,000
    resampled to 3,000 with Dirichlet(0.5) priors, seeds 1): 16 classes end at 0, 8 of them present
    with 1-16 samples. Posteriors adapted to those priors give such samples about exp(-708) (a
    prior of 0 is floored there, :func:`adapt_to_priors`), losses of 708 nats each: a test
    log-loss of 8.10 against 1.12 calibrated. With the default 0.5 (the Jeffreys prior's count),
    0.87.

    Example:
        >>> smoothed_priors(torch.tensor([0.75, 0.25, 0.0]), 100)
        tensor([0.7438, 0.2512, 0.0049])
    """
    _check_pseudocount(pseudocount)
    given = as_tensor(priors, "priors")
    if given.ndim != 1:
        raise ValueError(f"priors must have shape (K,), one per class, got shape {tuple(given.shape)}.")
    dtype = compute_dtype(given.dtype) if torch.is_floating_point(given) else torch.float64
    # float64, renormalised: N pi overflows half precision, whose priors also sum to 1 only within 1e-3
    given = check_priors(given, given.shape[0])
    if isinstance(num_samples, Tensor):
        count = float(num_samples.detach()) if num_samples.numel() == 1 and not num_samples.is_complex() else math.nan
    else:
        count = float(num_samples) if isinstance(num_samples, numbers.Real) and not isinstance(num_samples, bool) else math.nan
    if not (math.isfinite(count) and count >= 0):
        raise ValueError(
            f"num_samples must be a finite number >= 0 (the number of target samples the priors were "
            f"estimated from), got {num_samples!r}."
        )
    if count == 0 and pseudocount == 0:  # (the limit of N pi / N)
        return given.to(dtype)
    return ((count * given + pseudocount) / (count + pseudocount * given.shape[0])).to(dtype)


def _check_pseudocount(pseudocount: float) -> None:
    if not (pseudocount >= 0 and math.isfinite(pseudocount)):
        raise ValueError(f"pseudocount must be a finite number >= 0, got {pseudocount}.")


def estimate_priors(
    logits: Tensor,
    source_priors: Tensor,
    *,
    max_iter: int = 200,
    tol: float = 1e-8,
    process_group: ProcessGroup | None = None,
) -> PriorEstimate:
    """Maximum-likelihood class priors of unlabelled target data (Saerens et al. 2002).

    With ``a[n, k] = p(k | x_n) / pi_s[k]`` the target likelihood is ``prod_n sum_k a[n, k] pi[k]``.
    Maximised over the simplex by ten EM steps from the source priors and then projected Newton
    steps, which converge quadratically also where EM takes many thousands of steps (see the module
    docstring); the priors of classes absent from the target end at exactly 0. Computed in float64
    on the scores' device.

    Args:
        logits: (N, K) *calibrated* scores of the unlabelled target samples (any unnormalised
            log-posteriors, e.g. a calibrator's output).
        source_priors: (K,) priors the posteriors are calibrated for (all positive).
        max_iter: cap on the steps, EM and Newton together; reaching it issues a
            :class:`~torchcal.fit.ConvergenceWarning`. tol: converged when a full Newton step changes
            no prior by more than this (the error is then about its square), or once the mean
            log-likelihood is within round-off (16 eps) of its maximum, which a flat likelihood
            reaches with priors it cannot settle.
        process_group: data-parallel over a ``torch.distributed`` group: every process passes its
            own shard of the target scores and all get the estimate from the union (per step, K
            sums travel for the gradient, K_f^2 for the Hessian of the K_f classes it moves and
            one per step length tried).

    Returns:
        :class:`PriorEstimate` ``(priors, stderr, record)``.

    Example:
        >>> import torch
        >>> source = torch.tensor([0.5, 0.5])
        >>> posteriors = torch.tensor([[0.9, 0.1]] * 70 + [[0.1, 0.9]] * 30)  # calibrated for source
        >>> estimate = estimate_priors(posteriors.log(), source)
        >>> [round(p, 4) for p in estimate.priors.tolist()], estimate.record.converged
        ([0.75, 0.25], True)
    """
    check_count(max_iter, "max_iter", 1)
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}.")

    def check() -> tuple[Tensor, Tensor]:
        checked = check_logits(logits)
        return checked, _source_priors(source_priors, checked.shape[1], checked.device)

    logits, source = validate_together(check, process_group, logits)
    likelihood = _TargetLikelihood(logits, source, process_group)
    run = _maximise(likelihood, source, max_iter, tol)
    mean_log, gradient = likelihood.value_and_gradient(run.priors)
    free = (run.priors > _BOUNDARY).nonzero().flatten()
    stderr = _standard_errors(likelihood.information(run.priors, free) * likelihood.count, run.priors, free)
    flat = ((run.priors <= _BOUNDARY) & (gradient >= 1 - _FLAT_GRADIENT)).nonzero().flatten()
    if flat.numel():
        classes = torch.cat([free, flat])
        # (free holds a class at least, the priors summing to one: k >= 2)
        _, unidentified = _simplex_variances(likelihood.information(run.priors, classes) * likelihood.count, classes.numel())
        stderr[classes[unidentified]] = math.inf
    record = _record(run, float(mean_log), float(gradient.max()) - 1)
    if not record.converged:
        warnings.warn(f"estimate_priors {record.message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    return PriorEstimate(run.priors, stderr, record)


class _TargetLikelihood:
    """The mean target log-likelihood ``L(pi) = mean_n log(a_n . pi)`` and its derivatives, summed
    over the processes of ``group``; ``a[n, k] = p(k | x_n) / pi_s[k]`` from calibrated ``logits``."""

    def __init__(self, logits: Tensor, source: Tensor, group: ProcessGroup | None) -> None:
        # (detached: a calibrator's output carries its graph, which every step would extend)
        self.ratio = torch.softmax(logits.detach().to(torch.float64), dim=1) / source  # a: (N, K)
        self.group = group
        self.count = float(all_reduce_(torch.tensor([float(logits.shape[0])], dtype=torch.float64, device=logits.device), group))

    def _mixture(self, priors: Tensor) -> Tensor:
        """(N,) ``a_n . pi``, kept away from 0 where it divides."""
        return (self.ratio @ priors).clamp_min(torch.finfo(torch.float64).tiny)

    def value(self, priors: Tensor) -> Tensor:
        """``L(pi)``, a 0-d tensor; -inf where a sample has probability 0."""
        return all_reduce_((self.ratio @ priors).log().sum().reshape(1), self.group)[0] / self.count

    def value_and_gradient(self, priors: Tensor) -> tuple[Tensor, Tensor]:
        """``L(pi)`` and its gradient (K,) ``mean_n a_n / (a_n . pi)``."""
        mixture = self._mixture(priors)
        sums = all_reduce_(torch.cat([mixture.log().sum().reshape(1), self.ratio.T @ (1 / mixture)]), self.group)
        return sums[0] / self.count, sums[1:] / self.count

    def information(self, priors: Tensor, classes: Tensor) -> Tensor:
        """Minus the Hessian of ``L`` over ``classes`` (K_f,), ``mean_n b_n b_n^T`` with
        ``b = a / (a . pi)``, the gradient of one sample's log-likelihood: (K_f, K_f)."""
        scaled = self.ratio[:, classes].div_(self._mixture(priors).unsqueeze(1))  # (in place: indexing copied)
        return all_reduce_(scaled.T @ scaled, self.group) / self.count


class _Run(NamedTuple):
    """What :func:`_maximise` did."""

    priors: Tensor  # (K,), on the simplex
    em_steps: int
    newton_steps: int
    evaluations: int  # passes over the scores
    last_step: float  # the largest change of a prior in the last step
    stopped_by: str | None  # why it stopped short of convergence; None if it converged
    at_optimum: bool  # it converged by the likelihood's gap, not by a short Newton step


def _maximise(likelihood: _TargetLikelihood, source: Tensor, max_iter: int, tol: float) -> _Run:
    """The maximum of the likelihood over the simplex: ``_EM_STEPS`` EM steps from ``source``, then
    projected Newton steps until a full one changes no prior by more than ``tol``; ``max_iter``
    steps in all at most. The EM steps read nothing back from the device; each Newton step a few
    numbers (its set of classes at 0, and its line search's objective values)."""
    priors, step = source, torch.zeros((), dtype=source.dtype, device=source.device)
    em_steps = min(_EM_STEPS, max_iter)
    for _ in range(em_steps):
        updated = _em_step(likelihood, priors)
        priors, step = updated, (updated - priors).abs().max()
    newton_steps, evaluations, at_optimum = 0, em_steps, False
    stopped_by: str | None = f"the iteration cap (max_iter={max_iter})"
    while em_steps + newton_steps < max_iter:
        mean_log, gradient = likelihood.value_and_gradient(priors)
        evaluations += 1
        # the gap of the normalised priors (Newton's iterates sum to one only at the maximum),
        # where the gradient is sum(priors) times this one: by concavity, how far L is below its maximum
        if float(priors.sum() * gradient.max()) - 1 <= _OPTIMAL_GAP:
            stopped_by, at_optimum = None, True
            priors = torch.where((priors.sum() * gradient < 1) & (priors < _VANISHING_PRIOR), 0.0, priors)
            break
        updated, trials, accepted = _projected_newton_step(likelihood, priors, mean_log, gradient)
        priors, step = updated, (updated - priors).abs().max()
        newton_steps, evaluations = newton_steps + 1, evaluations + 1 + trials  # Hessian, trials
        if not accepted:
            stopped_by = "a line search that found no ascent"
            break
        if trials == 1 and float(step) <= tol:
            stopped_by = None
            break
    # Newton's iterates sum to one only at the maximum
    return _Run(priors / priors.sum(), em_steps, newton_steps, evaluations, float(step), stopped_by, at_optimum)


def _record(run: _Run, mean_log: float, gap: float) -> FitRecord:
    """The :class:`FitRecord` of ``run``, whose mean log-likelihood is ``mean_log`` with a largest
    gradient entry of ``1 + gap``; its message says how far a run that stopped short got."""
    steps = f"{run.em_steps} EM and {run.newton_steps} Newton steps"
    gap = max(gap, 0.0)  # (it is >= 0 but for round-off)
    if run.at_optimum:
        message = f"converged: the mean log-likelihood within {gap:.1e} of its maximum after {steps}"
    elif run.stopped_by is None:
        message = f"converged: a full Newton step below tol after {steps}"
    else:
        message = (
            f"stopped at {run.stopped_by} after {steps}: the last step changed a prior by {run.last_step:.1e}, and "
            f"the mean log-likelihood is within {gap:.1e} of its maximum"
        )
    return FitRecord(run.em_steps + run.newton_steps, run.evaluations, -mean_log, gap, run.stopped_by is None, message)


def _em_step(likelihood: _TargetLikelihood, priors: Tensor) -> Tensor:
    """``pi <- pi * grad L(pi)``: the mean of the posteriors adapted to ``pi`` (Saerens et al.)."""
    updated = priors * likelihood.value_and_gradient(priors)[1]
    return updated / updated.sum()  # the sum is 1 up to round-off; keep it exact


def _projected_newton_step(
    likelihood: _TargetLikelihood, priors: Tensor, mean_log: Tensor, gradient: Tensor
) -> tuple[Tensor, int, bool]:
    """One projected Newton step (Bertsekas 1982) on ``f(x) = -L(x) + sum(x)`` over ``x >= 0``,
    whose minimiser is the maximum of ``L`` on the simplex (there the gradient of ``L`` is 1
    wherever ``x > 0``, so ``sum(x) = x . grad L(x) = 1``), from ``priors`` where ``L`` is
    ``mean_log`` with ``gradient``. Coordinates at or near 0 that the gradient pushes down take a
    gradient step and are cut at 0, the others a Newton step. Returns
    :func:`_projected_line_search`'s answer."""
    descent = 1 - gradient  # of f
    # Bertsekas' epsilon shrinks with the distance to optimality, so that the last Newton steps
    # see the classes at 0 as they are at the maximum
    epsilon = (priors - (priors - descent).clamp_min(0)).abs().sum().clamp_max(_BOUNDARY)
    classes = ((priors > epsilon) | (descent <= 0)).nonzero().flatten()
    direction = -descent
    direction[classes] = -_solve_positive_semidefinite(likelihood.information(priors, classes), descent[classes])
    return _projected_line_search(likelihood, priors, float(priors.sum() - mean_log), descent, direction)


def _solve_positive_semidefinite(matrix: Tensor, rhs: Tensor) -> Tensor:
    """``matrix^-1 rhs`` for a positive semi-definite (K, K) ``matrix``, scaled to a unit diagonal
    and regularised by a ridge, the smallest of ``_RIDGES`` that its Cholesky factorisation takes
    (it is singular for classes whose scores are all 0, copies of a class, or fewer samples than
    classes)."""
    scale = matrix.diagonal().clamp_min(torch.finfo(matrix.dtype).tiny).sqrt()
    scaled = matrix / scale.unsqueeze(1) / scale
    identity = torch.eye(len(scale), dtype=matrix.dtype, device=matrix.device)
    for ridge in _RIDGES:
        factor, info = torch.linalg.cholesky_ex(scaled + ridge * identity)
        if int(info) == 0:
            return torch.cholesky_solve((rhs / scale).unsqueeze(1), factor).squeeze(1) / scale
    raise ValueError("the Hessian of the target likelihood is not finite: check the scores.")


def _projected_line_search(
    likelihood: _TargetLikelihood, priors: Tensor, objective: float, descent: Tensor, direction: Tensor
) -> tuple[Tensor, int, bool]:
    """Armijo backtracking along the projection arc ``max(x + t d, 0)``, t = 1, 1/2, ... (Bertsekas
    1982), from ``priors`` where ``f`` is ``objective`` and its gradient ``descent``. Changes of
    ``f`` within round-off count as decreases, so that the last steps are not refused. Returns the
    new point, the number of step lengths tried and whether one was accepted (else the point is
    ``priors``)."""
    slack = _ROUND_OFF * (1 + abs(objective))
    # no prior rises by more than 1 (they lie in [0, 1]): with fewer samples than classes, or copies
    # of a class, the Hessian is singular and the regularised Newton step huge in its null space
    longest = 1 / direction.max().clamp_min(1)
    for halvings in range(_MAX_HALVINGS + 1):
        trial = (priors + longest * 0.5**halvings * direction).clamp_min(0)
        value, predicted = torch.stack([trial.sum() - likelihood.value(trial), descent @ (priors - trial)]).tolist()
        if objective - value >= _ARMIJO * predicted - slack:
            return trial, halvings + 1, True
    return priors, _MAX_HALVINGS + 1, False


def _standard_errors(information: Tensor, priors: Tensor, free: Tensor) -> Tensor:
    """Standard errors (K,) of priors on the simplex from the information matrix ``sum_n g g^T``
    (``g = a / (a . pi)``, the gradient of one sample's log-likelihood) of the ``free`` classes,
    those off the boundary, of which the last prior is one minus the others; NaN for the rest, and
    inf for priors the data leave unidentified (:func:`_simplex_variances`)."""
    stderr = torch.full_like(priors, float("nan"))
    if free.numel() < 2:
        return stderr
    variance, unidentified = _simplex_variances(information, free.numel())
    stderr[free] = torch.where(unidentified, math.inf, variance.sqrt())
    return stderr


def _simplex_variances(information: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The variances (k,) of k >= 2 priors on the simplex from their information (k, k) (summed
    over the samples), in the coordinates of all but the last of them, and which priors the data
    leave unidentified: those a direction of no information moves (e.g. two classes whose
    posteriors are always equal: only their sum is identified; pinv's finite variances would
    claim a precision the data do not have), and those whose standard error exceeds 1, the width
    of the simplex (copies of a class's scores rounded to float32 differ by about 1e-7, whose
    curvature, 1e-14 N, passes a round-off test)."""
    eye = torch.eye(k - 1, dtype=information.dtype, device=information.device)
    jacobian = torch.cat([eye, -torch.ones(1, k - 1, dtype=information.dtype, device=information.device)])
    values, vectors = torch.linalg.eigh(jacobian.T @ information @ jacobian)
    # null relative to the information's own scale too: where no direction is informed, the
    # largest eigenvalue is round-off
    scale = torch.maximum(values.amax(), information.diagonal().amax()).clamp_min(torch.finfo(values.dtype).tiny)
    null = values <= k * torch.finfo(values.dtype).eps * scale
    moved = (jacobian @ vectors[:, ~null]) ** 2 / values[~null]  # (k, directions): each direction's variance
    variance = moved.sum(1)
    unidentified = ((jacobian @ vectors[:, null]).abs() > 1e-8).any(1) | (variance > 1)
    return variance, unidentified


def warn_unless_calibrated_to_frequencies(calibrator: Calibrator, logits: Tensor, labels: Tensor,
                                          process_group: ProcessGroup | None = None) -> None:
    """Warn where ``calibrator``'s posteriors on its calibration data ``logits: (N, K)``, ``labels:
    (N,)`` do not average to the class frequencies, which label shift takes as their source priors.

    Posteriors calibrated for priors ``pi`` average ``pi`` over data drawn with them; a log-loss fit
    with a free per-class bias (BCTS) matches the frequencies exactly. Temperature scaling has no
    bias: on speaker-verification scores with 1.8 % targets its posteriors averaged 11.6 %, and
    the priors estimated on a target with no shift at all were 36 %, 29 standard errors off.
    A class whose mean differs from its frequency by more than ``sqrt(2 log(K / 1e-3))`` standard
    errors of the per-sample differences is named.
    """
    k = logits.shape[1]
    sums = torch.zeros(2, k, dtype=torch.float64, device=logits.device)  # of d = one-hot - q, and of d^2
    step = max(1, _CHUNK_ELEMENTS // k)
    with torch.no_grad():
        for rows, y in zip(logits.split(step), labels.split(step)):
            d = -calibrator(rows).to(torch.float64).exp()
            d[torch.arange(d.shape[0], device=d.device), y] += 1
            sums[0] += d.sum(0)
            sums[1] += d.square().sum(0)
    counts = all_reduce_(torch.cat([torch.bincount(labels, minlength=k).to(sums), sums.flatten()]), process_group)
    counts, sums = counts[:k], counts[k:].view(2, k)
    n = counts.sum()
    spread = (sums[1] - sums[0].square() / n).clamp_min(0).sqrt()
    z = torch.where(spread > 0, sums[0] / spread.clamp_min(1e-300), torch.zeros_like(spread))
    off = (z.abs() > math.sqrt(2 * math.log(k / _UNCALIBRATED_FALSE_ALARMS))).nonzero().flatten().tolist()
    if off:
        worst = int(z.abs().argmax())
        frequency = float(counts[worst] / n)
        others = len(off) - 1 if k > 2 else 0  # (of two classes, both are off by the same)
        warnings.warn(
            f"{type(calibrator).__name__}'s posteriors on its calibration data average "
            f"{frequency - float(sums[0, worst] / n):.4g} for class {worst} against its frequency {frequency:.4g} "
            f"({abs(float(z[worst])):.1f} standard errors"
            + (f"; {others} other class{'es' if others > 1 else ''} differ too" if others else "")
            + "): they are not calibrated to the class frequencies, which the target priors are estimated "
            "against, so the estimate will be biased. A log-loss fit with a free per-class bias matches them "
            "(AffineCalibration, i.e. BCTS, the default; temperature scaling has no bias).",
            UserWarning,
            stacklevel=stacklevel_outside_package(),
        )


class LabelShiftAdapter(nn.Module):
    """A calibrator followed by prior adaptation: calibrated posteriors for the target priors.

    1. :meth:`fit` fits the calibrator on labelled source data (BCTS, i.e.
       :class:`~torchcal.AffineCalibration`, by default) and records the source priors;
    2. :meth:`adapt` sets the target priors: estimated from unlabelled target scores by maximum likelihood, or known
       ones given as ``priors``;
    3. the module maps logits to log-posteriors for the target priors (a plain module: it
       exports with ``torch.export``, but ``CalibratedModel`` takes calibrators only).

    ``estimate_`` holds the last :class:`PriorEstimate`. ``state_dict()`` round trips into a fresh
    adapter around an unfitted calibrator of the same kind.

    Example:
        >>> import torch
        >>> from torchcal.label_shift import LabelShiftAdapter
        >>> gen = torch.Generator().manual_seed(0)
        >>> def sample(priors, n):
        ...     labels = torch.multinomial(torch.tensor(priors), n, replacement=True, generator=gen)
        ...     return torch.randn(n, 3, generator=gen) + 2.5 * torch.eye(3)[labels], labels
        >>> source_logits, source_labels = sample([1 / 3, 1 / 3, 1 / 3], 3000)
        >>> target_logits, _ = sample([0.7, 0.2, 0.1], 3000)  # the labels stay unknown
        >>> adapter = LabelShiftAdapter().fit(source_logits, source_labels).adapt(target_logits)
        >>> [round(p, 1) for p in adapter.target_priors.tolist()]
        [0.7, 0.2, 0.1]
        >>> adapter(target_logits).shape
        torch.Size([3000, 3])
    """

    def __init__(self, calibrator: Calibrator | None = None) -> None:
        super().__init__()
        self.calibrator = AffineCalibration() if calibrator is None else check_calibrator(calibrator)
        self.register_buffer("source_priors", torch.empty(0, dtype=torch.float64))
        self.register_buffer("target_priors", torch.empty(0, dtype=torch.float64))
        self.estimate_: PriorEstimate | None = None

    def fit(self, logits: Tensor, labels: Tensor, *, priors: Tensor | None = None, **fit_options: Any) -> LabelShiftAdapter:
        """Fit the calibrator on labelled source ``logits: (N, K)``, ``labels: (N,)``; ``priors``
        and ``fit_options`` go to its ``fit``. The target priors start as the source priors.

        With ``process_group=`` (a ``fit_options`` entry) every process passes its own shard and all
        end with the adapter of one fit on the union: the source priors are the class frequencies of
        all the shards (the class counts are summed over the group), so a shard may lack classes."""
        group = fit_options.get("process_group")
        logits, labels = validate_together(lambda: check_logits_and_labels(logits, labels), group, logits)
        k = logits.shape[1]
        # checked before the calibrator is refitted, so that a refusal leaves the adapter as it was
        if priors is None:
            counts = all_reduce_(torch.bincount(labels, minlength=k).to(torch.float64), group)
            if float(counts.sum()) == 0:
                raise ValueError("labels is empty (N = 0): the source priors are the class frequencies of at least one sample.")
            source = _source_priors(counts / counts.sum(), k, logits.device, "the class frequencies of labels", counted=True)
            self.calibrator.fit(logits, labels, **fit_options)
            warn_unless_calibrated_to_frequencies(self.calibrator, logits, labels, group)
        else:
            if not self.calibrator._shifts_class_priors():
                raise ValueError(
                    f"{type(self.calibrator).__name__} has no per-class bias, so a fit weighted for priors cannot move "
                    f"its posteriors to them, and the adapter would correct for priors they do not assume. Fit without "
                    f"priors (the source priors are then the class frequencies), or use a calibrator with a bias such as "
                    f"AffineCalibration (BCTS, the default)."
                )
            source = _source_priors(priors, k, logits.device, "priors")
            self.calibrator.fit(logits, labels, priors=priors, **fit_options)
        self.source_priors = source
        self.target_priors = source.clone()
        self.estimate_ = None
        return self

    def adapt(self, target_logits: Tensor | None = None, *, priors: Tensor | None = None, pseudocount: float = 0.5,
              **options: Any) -> LabelShiftAdapter:
        """Set the target priors: estimated from unlabelled ``target_logits: (N, K)`` (raw, uncalibrated
        scores; ``options`` go to :func:`estimate_priors`), or the known ``priors: (K,)``.

        The estimate is used with ``pseudocount`` target samples added to every class
        (:func:`smoothed_priors`, which says why), so that no class the estimate puts at 0 gets
        probability 0; ``estimate_`` keeps the maximum-likelihood priors, and ``pseudocount=0``
        adapts to them as they are.
        """
        _check_pseudocount(pseudocount)
        if self.source_priors.numel() == 0:
            raise RuntimeError("this LabelShiftAdapter is not fitted yet: call .fit(logits, labels) on labelled source data first.")
        if (target_logits is None) == (priors is None):
            raise ValueError("pass exactly one of target_logits (to estimate the target priors) and priors (known ones).")
        if priors is not None:
            self.target_priors = check_priors(priors, self.source_priors.shape[0], device=self.source_priors.device)
            self.estimate_ = None
            return self
        with torch.no_grad():  # (checked on every process of a group at once: none waits alone for one that refused)
            calibrated = validate_together(lambda: self.calibrator(target_logits), options.get("process_group"), target_logits)
        self.estimate_ = estimate_priors(calibrated, self.source_priors, **options)
        count = all_reduce_(torch.tensor([float(calibrated.shape[0])], dtype=torch.float64, device=calibrated.device),
                            options.get("process_group"))[0]
        self.target_priors = smoothed_priors(self.estimate_.priors, count, pseudocount).to(self.source_priors.device)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Moves the priors with the module but keeps them in float64, as the calibrator keeps its
        tensors (``.half()``, Lightning's ``"16-true"``: float16 target priors summed to 0.99988)."""
        return super()._apply(moving_only(fn), recurse)

    def forward(self, logits: Tensor) -> Tensor:
        """Log-posteriors (N, K) for the target priors."""
        if self.source_priors.numel() == 0:
            raise RuntimeError("this LabelShiftAdapter is not fitted yet: call .fit(logits, labels) on labelled source data first.")
        return _shift(self.calibrator(logits), self.source_priors, self.target_priors)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the prior buffers' shapes depend on K: give them the stored shapes before loading
        for name in ("source_priors", "target_priors"):
            stored = state_dict.get(prefix + name)
            if stored is not None:
                setattr(self, name, torch.empty_like(stored, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
