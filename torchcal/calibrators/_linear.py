"""Newton fits of the calibration maps that are linear in their parameters.

Affine calibration, vector scaling and matrix scaling (and Dirichlet calibration, on log-posterior
features) compute the scores of sample ``i`` as ``s_i = J_i @ theta`` for a per-sample Jacobian
``J_i: (K, P)`` built from its features ``x_i``: they are multinomial logistic regressions with a
structured design. Under the (weighted) mean log-loss,

- gradient: ``sum_i w_i J_i^T (q_i - e_{y_i})``
- Hessian: ``sum_i w_i J_i^T (diag(q_i) - q_i q_i^T) J_i``

with ``q_i = softmax(s_i)``. A design only has to say how to form the scores, the products
``J_i^T v_i`` and the weighted Gram term ``sum_i J_i^T diag(v_i) J_i``; the rank-one part is one
matrix product. The structured Hessian costs a few passes over the data, so Newton converges in
under ten iterations where L-BFGS needs hundreds on these badly scaled problems (a shared scale
next to K biases, per-class scales of very different curvature).

Everything is accumulated in float64: a float32 Hessian halves the matrix-product cost but its
rounding swamps the small eigenvalues of weakly regularised full maps, and the steps go astray.
The one exception is the affine map's bias block, a graph Laplacian, which float32 sums leave
within a relative 1e-6 of itself (:meth:`AffineDesign.hessian`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from torchcal.calibrators.base import sample_weights
from torchcal.distributed import ProcessGroup, world_size
from torchcal.fit import FitRecord, newton, warn_unconverged

__all__ = [
    "AffineDesign", "BinaryLogisticDesign", "FullDesign", "LinearDesign", "VectorDesign", "after_newton", "finish_newton",
    "fit_linear_newton", "hand_over_to_lbfgs", "newton_stalled",
]

# Rows per chunk are chosen so that the (rows, max(P, K)) temporaries stay below this many elements.
_CHUNK_ELEMENTS = 1 << 21
# On a CPU, around this many (a megabyte each in float64): an evaluation's dozen elementwise passes
# then run from cache, not memory (one thread, 10,000 x 100: VectorScaling 0.40 -> 0.18 s, SVS's
# Newton 0.29 -> 0.17 s). A chunk keeps at least 2 P rows, as every chunk adds its share to the
# P x P Hessian (affine calibration at K = 1,000 took twice as long with 131 rows per chunk).
_CPU_CHUNK_ELEMENTS = 1 << 17


class LinearDesign:
    """How a linear calibration map acts: ``theta: (P,)`` and features ``x: (n, K)``."""

    def num_parameters(self, num_classes: int) -> int:
        raise NotImplementedError

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        """``J_i @ theta`` for every row: (n, K)."""
        raise NotImplementedError

    def project(self, v: Tensor, x: Tensor) -> Tensor:
        """``J_i^T v_i`` for every row of ``v: (n, K)``: (n, P)."""
        raise NotImplementedError

    def project_sum(self, v: Tensor, x: Tensor) -> Tensor:
        """``sum_i J_i^T v_i``: (P,), without forming ``project(v, x)``."""
        raise NotImplementedError

    def gram(self, v: Tensor, x: Tensor) -> Tensor:
        """``sum_i J_i^T diag(v_i) J_i``: (P, P)."""
        raise NotImplementedError

    def hessian(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """The log-loss Hessian ``sum_i w_i J_i^T (diag(q_i) - q_i q_i^T) J_i``: (P, P), for the
        posteriors ``q: (n, K)`` and sample weights ``w: (n,)``."""
        projected = self.project(q, x)
        return self.gram(w.unsqueeze(1) * q, x) - projected.T @ (w.unsqueeze(1) * projected)

    def hessian_diagonal(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """The diagonal (P,) of :meth:`hessian`; designs whose Hessian is costly form it alone."""
        return self.hessian(q, w, x).diagonal()


class AffineDesign(LinearDesign):
    """``s = a * x + b``: ``theta = [a, b_1 .. b_K]``."""

    def num_parameters(self, num_classes: int) -> int:
        return num_classes + 1

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        return torch.addcmul(theta[1:], x, theta[:1])

    def project(self, v: Tensor, x: Tensor) -> Tensor:
        return torch.cat([torch.linalg.vecdot(v, x).unsqueeze(1), v], dim=1)

    def project_sum(self, v: Tensor, x: Tensor) -> Tensor:
        return torch.cat([torch.dot(v.flatten(), x.flatten()).reshape(1), v.sum(0)])

    def gram(self, v: Tensor, x: Tensor) -> Tensor:
        vx = v * x
        corner, edge = torch.dot(vx.flatten(), x.flatten()).reshape(1, 1), vx.sum(0).unsqueeze(1)
        return torch.cat([torch.cat([corner, edge.T], dim=1), torch.cat([edge, torch.diag(v.sum(0))], dim=1)])

    def hessian(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """The biases' block is ``diag(M 1) - M`` for ``M = sum_i w_i q_i q_i^T``, a graph
        Laplacian: formed from M's row sums, its null direction (a constant added to every bias)
        is exact, and M, whose entries are all non-negative, is summed in float32, the N K^2
        product that dominates the fit at K = 1,000 (twice as fast as in float64). A relative
        error e in every entry keeps the block within (1 +- e) of itself in Loewner order, so
        Newton's steps lose nothing measurable (e is about 1e-6 here)."""
        wq = w.unsqueeze(1) * q
        mean_x = torch.linalg.vecdot(q, x)  # (n,): each row's posterior mean of x
        corner = torch.dot(wq.flatten(), x.square().flatten()) - torch.dot(w * mean_x, mean_x)
        edge = (wq * (x - mean_x.unsqueeze(1))).sum(0)
        q32 = q.float().clamp_(min=torch.finfo(torch.float32).tiny)  # no subnormals: they slow the product
        m = ((w.float().unsqueeze(1) * q32).T @ q32).to(q.dtype)
        m = (m + m.T) / 2
        biases = torch.diag(m.sum(1)) - m
        return torch.cat([torch.cat([corner.reshape(1, 1), edge.unsqueeze(0)], dim=1), torch.cat([edge.unsqueeze(1), biases], dim=1)])

    def hessian_diagonal(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """The scale's entry ``sum_i w_i var_{q_i}(x_i)`` and the biases' ``sum_i w_i q_i (1 - q_i)``,
        from two (n, K) buffers (every evaluation forms it: at 50,000 x 1,000 six buffers took a
        quarter of the fit)."""
        qx = q * x
        mean_x = qx.sum(1)
        corner = w @ torch.linalg.vecdot(qx, x).sub_(mean_x.square())
        return torch.cat([corner.reshape(1), w @ torch.addcmul(q, q, q, value=-1)])


class VectorDesign(LinearDesign):
    """``s = w * x + b``: ``theta = [w_1 .. w_K, b_1 .. b_K]``."""

    def num_parameters(self, num_classes: int) -> int:
        return 2 * num_classes

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        k = x.shape[1]
        return torch.addcmul(theta[k:], x, theta[:k])

    def project(self, v: Tensor, x: Tensor) -> Tensor:
        return torch.cat([v * x, v], dim=1)

    def project_sum(self, v: Tensor, x: Tensor) -> Tensor:
        return torch.cat([(v * x).sum(0), v.sum(0)])

    def gram(self, v: Tensor, x: Tensor) -> Tensor:
        vx = v * x
        d_ww, d_wb, d_bb = torch.diag((vx * x).sum(0)), torch.diag(vx.sum(0)), torch.diag(v.sum(0))
        return torch.cat([torch.cat([d_ww, d_wb], dim=1), torch.cat([d_wb, d_bb], dim=1)])

    def hessian(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """The rank part ``sum_i w_i u_i u_i^T`` of ``u_i = [q_i x_i, q_i]`` as its three distinct
        K x K blocks (three quarters of the products of the (2K)^2 one)."""
        qx, wq = q * x, w.unsqueeze(1) * q
        wqx = wq * x
        d_ww, d_wb, d_bb = torch.diag((wqx * x).sum(0)), torch.diag(wqx.sum(0)), torch.diag(wq.sum(0))
        ww, wb, bb = d_ww - wqx.T @ qx, d_wb - wqx.T @ q, d_bb - wq.T @ q
        return torch.cat([torch.cat([ww, wb], dim=1), torch.cat([wb.T, bb], dim=1)])

    def hessian_diagonal(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        c = torch.addcmul(q, q, q, value=-1)  # q (1 - q), one buffer for all of it
        biases = w @ c
        return torch.cat([w @ c.mul_(x).mul_(x), biases])


class FullDesign(LinearDesign):
    """``s = W @ x + b``: ``theta = [W | b]`` of shape (K, K + 1), flattened row-major."""

    def num_parameters(self, num_classes: int) -> int:
        return num_classes * (num_classes + 1)

    @staticmethod
    def _augmented(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        k = x.shape[1]
        w = theta.view(k, k + 1)
        return torch.addmm(w[:, k], x, w[:, :k].T)

    def project(self, v: Tensor, x: Tensor) -> Tensor:
        return (v.unsqueeze(2) * self._augmented(x).unsqueeze(1)).flatten(1)

    def project_sum(self, v: Tensor, x: Tensor) -> Tensor:
        return (v.T @ self._augmented(x)).flatten()

    def gram(self, v: Tensor, x: Tensor) -> Tensor:
        xa = self._augmented(x)
        return torch.block_diag(*torch.einsum("nk,na,nb->kab", v, xa, xa))

    def gram_diagonal(self, v: Tensor, x: Tensor) -> Tensor:
        """The diagonal of :meth:`gram`, ``sum_i v_ik [x_i, 1]_a^2``, as (K, K + 1)."""
        return v.T @ self._augmented(x).square()

    def hessian_diagonal(self, q: Tensor, w: Tensor, x: Tensor) -> Tensor:
        return self.gram_diagonal(w.unsqueeze(1) * q * (1 - q), x).flatten()


class BinaryLogisticDesign(LinearDesign):
    """Binary scores ``[0, theta_0 + x_1 theta_1 + x_2 theta_2]`` on two features ``x: (n, 2)``
    (logistic regression with an intercept; two features, as ``fit_linear_newton`` one-hot
    encodes the labels as wide as the features): quadratic scaling's ``[llr, llr^2]``, beta
    calibration's ``[log q1, -log q0]``. ``theta = [intercept, coefficients]``."""

    @staticmethod
    def _basis(x: Tensor) -> Tensor:
        return torch.cat([x.new_ones(x.shape[0], 1), x], dim=1)

    def num_parameters(self, num_classes: int) -> int:
        return 3

    def scores(self, x: Tensor, theta: Tensor) -> Tensor:
        return torch.stack([torch.zeros_like(x[:, 0]), self._basis(x) @ theta], dim=1)

    def project(self, v: Tensor, x: Tensor) -> Tensor:
        return v[:, 1:] * self._basis(x)

    def project_sum(self, v: Tensor, x: Tensor) -> Tensor:
        return v[:, 1] @ self._basis(x)

    def gram(self, v: Tensor, x: Tensor) -> Tensor:
        basis = self._basis(x)
        return basis.T @ (v[:, 1:] * basis)


def _softmax_(scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``softmax(scores)``, in place, and ``log_softmax(scores)[i, labels[i]]`` (n,), for scores
    (n, K): one exponential per entry, where log_softmax and then exp took two (float64's exp is
    the costliest of a Newton evaluation's passes)."""
    top = scores.amax(dim=1, keepdim=True)
    shifted_label = (scores.gather(1, labels.unsqueeze(1)) - top).squeeze(1)
    q = scores.sub_(top).exp_()
    total = q.sum(dim=1, keepdim=True)
    return q.div_(total), shifted_label - total.squeeze(1).log()


def fit_linear_newton(
    design: LinearDesign,
    features: Tensor,
    labels: Tensor,
    weights: Tensor | None,
    theta: Tensor,
    penalty: Tensor | None = None,
    *,
    max_iter: int = 100,
    tol_grad: float = 1e-10,
    process_group: ProcessGroup | None = None,
) -> tuple[Tensor, FitRecord]:
    """Newton's method for ``softmax(design.scores(features, theta))`` under the (weighted) mean
    log-loss plus ``sum(penalty * theta^2)``.

    Args:
        design: the map's structure. features: (N, K) float64. labels: (N,).
        weights: optional (K,) per-class weights. theta: (P,) starting point.
        penalty: optional (P,) non-negative weights of the quadratic penalty.
        process_group: data-parallel fit over a ``torch.distributed`` group.

    Returns:
        The fitted ``theta`` (P,) and a :class:`FitRecord`. One that did not converge comes without
        a warning: the caller goes on with L-BFGS from there, or warns (:func:`warn_unconverged`).
    """
    n, k = features.shape
    sample_w = sample_weights(labels, weights, process_group)
    # Each process adds this share of the penalty, so the group's sum counts it once.
    penalty = torch.zeros_like(theta) if penalty is None else penalty / world_size(process_group)
    width = max(theta.numel(), k)
    rows = max(1, _CHUNK_ELEMENTS // width)
    if features.device.type == "cpu":
        rows = min(rows, max(_CPU_CHUNK_ELEMENTS // width, 2 * theta.numel()))
    chunks = [slice(start, start + rows) for start in range(0, n, rows)]
    # The gradient is sum_i w_i J_i^T (q_i - e_{y_i}); the label part does not depend on theta.
    label_part = sum(
        design.project_sum(sample_w[c].unsqueeze(1) * F.one_hot(labels[c], k).to(features.dtype), features[c]) for c in chunks
    )

    def derivatives(theta: Tensor) -> tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]:
        loss = (penalty * theta.square()).sum()
        grad = 2 * penalty * theta - label_part
        curvature = 2 * penalty
        posteriors = []
        for c in chunks:
            x, w = features[c], sample_w[c]
            q, log_q_label = _softmax_(design.scores(x, theta), labels[c])
            loss -= w @ log_q_label
            grad += design.project_sum(w.unsqueeze(1) * q, x)
            curvature = curvature + design.hessian_diagonal(q, w, x)
            posteriors.append(q)

        def hessian() -> Tensor:
            hess = torch.diag(2 * penalty)
            for c, q in zip(chunks, posteriors):
                hess += design.hessian(q, sample_w[c], features[c])
            return (hess + hess.T) / 2

        return loss, grad, curvature, hessian

    def objective(theta: Tensor) -> Tensor:
        loss = (penalty * theta.square()).sum()
        for c in chunks:
            log_q = torch.log_softmax(design.scores(features[c], theta), dim=1)
            loss -= sample_w[c] @ log_q.gather(1, labels[c].unsqueeze(1)).squeeze(1)
        return loss

    return newton(derivatives, objective, theta, max_iter=max_iter, tol_grad=tol_grad, process_group=process_group, warn=False)


def newton_stalled(record: FitRecord, max_iter: int) -> bool:
    """Whether a :func:`fit_linear_newton` fit stopped unconverged short of the fit's ``max_iter``
    (degenerate curvature, or Newton's own cap of fewer iterations): the L-BFGS driver takes over
    from Newton's point, with what is left of the cap (:func:`after_newton`). One that used up
    ``max_iter`` keeps its point."""
    return not record.converged and record.iterations < max_iter


def finish_newton(record: FitRecord, keep_point: Callable[[], None], lbfgs: Callable[[int], FitRecord], max_iter: int,
                  name: str) -> FitRecord:
    """The end of a :func:`fit_linear_newton` fit that the L-BFGS driver backs up: where the loss is
    not finite, ``lbfgs(max_iter)`` from the start; else Newton's point (``keep_point()``), and
    :func:`hand_over_to_lbfgs`."""
    if not math.isfinite(record.loss):
        return lbfgs(max_iter)
    keep_point()
    return hand_over_to_lbfgs(record, lbfgs, max_iter, name)


def hand_over_to_lbfgs(record: FitRecord, lbfgs: Callable[[int], FitRecord], max_iter: int, name: str) -> FitRecord:
    """A Newton(-CG) fit whose point the caller kept: where it stopped unconverged short of
    ``max_iter`` (:func:`newton_stalled`), ``lbfgs`` goes on from it with what is left; else its
    record (:func:`warn_unconverged`)."""
    if newton_stalled(record, max_iter):
        return after_newton(record, lbfgs(max_iter - record.iterations))
    return warn_unconverged(record, name)


def after_newton(newton_record: FitRecord, rest: FitRecord) -> FitRecord:
    """The record of a fit that L-BFGS finished (``rest``) from where Newton stalled."""
    return FitRecord(newton_record.iterations + rest.iterations, newton_record.evaluations + rest.evaluations, rest.loss,
                     rest.grad_max, rest.converged, f"{rest.message} (after Newton: {newton_record.message})")
