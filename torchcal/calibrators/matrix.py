"""Full linear maps: matrix scaling on logits and Dirichlet calibration on log-posteriors, with the
ODIR and L2 regularisers of Kull et al. (2019) and cross-validated regularisation strength."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from torchcal._validation import check_folds, check_strength, stacklevel_outside_package
from torchcal.calibrators._linear import FullDesign, hand_over_to_lbfgs
from torchcal.calibrators._multinomial import (
    DIVERGING,
    MAX_NEWTON_STEPS,
    TIE_TOLERANCES,
    fit_multinomial_logistic,
    selection_tolerances,
    warn_diverging,
)
from torchcal.calibrators.base import (
    Calibrator,
    finish_lbfgs_with_newton,
    lbfgs_share,
    sample_weights,
    total_samples,
    weighted_loss_sum,
)
from torchcal.calibrators.temperature import inverse_temperature_start
from torchcal.distributed import ProcessGroup, all_reduce_, world_size
from torchcal.fit import (
    ConvergenceWarning,
    FitRecord,
    cross_validate_warm_path,
    fold_indices,
    minimize,
)
from torchcal.functional.scoring import PER_SAMPLE_SCORES, weighted_terms

__all__ = ["DEFAULT_REG_GRID", "DirichletCalibration", "MatrixScaling"]

#: Final fits of L-BFGS (the Brier fits; Newton-CG's fallback) of at most this many parameters, K (K
#: + 1) up to K = 15, end with Newton's method on the exact Hessian (base.finish_lbfgs_with_newton, a pass
#: per parameter per step). L-BFGS's absolute gradient tolerance left Dir-ODIR's Brier fit at
#: lambda = 1e-3 on the CIFAR-10 ResNet-110 logits 4e-7 (relative) above its optimum, weights 1e-2
#: off, reported converged, and in another row order at the iteration cap (a review finding);
#: one or two Newton steps reach gradients of 1e-10.
_MATRIX_NEWTON_FINISH_PARAMETERS = 256

#: Regularisation strengths tried by cross-validation when none is given (mu = lambda). Wide on
#: purpose: the out-of-fold Dir-ODIR loss is lowest at 1e-4 on the AG News GPT-2 logits (K = 4;
#: flat below), at 1 to 10 on the CIFAR-10 logits of ../shared/data/real, at 1e2 to 1e3 on the
#: CIFAR-100 RepVGG-A2, LeNet-5 and VGG-19 ones, and at 1e4 on the CIFAR-100 ResNet-20 ones
#: (1.11937 against 1.12186 at 1e3, the top of an earlier grid; 1.12031 at 1e5). The path visits
#: the strongest penalties first and stops after two rises, so the weak end costs nothing where
#: the loss has turned.
DEFAULT_REG_GRID: tuple[float, ...] = tuple(10.0**e for e in range(-4, 6))
#: L-BFGS's loss change for the cross-validation's fits of a non-convex loss (Brier), selection
#: and tie: as SMS's (structured._TOL_CHANGE). Their log-loss starts use SELECTION_TOLERANCES and
#: TIE_TOLERANCES; the final fit is tight.
_NONCONVEX_TOL_CHANGE = {"selection": 1e-8, "tie": 1e-11}
#: On a GPU the cross-validation fits each grid point's folds together (``cv_together=None``) while
#: one product of a pass over the data, N (K + 1) K multiply-adds, is at most this. The default
#: cross-validated Dir-ODIR fit on an H100, one by one against together (benchmarks/README.md):
#: 1.3-2.9x faster together on the CIFAR-100 logits (10,000 x 100, 1e8) and 1.36x on synthetic
#: 100,000 x 100 (1e9); even at 100,000 x 255 (6.5e9); slower at 1,000,000 x 100 and 10,000 x
#: 1,000 (1e10: 0.83x, 0.63x) and 100,000 x 1,000 (1e11: 0.26x, and 3.3x the memory).
_TOGETHER_MAX_PRODUCT = 2e9
#: Scores of this magnitude are sentinels (a class masked at -1e30 or finfo.min), not evidence:
#: the linear maps carry every feature into every class's score, so each masked row came out
#: one-hot. A fit on them warns (a floor would break the maps' scale equivariance: logits x 100 of
#: a CIFAR-100 network span 5,000).
_SENTINEL = 1e30


#: Iterations of Gilbert's algorithm in :func:`_separating_direction` (one product with the
#: samples each: at most about a second at 10,000 x 100, and only for a class without samples at
#: ODIR's lambda = 0; of 30 leave-one-class-out escapes on CIFAR-10 subsets, 500 certified 29, 2,000 all), and how near the
#: origin its point must come to count as inside their hull.
_GILBERT_STEPS = 2000
_GILBERT_TOL = 1e-9


def _separating_direction(x: Tensor, process_group: ProcessGroup | None = None) -> bool:
    """Whether some ``d`` has ``d . x_i < 0`` for every row of ``x: (N, F)`` (of every process of
    ``process_group``), i.e. the origin lies outside the rows' convex hull (Gordan): Gilbert's
    algorithm walks to the hull's point of least norm ``p`` and stops with a certificate,
    ``x_i . p > 0`` for every row (then ``d = -p``), or once ``p`` is within ``_GILBERT_TOL`` of
    the origin relative to the rows' size (inside, or on the boundary: no strict escape). Within
    ``_GILBERT_STEPS`` steps it answers False where it has no certificate (a hull that only just
    misses the origin). Under a group each step's row of least product is the group's (that of
    the lowest rank among ties, as in the rows concatenated in rank order): three collectives."""
    x = x.to(torch.float64)
    largest = x.norm(dim=1).amax().reshape(1) if x.shape[0] else x.new_zeros(1)
    size = float(all_reduce_(largest, process_group, op="max"))
    if not size > 0:
        return False
    totals = all_reduce_(torch.cat([x.sum(dim=0), x.new_tensor([float(x.shape[0])])]), process_group)
    point = totals[:-1] / totals[-1]
    rank = torch.distributed.get_rank(process_group) if process_group is not None else 0
    for _ in range(_GILBERT_STEPS):
        products = x @ point
        i = int(products.argmin()) if x.shape[0] else 0
        least, row = (float(products[i]), x[i]) if x.shape[0] else (math.inf, x.new_zeros(x.shape[1]))
        if process_group is not None:
            lowest = -float(all_reduce_(x.new_tensor([-least]), process_group, op="max"))
            holder = -int(all_reduce_(x.new_tensor([-rank if least == lowest else -math.inf]), process_group, op="max"))
            least, row = lowest, all_reduce_(row.clone() if rank == holder else torch.zeros_like(row), process_group)
        if least > 0:
            return True
        if float(point.norm()) <= _GILBERT_TOL * size:
            return False
        edge = row - point
        length = float(edge @ edge)
        if length == 0:
            return False
        point = point + min(max(-float(point @ edge) / length, 0.0), 1.0) * edge
    return False


class MatrixScaling(Calibrator):
    """``softmax(W @ logits + b)`` with a full ``W: (K, K)`` and ``b: (K,)``, on raw logits.

    Args:
        reg: ``None``, ``"odir"`` or ``"l2"``. The penalty is added to the mean loss:

            - ODIR (off-diagonal and intercept): ``lambda / (K (K-1)) * sum_{i != j} W_ij^2 +
              mu / K * sum_k b_k^2``; the diagonal is free, so per-class scaling is not penalised
              (but for a class without samples in the fitted data, whose diagonal entry is
              penalised as the others, towards 1: free, the fit drives it to infinity).
            - L2: ``lambda / (K (K+1)) * (sum W^2 + sum b^2)`` (shrinks towards zero).
        reg_lambda, reg_mu: penalty strengths. Left as ``None`` with a regulariser, they are chosen
            by ``cv_folds``-fold cross-validation over ``reg_grid`` (``mu = lambda``, or pairs; a
            given ``reg_mu`` is kept at every grid point). ``reg_mu`` defaults to ``reg_lambda``
            (ODIR only). In a data-parallel fit (``process_group``) each process splits its own
            samples into the folds, so the chosen strengths can differ from a one-process fit's.
            Copies of a sample land in different folds (:func:`torchcal.fit.fold_indices`), where
            they favour weak penalties (CIFAR-10 ResNet-110's validation logits, each row twice:
            Dir-ODIR's lambda 10 -> 1): remove duplicated rows first.
        reg_grid: candidate lambdas, or ``(lambda, mu)`` pairs, or ``{"lambda": [...], "mu": [...]}``
            for every pair of the two lists (Kull et al.'s ODIR search; readable in a config file).
        cv_together: fit the folds of each grid point together, as one batched problem
            (:func:`~torchcal.calibrators._multinomial.fit_multinomial_logistic`): one pass does
            every fold's arithmetic, and the solver's decisions are read back once for all of them.
            ``None`` (the default): on a GPU where the fits are bound by launches and read-backs,
            not arithmetic (``_TOGETHER_MAX_PRODUCT``). Elsewhere the folds one by one are
            faster: a point that trails the best on its first folds is abandoned there
            (:func:`~torchcal.fit.cross_validate_path`), while a batched pass does every fold's
            arithmetic, and the test rows' too (on a CPU 2-2.5x slower at K = 100). Both select
            by the same rules. Log-loss fits in one process only.
        tol: the log-loss fit has converged when the largest absolute entry of the gradient of the
            penalised mean loss is below ``tol``. The default, 1e-9, leaves the loss within about
            1e-11 of its optimum; the parameters along the flat directions of a weak penalty can
            stay further off (1,500 CIFAR-100 RepVGG-A2 rows, Dir-ODIR at lambda = 1e-3: an
            unpenalised diagonal entry of a nearly separable class at 114.2 or 116.0 by the row
            order, posteriors elsewhere up to 0.02 apart, losses 1e-11 apart); 1e-6 takes
            about a third fewer passes, with the loss within 1e-7 of its optimum (CIFAR-100
            ResNet-20, Dir-ODIR at lambda = 1e-4) and the parameters less exact. The
            cross-validation's fits use their own, looser tolerances.

    The log-loss fit is convex (Newton-CG, :mod:`torchcal.calibrators._multinomial`). With
    ``fit(..., loss="brier")`` it is not: the Brier score of a full map has local optima. That fit
    starts from the better of the identity map and the log-loss fit and finds a local optimum
    near it by L-BFGS; ``fit_record_.message`` says so. Logits in the hundreds saturate the Brier
    score's gradient, and those fits can need a larger ``max_iter`` (ten times a ResNet-20's
    CIFAR-10 logits, ODIR at lambda = 0.1: 980 iterations stopped at a gradient of 1e-2, 10,000
    reached the optimum); a fit that stops at the cap warns.

    The map is linear in every score: a class masked in the logits (at -1e30 or
    ``torch.finfo(dtype).min``) reaches every class's calibrated score, and masked rows get
    meaningless posteriors (a fit on such rows warns). Calibrate the unmasked classes, or mask after
    calibrating.

    After fitting, ``reg_lambda_`` / ``reg_mu_`` hold the strengths used and ``cv_losses_`` the
    cross-validated loss of every grid point; ``inf`` marks the points abandoned once they could no
    longer win or trailed the best on the same folds by more than their noise
    (:func:`~torchcal.fit.cross_validate_path`), and the weak penalties not tried because the loss
    had risen at two consecutive points past its best.

    Example:
        >>> import torch
        >>> from torchcal import MatrixScaling
        >>> logits = 3 * torch.randn(2000, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> cal = MatrixScaling(reg="odir", reg_lambda=1e-2).fit(logits, labels)
        >>> cal.fit_record_.converged, cal.weight.shape
        (True, torch.Size([4, 4]))
    """

    weight: Tensor
    bias: Tensor

    def __init__(
        self,
        reg: str | None = None,
        reg_lambda: float | None = None,
        reg_mu: float | None = None,
        reg_grid: Sequence[float | tuple[float, float]] | Mapping[str, Sequence[float]] = DEFAULT_REG_GRID,
        cv_folds: int = 5,
        cv_seed: int = 0,
        tol: float = 1e-9,
        cv_together: bool | None = None,
    ) -> None:
        super().__init__()
        if not 0 < tol < math.inf:
            raise ValueError(f"tol must be a positive finite gradient tolerance, got {tol}.")
        if reg not in (None, "odir", "l2"):
            raise ValueError(f"reg must be None, 'odir' or 'l2', got {reg!r}.")
        if reg is None and (reg_lambda is not None or reg_mu is not None):
            raise ValueError("reg_lambda / reg_mu need a regulariser: pass reg='odir' or reg='l2'.")
        reg_lambda = None if reg_lambda is None else check_strength(reg_lambda, "reg_lambda")
        reg_mu = None if reg_mu is None else check_strength(reg_mu, "reg_mu")
        cv_folds, cv_seed = check_folds(cv_folds, cv_seed, "cv_folds", "cv_seed")
        if reg == "l2" and reg_mu is not None:
            raise ValueError("reg_mu is ODIR's intercept penalty; reg='l2' has one strength, reg_lambda.")
        if isinstance(reg_grid, Mapping):
            if set(reg_grid) != {"lambda", "mu"}:
                raise ValueError(f"reg_grid as a mapping needs exactly the keys 'lambda' and 'mu', got {sorted(reg_grid)}.")
            reg_grid = [(lam, mu) for lam in reg_grid["lambda"] for mu in reg_grid["mu"]]

        def point(g: object) -> float | tuple[float, ...]:  # (a pair: a tuple, a list (YAML's), an array's row)
            if isinstance(g, (tuple, list)) or getattr(g, "ndim", 0) == 1:
                return tuple(check_strength(v, "reg_grid") for v in g)  # type: ignore[attr-defined]
            return check_strength(g, "reg_grid")

        try:
            grid = [point(g) for g in reg_grid]
        except (ValueError, TypeError):
            grid = []
        if not grid or any(isinstance(g, tuple) and len(g) != 2 for g in grid):
            raise ValueError(f"reg_grid must be a non-empty sequence of finite lambdas >= 0 (or (lambda, mu) pairs), got {reg_grid!r}.")
        if reg_mu is not None and any(isinstance(g, tuple) for g in grid):
            raise ValueError("pass reg_mu or (lambda, mu) pairs in reg_grid, not both.")
        if reg == "l2" and any(isinstance(g, tuple) for g in grid):
            raise ValueError("(lambda, mu) pairs set mu, ODIR's intercept penalty; reg='l2' has one strength: give reg_grid as lambdas.")
        self.reg = reg
        self.reg_lambda = reg_lambda
        self.reg_mu = reg_mu
        # mu = lambda at every grid point, unless reg_mu fixes it
        self.reg_grid = [g if isinstance(g, tuple) else (g, g if reg_mu is None else reg_mu) for g in grid]
        self.cv_folds = cv_folds
        self.cv_seed = cv_seed
        self.cv_together = cv_together
        self.tol = tol
        self.reg_: str | None = None  # the regulariser of the fitted (or loaded) map
        self.reg_lambda_: float | None = None
        self.reg_mu_: float | None = None
        self.cv_losses_: list[float] | None = None
        # (K,) the classes without a sample in the data being fitted (see _penalty_weights)
        self._unheld: Tensor | None = None

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        return {"weight": torch.eye(num_classes), "bias": torch.zeros(num_classes)}

    def _unbounded_without_samples(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        # the bias is free without a penalty on it (ODIR's mu, L2's lambda)
        if self.reg is None or (self.reg_mu_ if self.reg == "odir" else self.reg_lambda_) == 0:
            return True
        if self.reg == "odir" and self.reg_lambda_ == 0:  # the classes' rows of W are free
            return self._row_escapes(features, missing, process_group)
        return False

    def _penalised_everywhere(self) -> bool:
        return self.reg == "l2" and bool(self.reg_lambda_)  # (ODIR leaves the diagonal free)

    def _row_escapes(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        """Whether a free row of W (ODIR at lambda = 0) of one of the ``missing`` classes can lower
        that class's scores on every sample, ``d . x_i <= 0`` for all i with some below: then the
        loss falls along ``d`` for ever. Logits need not allow it (where they surround the origin).
        Two sufficient tests. The fitted row's departure from the identity as ``d``: at a finite
        optimum it cannot pass (moving along ``d`` would lower the loss); where the fit ran off
        along the escape it is the way it ran (CIFAR-10 ResNet-110 logits without class 3: the
        row's norm 9,570; 54 of 54 leave-one-class-out fits on six real sets). And
        :func:`_separating_direction` (over every process's samples: a review found it skipped under a
        group, the fit reported converged): the row can also run off along a direction its departure
        does not show (500 CIFAR-10 ResNet-20 rows without class 3: |W_3| = 2.8e5, p_3 of 9e-61 on
        its held-out samples, reported converged; 19 of 30 such fits on CIFAR-10 subsets)."""
        x = features.to(self.weight.dtype)
        rows = self.weight[missing].detach() - torch.eye(self.weight.shape[0], dtype=x.dtype, device=x.device)[missing]
        reach = x @ rows.T  # (N, missing)
        # over every process's samples: some above 0 anywhere, or some below 0 anywhere
        above, below = all_reduce_(torch.stack([(reach > 0).any(0), (reach < 0).any(0)]).to(torch.float64), process_group, op="max")
        if bool(((above == 0) & (below > 0)).any()):
            return True
        return _separating_direction(x, process_group)

    def _scores(self, features: Tensor) -> Tensor:
        return features @ self.weight.to(features.dtype).T + self.bias.to(features.dtype)

    def _theta(self) -> Tensor:
        """The fitted map as one tensor ``[W | b]: (K, K + 1)``, detached."""
        return torch.cat([self.weight, self.bias.unsqueeze(1)], dim=1).detach()

    def _set_theta(self, theta: Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(theta[:, :-1])
            self.bias.copy_(theta[:, -1])

    def _penalty_weights(self, num_classes: int) -> Tensor:
        """The penalty as ``sum(weights * ([W | b] - anchor)^2)`` (:meth:`_penalty_anchor`):
        weights of shape (K, K + 1), float64.

        ODIR leaves the diagonal free, except for a class without a sample in the data being
        fitted (absent from the calibration data, or from a fold's training part): there every
        sample asks for the class's probability to be 0, which the free diagonal gives at
        ``W_kk = inf``. Its diagonal is penalised as the off-diagonal entries are, towards the
        identity's 1 (CIFAR-10 ResNet-20 without class 3 in the calibration data: ``W_kk`` grew to
        1.4e5, the fit reported convergence, and 202 of the 508 test samples of class 3 got
        probability 0, a test log-loss of 6,239; 0.408 with it penalised, Dirichlet-L2 1.17).
        """
        k = num_classes
        weights = torch.zeros(k, k + 1, dtype=torch.float64)
        lam, mu = self.reg_lambda_ or 0.0, self.reg_mu_ or 0.0
        if self.reg == "l2":
            weights[:] = lam / (k * (k + 1))
        elif self.reg == "odir":
            weights[:, :k] = lam / (k * (k - 1))
            weights[:, :k].diagonal().masked_fill_(~self._unheld_classes(k), 0.0)
            weights[:, k] = mu / k
        return weights

    def _penalty_anchor(self, num_classes: int) -> Tensor:
        """What the penalty pulls ``[W | b]`` towards: zero, but the identity's 1 on the diagonal of
        ODIR's classes without samples (see :meth:`_penalty_weights`); (K, K + 1) float64."""
        anchor = torch.zeros(num_classes, num_classes + 1, dtype=torch.float64)
        if self.reg == "odir":
            anchor[:, :num_classes].diagonal().copy_(self._unheld_classes(num_classes).to(torch.float64))
        return anchor

    def _unheld_classes(self, num_classes: int) -> Tensor:
        return self._unheld.cpu() if self._unheld is not None else torch.zeros(num_classes, dtype=torch.bool)

    def _penalty(self) -> Tensor | float:
        if self.reg is None:
            return 0.0
        k = self.weight.shape[0]
        weights = self._penalty_weights(k).to(self.weight.device)
        deviation = torch.cat([self.weight, self.bias.unsqueeze(1)], dim=1) - self._penalty_anchor(k).to(self.weight.device)
        return (weights * deviation.square()).sum()

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        k = features.shape[1]
        n_total = int(total_samples(labels, process_group))
        lowest, highest = torch.aminmax(features, dim=1)
        # (over every process's rows: the warning was the one process's that held them)
        masked = int(all_reduce_(((lowest <= -_SENTINEL) | (highest >= _SENTINEL)).sum(dtype=torch.float64), process_group))
        if masked:
            warnings.warn(
                f"{masked} rows of the calibration scores hold a score of magnitude {_SENTINEL:.0e} or more (a masked "
                f"class?): {type(self).__name__}'s linear map carries it into every class's score, so such rows get "
                "meaningless posteriors. Calibrate without the masked classes, or mask after calibrating.",
                stacklevel=stacklevel_outside_package(),
            )
        if self.reg is None and n_total < k * (k + 1):
            warnings.warn(
                f"{n_total} samples for {k * (k + 1)} unregularised parameters: the fit "
                f"will over-fit; use reg='odir'.",
                stacklevel=stacklevel_outside_package(),
            )
        if self._at_identity():
            with torch.no_grad():
                self.weight.mul_(inverse_temperature_start(features, labels, weights, process_group))
        # (this fit's selection, or none: a fixed-strength refit had kept an earlier fit's, or a loaded state's)
        self.reg_, self.reg_lambda_, self.reg_mu_, self.cv_losses_ = self.reg, None, None, None
        if self.reg is not None and self.reg_lambda is None:
            cold = self._theta()
            self.cv_losses_, start = self._cross_validate_grid(features, labels, weights, loss, max_iter, process_group)
            best = min(range(len(self.reg_grid)), key=self.cv_losses_.__getitem__)
            self.reg_lambda_, self.reg_mu_ = self.reg_grid[best]
            # The final fit starts where the folds ended, near its optimum, unless their fits went
            # astray (classes missing from small training parts: on 300 CIFAR-100 rows an objective
            # of 4e4 there against 1.2 at the identity, where the final fit then stopped at its cap).
            warm = self._objective(start, features, labels, weights, loss, process_group)
            self._set_theta(start if warm <= self._objective(cold, features, labels, weights, loss, process_group) else cold)
        elif self.reg is not None:
            self.reg_lambda_ = self.reg_lambda
            self.reg_mu_ = self.reg_lambda if self.reg_mu is None else self.reg_mu
        return self._fit_fixed_penalty(features, labels, weights, loss, max_iter, process_group)

    def _objective(self, theta: Tensor, features: Tensor, labels: Tensor, weights: Tensor | None, loss: str,
                   process_group: ProcessGroup | None) -> float:
        """The fit's objective at ``[W | b] = theta``: the weighted mean ``loss`` plus the penalty
        at the current strengths (as :meth:`_fit_fixed_penalty` minimises it); leaves ``theta`` set."""
        k = features.shape[1]
        sample_w = sample_weights(labels, weights, process_group)
        self._unheld = _unheld(labels, sample_w, k, process_group)
        self._set_theta(theta)
        with torch.no_grad():
            data = all_reduce_(self._data_term(features, labels, sample_w, loss), process_group)
        penalty = self._penalty_weights(k).to(theta) * (theta - self._penalty_anchor(k).to(theta)).square()
        return float(data + penalty.sum())

    def _fit_fixed_penalty(
        self, features, labels, weights, loss, max_iter, process_group=None, tol_grad: float | None = None,
        tol_decrease: float | None = None, tol_change: float | None = None,
    ) -> FitRecord:
        if loss != "log":
            return self._fit_nonconvex(features, labels, weights, loss, max_iter, process_group, tol_grad, tol_decrease, tol_change)
        k = features.shape[1]
        sample_w = sample_weights(labels, weights, process_group)
        self._unheld = _unheld(labels, sample_w, k, process_group)
        anchor = self._penalty_anchor(k).to(features.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # (its cap's: see below)
            theta, record = fit_multinomial_logistic(
                features, labels, sample_w, self._theta() - anchor, self._penalty_weights(k),
                tol_grad=self.tol if tol_grad is None else tol_grad, tol_decrease=tol_decrease,
                max_iter=min(max_iter, MAX_NEWTON_STEPS), process_group=process_group, anchor=anchor,
            )
        theta = theta + anchor
        # Newton-CG stalled (degenerate curvature) or at its own cap: the L-BFGS driver goes on from
        # its point with the rest of the fit's cap. Not where the fit diverges (no finite optimum):
        # L-BFGS would only run to its own cap.
        diverging = record.message.startswith(DIVERGING)
        if not record.converged and not diverging:
            if bool(torch.isfinite(theta).all()):  # (Newton-CG's point, its best)
                self._set_theta(theta)
            return hand_over_to_lbfgs(record, lambda cap: Calibrator._fit(self, features, labels, weights, loss, cap, process_group),
                                      max_iter, type(self).__name__)
        if diverging:
            record = warn_diverging(record, "use reg='odir' or reg='l2'")
        self._set_theta(theta)
        return record

    def _fit_log_loss(self, features, labels, weights, max_iter, process_group=None, tol_grad=None, tol_decrease=None) -> FitRecord:
        return self._fit_fixed_penalty(features, labels, weights, "log", max_iter, process_group, tol_grad, tol_decrease)

    def _fit_lbfgs(self, features, labels, weights, loss, max_iter, process_group=None, tol_change=None) -> FitRecord:
        """:meth:`Calibrator._fit_lbfgs` (the Brier fits, and Newton-CG's fallback) in coordinates
        scaled by the square root of each entry's curvature at the start: the (Gauss-Newton)
        diagonal of the data term's Hessian plus the penalty's. Unscaled, a strong ODIR penalty
        (lambda / (K (K - 1)) on each off-diagonal weight, the diagonal free) stopped the selection
        fits on a small change of the loss far from their optimum: Brier on 2,000 rows of the
        CIFAR-10 ResNet-20 logits, lambda = 1e5, 1e-3 above it, the out-of-fold scores 1.4 % low,
        and lambda = 1e5 chosen where converged fits choose 1e3; the final fits at lambda >= 1e4
        ran to the 1,000-iteration cap at gradients of 1e-3."""
        k = features.shape[1]
        sample_w = sample_weights(labels, weights, process_group)
        penalty, anchor = self._penalty_weights(k).to(features.device), self._penalty_anchor(k).to(features.device)
        with torch.no_grad():
            q = torch.softmax(self._scores(features), dim=1).to(torch.float64)
            curvature = all_reduce_(_curvature_diagonal(q, sample_w, features.to(torch.float64), loss), process_group) + 2 * penalty
            finite = torch.isfinite(curvature)  # (not where features of 1e200 overflow: unscaled there)
            floor = 1e-12 * torch.where(finite, curvature, 0.0).amax() + torch.finfo(torch.float64).tiny
            scale = torch.where(finite, torch.maximum(curvature, floor), 1.0).sqrt()
        phi = (self._theta().to(torch.float64) * scale).requires_grad_(True)
        penalty_share = 1.0 / world_size(process_group)

        def objective_at(theta: Tensor) -> Tensor:
            scores = torch.addmm(theta[:, k].to(features.dtype), features, theta[:, :k].to(features.dtype).T)
            return weighted_loss_sum(scores, labels, sample_w, loss) + penalty_share * (penalty * (theta - anchor).square()).sum()

        def gradient() -> Tensor:  # in [W | b], not in the scaled coordinates
            theta = (phi.detach() / scale).requires_grad_(True)
            return torch.autograd.grad(objective_at(theta), theta)[0]

        finish = tol_change is None and phi.numel() <= _MATRIX_NEWTON_FINISH_PARAMETERS
        # (Newton keeps a part of the cap: L-BFGS met it in one row order, see above)
        record = minimize(lambda: objective_at(phi / scale), [phi], max_iter=lbfgs_share(max_iter) if finish else max_iter,
                          tol_change=1e-12 if tol_change is None else tol_change, loose=tol_change is not None,
                          process_group=process_group, gradient=gradient, warn=not finish)
        theta = (phi.detach() / scale).requires_grad_(True)
        if finish:  # (in [W | b], whose gradient the record gives)
            record = finish_lbfgs_with_newton(lambda: objective_at(theta), [theta], record, max_iter, process_group)
        self._set_theta(theta.detach())
        return record

    def _cross_validate_grid(self, features, labels, weights, loss, max_iter, process_group=None) -> tuple[list[float], Tensor]:
        """Out-of-fold loss of every grid point along the warm-started path of
        :func:`~torchcal.fit.cross_validate_warm_path` (``inf`` for the points it abandoned), and
        the folds' mean ``[W | b]`` at the best point (a start for the final fit).

        Fits are solved to ``SELECTION_TOLERANCES`` (and ``_NONCONVEX_TOL_CHANGE``; on small
        problems to ``TIE_TOLERANCES``, see ``selection_tolerances``): the selection only compares
        losses, and near-ties are fitted again to ``TIE_TOLERANCES``; the final fit is tight.
        """
        order = sorted(range(len(self.reg_grid)), key=lambda i: tuple(-v for v in self.reg_grid[i]))
        per_sample = PER_SAMPLE_SCORES[loss]
        # (the rows of all the processes: each must solve to the same tolerances)
        rows = int(float(total_samples(labels, process_group)) * (self.cv_folds - 1) / self.cv_folds)
        selection = selection_tolerances(rows, features.shape[1], self.num_classes)
        folds, trains = [], []
        for test in fold_indices(labels, self.cv_folds, self.cv_seed, process_group=process_group, scores=features):
            test = test.to(features.device)
            train = torch.ones_like(labels, dtype=torch.bool)
            train[test] = False
            trains.append(train)
            folds.append((features[train], labels[train], features[test], labels[test], copy.deepcopy(self)))

        def test_loss(fold: int) -> Tensor:
            """The (weighted) loss of the fold's model on each of its test samples."""
            _, _, test_x, test_y, model = folds[fold]
            with torch.no_grad():
                return weighted_terms(per_sample(torch.log_softmax(model._scores(test_x), dim=1), test_y), test_y, weights)

        def fit_fold(point: int, fold: int, start: Tensor | None, tight: bool) -> tuple[Tensor, Tensor]:
            train_x, train_y, _, _, model = folds[fold]
            model.reg_lambda_, model.reg_mu_ = self.reg_grid[point]
            if start is not None:
                model._set_theta(start)
            tolerances = TIE_TOLERANCES if tight else selection
            tol_change = _NONCONVEX_TOL_CHANGE["tie" if tight else "selection"]
            model._fit_fixed_penalty(train_x, train_y, weights, loss, max_iter, process_group, **tolerances, tol_change=tol_change)
            return test_loss(fold), model._theta()

        def fit_folds(point: int, starts: list[Tensor | None], tight: bool) -> tuple[list[Tensor], list[Tensor]]:
            """Every fold's fit at once: one batched problem on all the rows, each fold's weights
            zero on its test rows. Where it does not converge, the folds one by one."""
            thetas, penalties, anchors = [], [], []
            fold_w = features.new_zeros(labels.shape[0], len(folds), dtype=torch.float64)
            for fold, ((_, train_y, _, _, model), train, start) in enumerate(zip(folds, trains, starts)):
                model.reg_lambda_, model.reg_mu_ = self.reg_grid[point]
                if start is not None:
                    model._set_theta(start)
                fold_w[train, fold] = sample_weights(train_y, weights)
                model._unheld = _unheld(train_y, fold_w[train, fold], k)
                anchors.append(model._penalty_anchor(k).to(features.device))
                thetas.append(model._theta() - anchors[-1])
                penalties.append(model._penalty_weights(k))
            anchor = torch.stack(anchors)
            tolerances = TIE_TOLERANCES if tight else selection
            theta, record = fit_multinomial_logistic(
                features, labels, fold_w, torch.stack(thetas), torch.stack(penalties), anchor=anchor,
                tol_grad=tolerances["tol_grad"], tol_decrease=tolerances.get("tol_decrease"), max_iter=min(max_iter, MAX_NEWTON_STEPS),
            )
            if not record.converged:
                results = [fit_fold(point, fold, starts[fold], tight) for fold in range(len(folds))]
                return [loss for loss, _ in results], [theta for _, theta in results]
            for (*_, model), fitted in zip(folds, theta + anchor):
                model._set_theta(fitted)
            return [test_loss(fold) for fold in range(len(folds))], [model._theta() for *_, model in folds]

        k = features.shape[1]
        if self.cv_together is None:
            together = features.device.type != "cpu" and features.shape[0] * (k + 1) * k <= _TOGETHER_MAX_PRODUCT
        else:
            together = self.cv_together
        together = together and loss == "log" and process_group is None
        names = [f"{type(self).__name__} lambda = {lam:g}, mu = {mu:g}" for lam, mu in self.reg_grid]
        # The path stops once the loss has risen at two points in a row: right along one strength,
        # wrong across a grid of (lambda, mu) pairs, whose path starts each lambda at its largest
        # mu. There (a lambda with several mus) every point is visited; the race still prunes.
        lambdas = [lam for lam, _ in self.reg_grid]
        patience = len(lambdas) if len(set(lambdas)) < len(lambdas) else 2
        return cross_validate_warm_path(order, lambdas, len(folds), fit_fold, labels.shape[0], process_group,
                                        patience=patience, point_names=names, fit_folds=fit_folds if together else None)

    def get_extra_state(self):
        return {**super().get_extra_state(), "reg": self.reg_, "reg_lambda_": self.reg_lambda_, "reg_mu_": self.reg_mu_,
                "cv_losses_": self.cv_losses_}

    def set_extra_state(self, state) -> None:
        """The fitted regulariser and strengths; the constructor's options (``reg``, ``reg_lambda``,
        ``reg_grid``), which a later ``fit`` uses, stay as built."""
        super().set_extra_state(state)
        self.reg_ = state.get("reg")
        self.reg_lambda_, self.reg_mu_ = state.get("reg_lambda_"), state.get("reg_mu_")
        self.cv_losses_ = state.get("cv_losses_")

    def extra_repr(self) -> str:
        strengths = f", lambda={self.reg_lambda_:g}, mu={self.reg_mu_:g}" if self.reg_lambda_ is not None else ""
        reg = f"reg={self.reg_ if self.is_fitted else self.reg!r}" + strengths
        return reg + ", " + super().extra_repr()


def _curvature_diagonal(q: Tensor, sample_w: Tensor, features: Tensor, loss: str) -> Tensor:
    """The diagonal (K, K + 1) in ``[W | b]`` of the weighted data term's Hessian under the log
    loss, or its Gauss-Newton part ``2 J^T J`` under the Brier score (``J = dq/ds``), at the
    posteriors ``q: (N, K)`` of ``features: (N, K)``."""
    if loss == "log":
        return FullDesign().hessian_diagonal(q, sample_w, features).view(q.shape[1], -1)
    squares = q.square()  # (J^T J)_kk = sum_c q_c^2 (delta_ck - q_k)^2
    per_class = 2 * squares * ((1 - q).square() + squares.sum(1, keepdim=True) - squares)
    return FullDesign().gram_diagonal(sample_w.unsqueeze(1) * per_class, features)


def _unheld(labels: Tensor, sample_w: Tensor, num_classes: int, process_group: ProcessGroup | None = None) -> Tensor:
    """(K,) the classes without weight in the data being fitted (see ``_penalty_weights``)."""
    held = torch.zeros(num_classes, dtype=sample_w.dtype, device=labels.device).index_add_(0, labels, sample_w)
    return all_reduce_(held, process_group) == 0


class DirichletCalibration(MatrixScaling):
    """``softmax(W @ log_softmax(logits) + b)``: Dirichlet calibration (Kull et al. 2019).

    A K-dimensional logistic regression on the log-posteriors (the Dirichlet sufficient
    statistics). Same parameters and regularisers as :class:`MatrixScaling`; ``reg="odir"`` is
    Dir-ODIR, ``reg="l2"`` Dir-L2. The full ``W`` is penalised (no reference row).

    Example:
        >>> import torch
        >>> from torchcal import DirichletCalibration
        >>> logits = 3 * torch.randn(2000, 4)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> cal = DirichletCalibration(reg="odir").fit(logits, labels)  # lambda by 5-fold CV
        >>> cal.reg_lambda_ in [lam for lam, mu in cal.reg_grid]
        True
    """

    def _row_escapes(self, features: Tensor, missing: list[int], process_group: ProcessGroup | None = None) -> bool:
        # the class's row of W, free, times log-posteriors (all negative) drives its scores down
        # on every sample: W_k = t 1, t -> inf
        return True

    def _features(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits, dim=1)
