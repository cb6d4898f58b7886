"""Newton-CG for multinomial logistic regression with a diagonal quadratic penalty.

Matrix scaling and Dirichlet calibration (and any structured variant that is a full linear map of
some features) minimise

    ``f(theta) = sum_i w_i CE(softmax(theta @ [x_i, 1]), y_i) + sum(penalty * theta^2)``

over ``theta = [W | b]: (K, F + 1)``. With K = 100 that is 10,100 parameters: too many for a dense
Hessian, and badly conditioned enough that L-BFGS needs thousands of passes. Two facts make a
truncated Newton method converge in a few dozen passes whatever the penalty:

- **The softmax ignores a constant added to every class's score.** ``theta + 1 v^T`` has the same
  data term for every ``v: (F + 1,)``, so the data Hessian is singular along those directions and
  only the penalty (of order lambda) holds them: this is what makes L-BFGS crawl as lambda
  shrinks. The solver works on the class-centred part ``C`` of ``theta`` (columns summing to 0)
  and sets the free shift exactly, column by column, to the ``v`` minimising the penalty; the
  remaining problem has no flat direction the penalty must resolve.
- **Each class's row of theta has curvature close to its own diagonal Hessian block**
  ``sum_i w_i q_ik (1 - q_ik) x_i x_i^T + 2 diag(penalty_k)``: conjugate gradients preconditioned
  by these K blocks (of size (F+1)^2) solve the Newton system in a few dozen Hessian-vector
  products. The blocks are formed from the rows that carry most of each class's curvature (the
  largest ``q_ik (1 - q_ik)``) and a sample of the others, about one pass's worth of arithmetic.
  (A Kronecker-factored preconditioner, feature second moments times the softmax covariance, is
  cheaper but needs ten times as many products here: the curvature of class k is concentrated on
  the rows whose features say "maybe k", which a product of averages cannot represent.) Above
  ``_MAX_BLOCK_SIZE`` features the blocks cost more than they save; so too where the penalty is
  strong (``_STRONG_PENALTY``).
  There each block is replaced by its diagonal about the class's curvature-weighted mean row plus
  that mean as a rank-one term, which one pass's arithmetic forms from every row and Sherman and
  Morrison's formula inverts: the mean is where most of a block's weight lies (the features'
  common offsets, and the bias, whose column is constant). From ``_MIN_LOW_RANK_BLOCK_SIZE``
  features (K = 1,000) the blocks are formed again, as their top rows exactly plus that diagonal
  and mean of the other rows, inverted by Woodbury's identity (``_LowRankBlocks``): under half
  the passes. With the blocks, each Newton step's CG also reuses the last step's conjugate
  directions, as an L-BFGS update of the blocks (``_RECYCLED_PAIRS``): they carry the coupling
  between classes that the blocks miss.

Every Hessian-vector product costs the same two matrix products as a gradient (one pass; in
float32, as CG only solves the Newton systems to a relative 1e-4 at best), and so do the
gradients and losses far from the optimum (``_FLOAT32_TOL_GRAD``). The work stays on the data's
device; each conjugate-gradient step reads one number back to the host (its residual), each
Newton step a few: on an H200, reading CG's tests back only every 2, 4 or 8 steps wasted more
passes (the steps between a test met and its read-back) than the synchronisations cost
(benchmarks/README.md, "GPU: how often CG reads back").
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from torchcal._fast_exp import exp_floor
from torchcal._validation import stacklevel_outside_package
from torchcal.distributed import ProcessGroup, all_reduce_, least_across, world_size
from torchcal.fit import STALL_GRAD, ConvergenceWarning, FitRecord

__all__ = [
    "DIVERGING",
    "MAX_NEWTON_STEPS",
    "SELECTION_TOLERANCES",
    "TIE_TOLERANCES",
    "fit_multinomial_logistic",
    "selection_tolerances",
    "warn_diverging",
]

_log = logging.getLogger(__name__)

#: Cross-validation (Dir-/MS-ODIR, SMS) solves every grid point to a gradient of 1e-4 (the final fit
#: to 1e-9). Against 1e-5 (which had saved 17 % of the passes of 1e-6), 1e-4 takes 10-28 % less
#: time on the four CIFAR-100 sets of ../shared/data/real and the synthetic benchmark (Dir-ODIR,
#: RepVGG-A2: 13.4 -> 9.7 s) and selects the same lambda on all five. It moves out-of-fold losses
#: by up to 3e-5 (relative) against converged fits, so the points within fit._TIE (relative) of the
#: best are fitted again to TIE_TOLERANCES and their losses decide: a near-tie is not settled by
#: the loose fits' error. (On those five sets the runner-up was at least 8e-4 behind, and nothing
#: was fitted again.)
#: The selection fits also go on until a Newton step decreased the objective by less than 1e-4. A
#: weak penalty's fit, warm-started from the stronger one's, can meet the gradient tolerance far
#: from its optimum along directions only the penalty curves. At 100,000 x 1,000 (an H200, grid
#: 100, 1, 0.01) the three points' loose out-of-fold losses came out equal to 1e-6 (13.490717), so
#: all three were near-ties fitted again tightly (13.48, 20.34, 24.62); at 10,000 x 300, lambda = 1
#: after 100 scored 1.71 on its first fold against 2.36 with this test. The CIFAR-100 sets take
#: 0-18 % more passes (mean 5 %) for the same selections; 1e-5 took 4-27 % more.
SELECTION_TOLERANCES: dict[str, float] = {"tol_grad": 1e-4, "tol_decrease": 1e-4}
#: ... or, where every parameter is penalised (SMS, L2), until the objective's gap to its optimum
#: is certified below this share of tol_decrease: the penalty ``sum p theta^2`` makes the objective
#: strongly convex, so the gap is at most ``sum g^2 / (4 p)`` for its gradient ``g``. Warm-started
#: on the regularisation path near their optimum, SMS's selection fits met the gradient tolerance
#: after one Newton step that decreased the objective by 1e-3, and a second step only confirmed
#: it (by 1e-8 to 2e-6; the bound after the first: 5e-11 to 4e-7). The default cross-validated
#: SMS fit at 10,000 x 1,000 (one thread): 144 -> 105 s, 33 selection fits of 2 Newton steps ->
#: 25 of 1 and 8 of 2, the same lambda. (The next step's decrease as the preconditioner predicts it,
#: ``g.M^-1 g / 2``, also covers Dir- and MS-ODIR, whose diagonal is free; but the per-class
#: blocks miss the coupling of the nearly flat directions: MS-ODIR at K = 200 stopped 5e-5 from
#: its optimum on a prediction below 1e-5, an out-of-fold loss 1.3e-2 off.)
_CERTIFIED_GAP_SHARE = 0.1
TIE_TOLERANCES: dict[str, float] = {"tol_grad": 1e-7}
#: Up to this many multiply-adds per pass (rows x features x classes) the selection fits are
#: solved to TIE_TOLERANCES: there they take milliseconds, and small folds are where nearly
#: separable directions (an unpenalised diagonal entry of Dir-ODIR growing from 2.2 to 71 while
#: the loss falls by 4e-4) leave the loose fits far from their optima, the out-of-fold losses up
#: to 24 % off and the selection another than the exhaustive grid's (5 of 24 subsets of 500-800
#: CIFAR-10 rows; none with these tolerances). CIFAR-100 at 1,000-2,000 rows: 0.4-0.5 s -> 0.6-0.8 s.
_TIGHT_SELECTION_MAX_PRODUCT = 2e7


def selection_tolerances(rows: int, features: int, classes: int) -> dict[str, float]:
    """The tolerances of the cross-validation's selection fits of a problem of this size."""
    return TIE_TOLERANCES if rows * (features + 1) * classes <= _TIGHT_SELECTION_MAX_PRODUCT else SELECTION_TOLERANCES


#: Newton steps before a fit falls back to L-BFGS. At K = 1,000 (CG stopped where the objective
#: stops decreasing) a converging fit took 100 steps with the plain diagonal preconditioner, 68
#: with the rank-one one (10,000 samples, lambda = 1000).
MAX_NEWTON_STEPS = 300
#: An unpenalised fit stops as diverging once its parameters' norm grew by a factor of more than
#: _DIVERGING_GROWTH in each of the last two spans of _DIVERGING_SPAN Newton steps: without a
#: penalty, (nearly) separable data have no finite optimum, and Newton-CG follows the separating
#: directions for ever. Nearly separable data may have one far out, which the test cannot tell
#: from none (5,000 rows of the CIFAR-10 VGG-19 logits: at a parameter norm of 1.9e4), so the
#: message says both. Converging unpenalised fits settle within a span: the CIFAR-10 ResNet-110
#: validation logits (Dirichlet, 5,000 x 10) in 8 steps, the norm within 0.02 % from step 6 on.
#: On the CIFAR-100 ResNet-20 logits (Dirichlet, 10,000 x 100) it grew 4,957 -> 18,036 -> 27,758
#: at steps 10, 20 and 30 and to 2e7 at step 46, the loss near 0.634 falling by about 5e-5 a
#: step, and the fit ran to its 300-step cap (then L-BFGS to its own: 12 CPU-minutes in all).
_DIVERGING_SPAN = 10
_DIVERGING_GROWTH = 1.1
#: The start of the message of the record of a fit stopped as diverging.
DIVERGING = "diverging"
#: Without a penalty, the Newton systems of over-parametrised or nearly separable fits are nearly
#: singular: CG's direction grows along their flat directions until the line search cuts it to
#: 1e-5 to 1e-8 of its length, or CG runs to its cap (unpenalised matrix scaling of 3,000 x 500
#: synthetic logits: 212 s, most of it L-BFGS run to its cap after Newton-CG's line search failed;
#: 10,000 x 1,000: still at a loss of 0.24 after 20 minutes). After a Newton step the line search
#: cut below _DAMPING_AFTER_CUT, or whose CG ran to its cap, an unpenalised fit's systems get
#: Levenberg's damping ``H + delta I``: delta at least _DAMPING_SHARE times the gradient's norm (so
#: it vanishes at an optimum), 4 times more after each further such step, 4 times less after each
#: full one. Other fits are unchanged: a damping after any cut (a first step's 1/2) doubled the
#: passes of some converging fits of real CIFAR-10 logits, and one after CG's long (not capped)
#: solves stopped the CIFAR-100 LeNet-5 fit (10,000 rows, 10,100 parameters) 1.6e-4 higher.
_DAMPING_AFTER_CUT = 0.125
_DAMPING_SHARE = 0.1
#: Rows per class (those of largest curvature) that form its preconditioner block: ``8 N / (F+1)``,
#: so that forming the K blocks costs about four passes' arithmetic, and at least this many.
_BLOCK_ROWS_PER_FEATURE = 8
_MIN_BLOCK_ROWS = 64
#: The share of those rows drawn at random from the class's other rows, with probability
#: proportional to their curvature and weighted by the other rows' total curvature over the
#: draws: an unbiased estimate of the part of the block that the top rows, which alone
#: underestimate it, miss where the curvature is spread over many rows. Dir- and MS-ODIR over the
#: lambda grid on the four CIFAR-100 sets (80 fits, one thread): 11,137 -> 10,147 passes, 162 ->
#: 139 s, fits within 100 passes 44 -> 57 (LeNet-5 1,793 -> 899 passes, at lambda = 100 108 ->
#: 30; VGG-19 2,911 -> 2,487; ResNet-20 3,057 -> 3,171 and RepVGG-A2 3,376 -> 3,590 at the same
#: time, the weak penalties' path noise). Synthetic 50,000 x 100: Dir-ODIR at 1e-3 37 -> 27
#: passes, 3.2 -> 2.4 s; MS-ODIR at 1e-4 47 -> 29, 3.2 -> 2.6 s. (Measured with an earlier draw
#: by torch.multinomial, which takes at most 2^24 rows: 9,915 passes, 9,806 with other draws; a
#: share of 0.4, or draws in proportion to curvature times the row's squared norm, 10,219 and
#: 10,524; every row drawn, none from the top: ResNet-20 at 1e-4 795 -> 2,080, LeNet-5 128 -> 57.)
_DRAWN_ROW_SHARE = 0.25
#: The ridge of the low-rank blocks (:class:`_LowRankBlocks`), relative to their top rows'
#: diagonal: it bounds the capacitance matrices' condition by about its inverse.
_LOW_RANK_RIDGE = 1e-3
#: Elements of the temporaries (classes x rows x features) while forming the blocks.
_CHUNK_ELEMENTS = 1 << 24
_MAX_CG_STEPS = 250
#: Largest block (F + 1) for which the per-class blocks are formed and factorised. Their cost,
#: K (F+1)^3 / 3 flops and K (F+1)^2 floats per Newton step, is a fraction of a pass at K = 100;
#: at K = 300 (Dir-ODIR, 5,000 samples, lambda = 1) they made the fit 5.6x slower than their
#: diagonals for no fewer passes (1,581 against 1,485: formed from 8 N / (F+1) = 132 rows, they
#: missed the other rows' part, which :class:`_LowRankBlocks` adds back as its diagonal and mean),
#: and at K = 1,000 they take 8 GB and hours. Above this size CG is preconditioned by their
#: diagonals plus a rank-one term (see _STRONG_PENALTY), from every row at the cost of one pass,
#: or by the low-rank blocks (_MIN_LOW_RANK_BLOCK_SIZE).
_MAX_BLOCK_SIZE = 256
#: Smallest block (F + 1) for which a single-process fit that cannot form the blocks forms them as
#: :class:`_LowRankBlocks`; between the two sizes CG has the rank-one preconditioner alone. The
#: low-rank blocks' rows, about 8 N K floats, are read twice per CG step, a share of a Hessian
#: product of about 160 / (F + 1): synthetic 10,000 x 1,000, Dir-ODIR at lambda = 1000, 1,055 ->
#: 434 passes and 558 -> 328 s (one thread), at lambda = 1 1,819 -> 838 passes; MS-ODIR at 1000
#: 1,910 -> 827 passes, 1,041 -> 539 s; 5,000 x 300 fewer passes (143 -> 98 at lambda = 1000,
#: 265 -> 214 at 1) in more time (4.9 -> 6.7 s, 8.6 -> 14.5 s).
_MIN_LOW_RANK_BLOCK_SIZE = 512
#: Where twice the penalty is at least this share of the data's curvature on the median penalised
#: entry (at the start of a fit), CG is preconditioned by the blocks' diagonals plus their
#: classes' mean rows (rank one), formed in one pass instead of eight and never factorised. Dir-ODIR
#: at 10,000 x 100 (passes and seconds, blocks -> rank one; the share in brackets): CIFAR-100
#: ResNet-20 lambda = 1e4 (3.1) 58 -> 44, 1.32 -> 0.46 s; 1e3 (0.31) 57 -> 59, 1.28 -> 0.66 s;
#: RepVGG-A2 1e2 (0.17) 50 -> 49, 1.16 -> 0.62 s; LeNet-5 1e3 (0.71) 83 -> 46, 1.63 -> 0.58 s.
#: Below 0.1 the blocks' coupling pays: ResNet-20 1e2 (0.031) 72 -> 110 passes, LeNet-5 1e2 (0.071)
#: 106 -> 130, ResNet-20 10 (0.0031) 75 -> 297 (1.50 -> 2.62 s). (The blocks' diagonals alone,
#: used here before: 63 passes at ResNet-20 1e5 where the rank-one term needs 32, and 6,016 at 1.)
_STRONG_PENALTY = 0.1
#: CG steps per decade of residual reduction above which a fit leaves the rank-one preconditioner
#: for the blocks (where they fit), from its next Newton step on: forming the blocks costs about
#: ten Hessian products at K = 100, and CG needs 3-4 steps per decade with them. The penalty's share
#: does not tell every case: MS-ODIR on the CIFAR-100 VGG-19 logits at lambda = 100 (share above
#: _STRONG_PENALTY) took 352 passes on the rank-one preconditioner (40 CG steps per decade)
#: against 54 on the blocks; the fits it suits take 4-10 per decade.
_RANK_ONE_STEPS_PER_DECADE = 12.0
#: A fit to this gradient or a looser one (cross-validation's selection fits, warm-started near
#: their optimum) keeps its blocks from one Newton step to the next while CG needs at most
#: _RANK_ONE_STEPS_PER_DECADE steps per decade with them. The default cross-validation on the
#: CIFAR-100 logits: 12-15 % less time, the same selections (ResNet-20 3.9 -> 3.4 s, VGG-19 6.6 ->
#: 5.7 s). Kept without that check, the cold-started fits of a weak-penalty grid took 5x longer;
#: kept in tight fits, ResNet-20 at lambda = 1e-4 took 611 -> 888 passes.
_KEEP_BLOCKS_TOL_GRAD = 1e-4
#: Any fit keeps its blocks for the next Newton step while CG needed at most this many steps per
#: decade with them: at 10,000 x 100 forming them (one float32 or float64 batched product of
#: K x 8N/(F+1) x (F+1)^2) costs about as much as four passes, more than the Newton step's CG.
#: On one thread: synthetic matrix scaling 1.13 -> 0.61 s (48 -> 43 passes), Dir-ODIR at lambda =
#: 1e-3 0.93 -> 0.63 s (36 -> 42); CIFAR-100 ResNet-20 Dir-ODIR at 1e-3 4.9 -> 4.0 s, VGG-19 at 10
#: 1.90 -> 1.66 s (the same 119 passes); ResNet-20 at 1e-2 and MS-ODIR at 1e-3 2-5 % slower (199
#: -> 223, 187 -> 231 passes), LeNet-5 and the cross-validation unchanged. Kept whenever CG is not
#: slow (at most _RANK_ONE_STEPS_PER_DECADE), ResNet-20 at 1e-4 took 12.1 -> 16.5 s.
_KEEP_STEPS_PER_DECADE = 5.0
#: With the per-class blocks, CG is preconditioned by them updated, L-BFGS fashion, with up to
#: this many of the last Newton step's conjugate directions p and their products Hp (Morales and
#: Nocedal 2000, "automatic preconditioning by limited memory quasi-Newton updating"): the blocks
#: miss the coupling between classes, and the previous solve has already found the directions
#: where it matters; the Hessian changes little from one Newton step to the next near the
#: optimum. Spread evenly over the solve (every other one dropped when 2x this many are held).
#: One thread, 10,000 x 100, passes (seconds) without -> with: CIFAR-100 ResNet-20 Dir-ODIR at
#: lambda = 1e-4 1,112 -> 795 (12.1 -> 9.7 s), 1e-3 360 -> 288 (4.10 -> 3.74 s), 1e-2 223 -> 198,
#: MS-ODIR 1e-3 231 -> 176 (3.06 -> 2.57 s), VGG-19 Dir-ODIR at 10 119 -> 95 (1.91 -> 1.39 s),
#: LeNet-5 at 1e-2 118 -> 113; the synthetic benchmark's matrix scaling 43 -> 52 (0.62 -> 0.67 s),
#: where the first Newton steps move far. Used only after long solves, or only for tight systems,
#: it lost most of the gains on the real logits; with the rank-one preconditioner it costs passes
#: (5,000 x 300, lambda = 1: 265 -> 413), so it is not used there. (The pairs take 4 K (F+1)
#: _RECYCLED_PAIRS floats at most: 32 MB for the dense blocks, 320 MB at K = 1,000.)
_RECYCLED_PAIRS = 10
#: A Newton system is solved loosely (far from the optimum) when its forcing term is at least
#: this. Then the per-class blocks are summed in float32, and with the rank-one preconditioner CG
#: checks the objective at its iterate every _CHECK_EVERY steps (near the optimum the objective's
#: changes are round-off).
_LOOSE_FORCING = 0.1
_CHECK_EVERY = 8
#: CG's relative residual at least: the round-off of the float32 Hessian products.
_MIN_FORCING = 1e-4
#: CG steps with float32 Hessian products after which a fit goes on with float64 ones: a safety net
#: for a solve stalled by their round-off that the sign test in newton_direction misses. The longest
#: solves of converging fits took 105 steps on the real CIFAR-100 logits, 98 at K = 1,000.
_FLOAT32_CG_STEPS = 200
#: A fit on float64 features computes its gradients and losses on their float32 copy (the one the
#: Hessian products use), in half the time, until the gradient is below this, and in float64 from
#: there on: a fit to this tolerance or a looser one (cross-validation's selection fits) runs on
#: float32 passes alone. Their losses are summed in float64: summed in float32, the loss's round-off
#: (about 1e-7) let the Armijo test pass steps that only rode on it, and one fold fit of the
#: CIFAR-100 VGG-19 cross-validation crawled at a gradient of 1.2e-4 for 20 steps (449 passes; 15
#: on float64 passes). Where large scores leave the float32 softmax few digits, the gradient's
#: round-off can exceed this tolerance: a step that the line search cuts short while its predicted
#: decrease is near the float32 loss's round-off ends the float32 passes (a strong-penalty fit:
#: 6,339 passes -> 25). Dir-ODIR on the ResNet-20 logits, lambda = 1e5 ... 1e-4: 6-25 % less time
#: for about the same passes (1e-4: 714 -> 669 passes, 9.7 -> 7.7 s).
_FLOAT32_TOL_GRAD = 1e-4
#: The ridges, relative to a block's largest diagonal entry, that a numerically indefinite block
#: gets in turn; past the last, Cholesky's own error is raised.
_RIDGES = (1e-6, 1e-4, 1e-2)


def warn_diverging(record: FitRecord, advice: str) -> FitRecord:
    """The record of a fit stopped as :data:`DIVERGING`, its message ending in ``advice``, with a
    warning that says so. The caller keeps it: an L-BFGS fallback would only chase the infimum."""
    record = dataclasses.replace(record, message=f"{record.message}: {advice}")
    warnings.warn(f"Newton-CG stopped: {record.message}", ConvergenceWarning, stacklevel=stacklevel_outside_package())
    return record


def _forcing(grad_norm: float, previous: tuple[float, float] | None, floor: float) -> float:
    """Relative residual to which CG solves a Newton system: Eisenstat and Walker's (1996)
    choice 2, ``0.9 (|g_k| / |g_k-1|)^1.618`` with their safeguard, at most 0.5, and at least
    ``floor``.

    It asks for as much accuracy as the last Newton step turned into progress. Where Newton
    converges only linearly (the nearly separable fits of weak penalties, whose loss has
    exponential tails), a tight solve buys nothing; there it halved the passes against the
    usual ``min(0.5, sqrt(|g|))`` (real CIFAR-100, Dir-ODIR at lambda = 1e-3: 663 -> 335;
    5,000 x 300 at lambda = 1: 1,586 -> 897), while well-posed fits take about as many.
    ``floor`` keeps the last step from being solved tighter than the stopping test needs
    (Kelley 1995: a residual of half the tolerance).
    """
    if previous is None:
        return min(0.5, max(floor, math.sqrt(grad_norm)))
    previous_norm, previous_forcing = previous
    forcing = 0.9 * (grad_norm / previous_norm) ** 1.618
    safeguard = 0.9 * previous_forcing**1.618
    if safeguard > 0.1:  # a forcing term may not fall much faster than the last one
        forcing = max(forcing, safeguard)
    return min(0.5, max(floor, forcing))


def _float32_products_are_ieee(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` round to float32 only. Users (Lightning's
    advice among them) often allow TF32 or bfloat16 products instead, whose 1e-3 would be the
    Newton steps' accuracy. PyTorch 2.9 and later keep the setting per backend ("none": not set,
    the generic one applies); the legacy getter raises where both APIs were used."""
    backend = torch.backends.cuda.matmul if device.type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(backend, "fp32_precision", None)
    if precision is None:
        return torch.get_float32_matmul_precision() == "highest"
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision in ("none", "ieee")


def _cholesky_with_ridges(blocks: Tensor) -> Tensor:
    """Cholesky factors of ``blocks: (B, n, n)`` float64 that failed to factorise as they are:
    positive definite, but left numerically indefinite by the round-off of float32 rows (raw
    logits 100 times too large: eigenvalues of -6e-9 times the largest, below 1e-6 of the mean
    diagonal). Each gets the ridges ``_RIDGES`` in turn, relative to its largest diagonal entry,
    until it factorises; past the last, Cholesky's own error is raised."""
    factor = torch.empty_like(blocks)
    pending = torch.arange(blocks.shape[0], device=blocks.device)
    largest = blocks.diagonal(dim1=1, dim2=2).amax(1, keepdim=True)
    for rung, ridge in enumerate(_RIDGES):
        retry = blocks[pending]
        retry.diagonal(dim1=1, dim2=2).add_(ridge * largest[pending])
        if rung == len(_RIDGES) - 1:  # beyond round-off: torch's error says what is wrong
            factor[pending] = torch.linalg.cholesky(retry)
            break
        chol, info = torch.linalg.cholesky_ex(retry)
        factor[pending] = chol
        if not bool(info.any()):
            break
        pending = pending[info != 0]
    return factor


def _block_rows(curvature: Tensor, m: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rows and weights (m, K) each from which every class's block is summed: per class (a column
    of ``curvature: (N, K)``, which is overwritten) the rows of largest curvature, with their
    curvature as weights, and ``_DRAWN_ROW_SHARE`` of ``m`` drawn with replacement from the other
    rows in proportion to their curvature, each weighted by the other rows' total over the draws
    (``generator``: on the rows' device)."""
    drawn = max(1, int(_DRAWN_ROW_SHARE * m))
    top_weight, top_index = curvature.topk(m - drawn, dim=0, sorted=False)
    # drawn by inverting the other rows' cumulative curvature (torch.multinomial takes at most
    # 2^24 rows); a class whose curvature the top rows hold entirely draws rows of zero weight
    cumulative = curvature.scatter_(0, top_index, 0.0).T.cumsum(1)  # (K, N)
    total = cumulative[:, -1:]
    uniform = torch.rand(curvature.shape[1], drawn, generator=generator, device=curvature.device, dtype=curvature.dtype)
    drawn_index = torch.searchsorted(cumulative, uniform * total).clamp_(max=curvature.shape[0] - 1).T
    drawn_weight = (total.T / drawn).expand(drawn, -1)
    return torch.cat([top_weight, drawn_weight]), torch.cat([top_index, drawn_index])


class _ClassBlocks:
    """The per-class diagonal Hessian blocks ``sum_i w_i q_ik (1 - q_ik) x_i x_i^T + 2 diag(penalty_k)``
    of one fit, formed from ``8 N / D`` rows per class (``_BLOCK_ROWS_PER_FEATURE``; those of
    largest curvature and a sample of the others, :func:`_block_rows`) and Cholesky-factorised.

    The factors (K, D, D) go into one buffer that every Newton step reuses (at K = 1,000 they are
    8 GB), and the classes' rows are gathered into one buffer too: a fresh one of 64 MB (10,000 x
    100) costs more in page faults than the copy itself.
    """

    def __init__(self) -> None:
        self.factor = torch.empty(0, dtype=torch.float64)
        self.gathered = torch.empty(0)
        self.generator: torch.Generator | None = None  # the rows' draws: the same fit, the same draws

    def factorise(self, source: Tensor, w: Tensor, q: Tensor, penalty: Tensor, loose: bool,
                  process_group: ProcessGroup | None) -> Callable[[Tensor], Tensor]:
        """Form and factorise the blocks, a few classes at a time; returns the solve
        ``r -> (B_k^{-1} r_k)_k`` for ``r: (K, D)``.

        Args:
            source: (N, D) the features ``[x_i, 1]`` whose rows are summed.
            w: (N,) the sample weights (or (N, B), see :func:`_curvature`) and ``q: (N, K)`` the
                posteriors, in the passes' precision.
            penalty: (K, D) float64, added twice to the diagonals.
            loose: the Newton system is solved loosely (``source`` is then the float32 copy).

        For a ``loose`` Newton system the sums run in ``source``'s precision, in half the time,
        about each class's weighted mean row (added back as a rank-one term in float64), so that
        the features' large common offsets (log-probabilities near -10) cost the float32 sums no
        digits: a tenth to a fifth less time per fit at 10,000 x 100, the same passes. Near the
        optimum float32 sums would miss the small eigenvalues of nearly singular blocks that weak
        penalties leave (CIFAR-100 ResNet-20 at lambda = 1e-4: 611 -> 716 passes with float32
        blocks throughout; 611 with them for loose systems only). On float32 passes every system
        counts as loose: float32 rows summed as they are lost the nearly singular blocks of weak
        penalties to round-off (CIFAR-100 ResNet-20, lambda = 1e-3 from the 1e-2 fit: Cholesky
        failed even with the stronger ridge), and float64 rows cost a tenth more time in the
        cross-validation.
        """
        n, d = source.shape
        curvature = _curvature(w, q)
        k = curvature.shape[1]
        m = min(n, max(_MIN_BLOCK_ROWS, _BLOCK_ROWS_PER_FEATURE * n // d))
        if m < n:
            if self.generator is None:
                self.generator = torch.Generator(device=source.device).manual_seed(0)
            row_weight, index = _block_rows(curvature, m, self.generator)
        else:
            row_weight, index = curvature, torch.arange(n, device=source.device).unsqueeze(1).expand(n, k)
        if self.factor.shape != (k, d, d) or self.factor.device != source.device:
            self.factor = torch.empty(k, d, d, dtype=torch.float64, device=source.device)
        factor = self.factor
        step = max(1, _CHUNK_ELEMENTS // (d * max(m, d)))
        shape = (min(step, k) * m, d)
        if self.gathered.shape != shape or self.gathered.dtype != source.dtype or self.gathered.device != source.device:
            self.gathered = torch.empty(shape, dtype=source.dtype, device=source.device)
        gathered = self.gathered

        def class_blocks(classes: slice | Tensor) -> Tensor:
            """The regularised blocks (classes, D, D) float64 of at most ``step`` classes."""
            chosen_rows = index[:, classes].T.flatten()
            chosen = torch.index_select(source, 0, chosen_rows, out=gathered[: chosen_rows.numel()]).view(-1, m, d)  # (classes, m, D)
            weight = row_weight[:, classes].T.to(source.dtype)  # (classes, m)
            if loose:  # about the weighted mean row (see above)
                total = weight.sum(1, dtype=torch.float64)
                mean = torch.bmm(weight.unsqueeze(1), chosen).squeeze(1).to(torch.float64) / total.clamp(min=1e-300).unsqueeze(1)
                rounded = mean.to(source.dtype)
                chosen -= rounded.unsqueeze(1)
            chosen *= weight.sqrt().unsqueeze(2)  # not in place: weight may be a view of row_weight
            blocks = torch.bmm(chosen.transpose(1, 2), chosen).to(torch.float64)
            if loose:
                # sum_i w_i x_i x_i^T = sum_i w_i (x_i - r)(x_i - r)^T + total (m r^T + r m^T - r r^T)
                # for the mean m and any r, here m rounded to float32
                rounded = rounded.to(torch.float64)
                cross = mean.unsqueeze(2) * rounded.unsqueeze(1)
                blocks += total[:, None, None] * (cross + cross.transpose(1, 2) - rounded.unsqueeze(2) * rounded.unsqueeze(1))
            blocks = all_reduce_(blocks, process_group)
            diagonal = blocks.diagonal(dim1=1, dim2=2)
            diagonal += 2 * penalty[classes]
            diagonal += _jitter(diagonal)
            return blocks

        # Failures are read back once per factorisation, not per chunk (on a GPU a read-back
        # each): 70 of a fit's 170 host synchronisations at 100,000 x 200 on an H200.
        info = torch.empty(k, dtype=torch.int32, device=source.device)
        for start in range(0, k, step):
            classes = slice(start, start + step)
            factor[classes], info[classes] = torch.linalg.cholesky_ex(class_blocks(classes))
        failed = info.nonzero().flatten() if bool(info.any()) else info[:0]
        for start in range(0, failed.numel(), step):  # formed again, with ridges
            retried = failed[start : start + step]
            factor[retried] = _cholesky_with_ridges(class_blocks(retried))

        def solve(r: Tensor) -> Tensor:
            # two triangular solves: cholesky_solve took 3.3 ms per call at K = 100 inside a fit
            # against 1.3 ms for these (a fifth of CG's time per step)
            half = torch.linalg.solve_triangular(factor, r.unsqueeze(2), upper=False)
            return torch.linalg.solve_triangular(factor.mT, half, upper=True).squeeze(2)

        return solve


class _LowRankBlocks:
    """The per-class Hessian blocks of a fit whose blocks are too large to form (F + 1 >=
    _MIN_LOW_RANK_BLOCK_SIZE), each as the part of its ``m = 8 N / D`` rows of largest curvature
    (at most D / 2), exactly, plus the other rows' part as its diagonal about their mean and that
    mean (rank one): ``B_k ~ Delta_k + U_k^T U_k``, the (m + 1, D) rows ``U_k`` those rows and
    the mean scaled by their curvature's square roots, ``Delta_k`` the diagonal plus twice the
    penalty. Inverted by Woodbury's identity, ``B_k^-1 = S (I - V_k^T C_k^-1 V_k) S`` with
    ``S = Delta_k^-1/2``, ``V_k = U_k S`` and the (m + 1)-square capacitance matrix
    ``C_k = I + V_k V_k^T``; only ``V_k`` is kept, K (m + 1) D floats, about 8 N K (320 MB at
    10,000 x 1,000 in float32), and the capacitance matrices' factors, K (m + 1)^2 floats.

    The diagonal and rank-one part alone is :func:`_rank_one_preconditioner`; the top rows carry
    the coupling between a class's features that it misses (synthetic 5,000 x 300, lambda = 1, a
    Newton system after five steps: 407 CG steps to a relative residual of 1e-3 with rank one, 42
    with these, 19 with the exact blocks of every row). Single-process fits only: another process's
    top rows would have to be gathered, not summed.
    """

    def __init__(self) -> None:
        self.rows = torch.empty(0)

    def factorise(self, source: Tensor, w: Tensor, q: Tensor, penalty: Tensor) -> Callable[[Tensor], Tensor]:
        """Form and factorise the blocks from the features ``source: (N, D)``, the sample
        weights ``w: (N,)`` (or (N, B), see :func:`_curvature`) and posteriors ``q: (N, K)`` (in
        ``source``'s precision, which the rows and their products keep) and ``penalty: (K, D)``;
        returns the solve ``r -> (B_k^{-1} r_k)_k`` for ``r: (K, D)`` float64."""
        n, d = source.shape
        k = q.shape[1]  # (every group's classes, in a batched fit)
        # at most D / 2 rows: the capacitance matrices and their factors take 2 K m^2 floats
        # (100,000 x 1,000: 8 N / D would be 799 rows, 10 GB in float64; 500 rows, 4 GB)
        m = min(n - 1, d // 2, max(_MIN_BLOCK_ROWS, _BLOCK_ROWS_PER_FEATURE * n // d))
        curvature = _curvature(w, q)
        top_weight, top_index = curvature.topk(m, dim=0, sorted=False)  # (m, K)
        # the other rows' total, sums and centred diagonal
        rest_total, rest_first, rest_second = _curvature_moments(source, curvature.scatter_(0, top_index, 0.0), None)
        rest_mean = rest_first / torch.where(rest_total > 0, rest_total, 1.0).unsqueeze(1)
        delta = (rest_second - rest_first * rest_mean).clamp(min=0) + 2 * penalty
        if self.rows.shape != (k, m + 1, d) or self.rows.dtype != source.dtype or self.rows.device != source.device:
            self.rows = torch.empty(k, m + 1, d, dtype=source.dtype, device=source.device)
        rows = self.rows
        root = top_weight.T.sqrt().unsqueeze(2)  # (K, m, 1)
        top_diagonal = torch.empty_like(delta)
        step = max(1, _CHUNK_ELEMENTS // (d * m))
        for start in range(0, k, step):
            classes = slice(start, start + step)
            chosen = torch.index_select(source, 0, top_index[:, classes].T.flatten()).view(-1, m, d)
            chosen.mul_(root[classes])
            rows[classes, :m] = chosen
            top_diagonal[classes] = chosen.square().sum(1)
        rows[:, m] = rest_total.sqrt().unsqueeze(1) * rest_mean
        # Where the other rows and the penalty leave a feature's diagonal (near) zero, Woodbury's
        # identity would divide by it: a ridge of _LOW_RANK_RIDGE of the top rows' diagonal
        delta += _LOW_RANK_RIDGE * top_diagonal + _jitter(delta)
        root_inverse = delta.rsqrt()  # (K, D) float64
        rows.mul_(root_inverse.to(rows.dtype).unsqueeze(1))
        capacitance = torch.bmm(rows, rows.mT).to(torch.float64)
        capacitance.diagonal(dim1=1, dim2=2).add_(1.0)
        factor, info = torch.linalg.cholesky_ex(capacitance)  # at least I: round-off aside, definite
        if bool(info.any()):
            factor = _cholesky_with_ridges(capacitance)

        def solve(r: Tensor) -> Tensor:
            # (row vectors times the rows: a third of the time of the rows times column vectors)
            y = r * root_inverse
            s = torch.bmm(y.to(rows.dtype).unsqueeze(1), rows.mT).mT.to(torch.float64)  # (K, m + 1, 1)
            s = torch.linalg.solve_triangular(factor, s, upper=False)
            s = torch.linalg.solve_triangular(factor.mT, s, upper=True)
            return (y - torch.bmm(s.mT.to(rows.dtype), rows).squeeze(1).to(torch.float64)) * root_inverse

        return solve


def _blind_projections(x: Tensor, w: Tensor, groups: Tensor, scale: Tensor,
                       process_group: ProcessGroup | None) -> tuple[Tensor | None, Tensor | None]:
    """(B, D, D) float64: for each of the ``groups: (B,)`` marked (the unpenalised ones), the
    projection onto the directions of its parameters' rows that the features ``x: (N, D)`` (the
    last column the bias's, of value ``u``; the features divided by ``scale: (D,)``) cannot see on
    the rows its weights ``w[:, b]`` count: ``u e_j - c_j e_bias`` for each feature column ``j``
    that is constant there, at ``c_j`` (exactly: its largest and smallest value agree), and
    ``[scale_1 .. scale_F, -c / u]`` where every row's features sum to ``c`` (to round-off:
    logits centred per row, whose map ``W + v 1^T`` scores alike; unpenalised matrix scaling of
    such logits had grown ``v`` to 93, and rows shifted by a constant, which softmax ignores,
    scored a log-loss of 369 for 0.245). Zero for the other groups, ``None`` where there are
    none. Second, (B, D) that last direction in ``theta``'s own coordinates, ``[1 .. 1, -c]``, for
    the groups whose rows sum to a constant (zero for the others; ``None`` where none do): the
    fit returns the optimal map orthogonal to it (``W 1 = c b``; 0 for rows centred at 0), which
    scores rows shifted by a constant alike. (Found by thresholding the second moments'
    eigenvalues instead, a column varying by 1e-8 of its size, which still carries information,
    was taken for blind: a loss of 0.980 where 0.651 is reached. Other columns that copy one
    another are left alone: their weights drift, but mildly.)"""
    f = x.shape[1] - 1
    projections = x.new_zeros(len(groups), x.shape[1], x.shape[1], dtype=torch.float64)
    sum_directions = x.new_zeros(len(groups), x.shape[1], dtype=torch.float64)
    for b in groups.nonzero().flatten().tolist():
        counted = x[w[:, b] > 0].to(torch.float64)
        if counted.shape[0]:
            sums = counted[:, :f] @ scale[:f]  # (each row's features, in their own units)
            largest = (counted[:, :f].abs() @ scale[:f]).amax()
            high = torch.cat([counted.amax(0), sums.amax().reshape(1), largest.reshape(1)])
            low = -torch.cat([counted.amin(0), sums.amin().reshape(1)])
        else:  # (a process without rows of this group)
            high = x.new_full((x.shape[1] + 2,), -math.inf, dtype=torch.float64)
            low = x.new_full((x.shape[1] + 1,), -math.inf, dtype=torch.float64)
        high, low = all_reduce_(high, process_group, op="max"), -all_reduce_(low, process_group, op="max")
        high, size = high[:-1], float(high[-1])
        constant = (high[:f] == low[:f]).nonzero().flatten()
        directions = x.new_zeros(constant.numel() + 1, x.shape[1], dtype=torch.float64)
        directions[torch.arange(constant.numel()), constant] = high[f]
        directions[: constant.numel(), -1] = -high[constant]
        # (float32's round-off at least: a fit's features are float64 copies of what may be float32
        # logits, whose centred rows sum to 0 within 4e-6)
        summed = float(high[-1] - low[-1]) <= 16 * f * torch.finfo(torch.float32).eps * size and f > 1
        if summed:
            common = float(high[-1] + low[-1]) / 2
            directions[-1, :f], directions[-1, -1] = scale[:f], -common / float(high[f])
            sum_directions[b, :f], sum_directions[b, -1] = 1.0, -common / float(high[f] * scale[f])
        directions = directions if summed else directions[:-1]
        if directions.shape[0]:
            projections[b] = torch.linalg.pinv(directions) @ directions
    return (projections if bool(projections.any()) else None), (sum_directions if bool(sum_directions.any()) else None)


def _jitter(diagonal: Tensor) -> Tensor:
    """What each block's ``diagonal: (K, D)`` gets added: relative to the block's own diagonal, so
    that a class whose curvature is tiny is not swamped by the others' (and a floor for all-zero
    blocks)."""
    return 1e-10 * diagonal + 1e-14 * diagonal.mean(1, keepdim=True) + 1e-300


def _curvature(w: Tensor, q: Tensor) -> Tensor:
    """``c_ik = w_i q_ik (1 - q_ik)`` (N, K): row i's curvature of class k's scores. With weights
    ``w: (N, B)`` per group of a batched fit (:func:`fit_multinomial_logistic`), the K columns
    of ``q`` are B groups of classes, each weighted by its group's column of ``w``."""
    n = q.shape[0]
    return (q * (1 - q)).view(n, w.numel() // n, -1).mul_(w.view(n, -1, 1)).view(n, -1)


def _curvature_moments(x: Tensor, curvature: Tensor, process_group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per class k, the sums over rows of ``c_ik``, ``c_ik x_i`` and ``c_ik x_i^2`` (squared
    entrywise) for the ``curvature: (N, K)``: (K,), (K, D), (K, D) float64, the products in the
    precision of ``x: (N, D)`` (every row, about one pass)."""
    d = x.shape[1]
    sums = torch.cat([curvature.sum(0).unsqueeze(1), curvature.T @ x, curvature.T @ x.square()], dim=1)
    sums = all_reduce_(sums.to(torch.float64), process_group)
    return sums[:, 0], sums[:, 1 : d + 1], sums[:, d + 1 :]


def _class_moments(x: Tensor, w: Tensor, q: Tensor, process_group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_curvature_moments` of every row's curvature: each class's block's total, its
    curvature-weighted row sum and the sum of its diagonal."""
    return _curvature_moments(x, _curvature(w, q), process_group)


def _rank_one_preconditioner(moments: tuple[Tensor, Tensor, Tensor], penalty: Tensor) -> Callable[[Tensor], Tensor]:
    """Each class's block as ``diag(s_k) + t_k m_k m_k^T``, from its :func:`_class_moments`:
    ``t_k`` its total curvature, ``m_k`` its curvature-weighted mean row, ``s_k`` the diagonal of
    the block about that mean (plus twice the ``penalty``); inverted by Sherman and Morrison's
    formula. Returns the solve ``r -> z`` for ``r: (K, D)``."""
    total, first, second = moments
    mean = first / total.clamp(min=1e-300).unsqueeze(1)
    diagonal = (second - first * mean).clamp(min=0) + 2 * penalty
    diagonal += _jitter(diagonal)
    scaled_mean = mean / diagonal
    gain = total / (1 + total * (mean * scaled_mean).sum(1))

    def solve(r: Tensor) -> Tensor:
        z = r / diagonal
        return z - scaled_mean * (gain * (mean * z).sum(1)).unsqueeze(1)

    return solve


def _quasi_newton_update(solve: Callable[[Tensor], Tensor], pairs: list[tuple[Tensor, Tensor, Tensor]]) -> Callable[[Tensor], Tensor]:
    """The inverse preconditioner ``solve`` updated L-BFGS fashion by conjugate pairs ``(p, Hp,
    1 / p.Hp)`` of an earlier CG solve: the two-loop recursion with ``solve`` as its initial
    inverse (Morales and Nocedal 2000, automatic preconditioning). No pairs: ``solve`` itself."""
    if not pairs:
        return solve

    def update(r: Tensor) -> Tensor:
        coefficients = []
        for s_i, y_i, rho in reversed(pairs):
            a = rho * (s_i * r).sum()
            coefficients.append(a)
            r = r - a * y_i
        z = solve(r)
        for (s_i, y_i, rho), a in zip(pairs, reversed(coefficients)):
            z = z + (a - rho * (y_i * z).sum()) * s_i
        return z

    return update


def _penalty_is_strong(penalty: Tensor, second: Tensor) -> bool:
    """Whether ``2 penalty / curvature`` is at least ``_STRONG_PENALTY`` on the median penalised
    entry, the curvature the blocks' diagonal ``second`` (:func:`_class_moments`; the same
    decision in every process: it is all-reduced)."""
    penalised = penalty > 0
    if not bool(penalised.any()):
        return False
    ratio = 2 * penalty[penalised] / second[penalised]
    return float(ratio.median()) >= _STRONG_PENALTY


def fit_multinomial_logistic(
    features: Tensor,
    labels: Tensor,
    sample_w: Tensor,
    theta: Tensor,
    penalty: Tensor,
    *,
    tol_grad: float = 1e-9,
    tol_decrease: float | None = None,
    max_iter: int = 100,
    process_group: ProcessGroup | None = None,
    anchor: Tensor | None = None,
) -> tuple[Tensor, FitRecord]:
    """Minimise ``sum_i w_i CE(softmax(theta @ [x_i, 1]), y_i) + sum(penalty * theta^2)``
    (``anchor + theta`` in the softmax where an ``anchor`` is given).

    **Batched:** with ``sample_w: (N, B)`` and ``theta``, ``penalty`` (and ``anchor``) of shape
    (B, K, F + 1), B independent problems on the same rows, the b-th weighted by ``sample_w[:, b]``
    (zero leaves a row out), are solved together as one: the sum of their objectives, which is
    minimised where each is. Cross-validation solves its folds so (every fold's training rows
    weighted, its test rows not): one pass does every fold's arithmetic in one matrix product, and
    the decisions are read back once per pass for all of them, not once per fold.

    Args:
        features: (N, F) features ``x_i`` (logits for matrix scaling, log-posteriors for
            Dirichlet calibration), float32 or float64; losses and gradients are computed in this
            precision, Hessian products in float32 (unless float32 matrix products are allowed
            to round to TF32 / bfloat16, or once CG stalls on their round-off).
        labels: (N,) class indices in ``[0, K)``.
        sample_w: (N,) per-sample weights, e.g. ``1 / N`` for the mean loss (see
            :func:`torchcal.calibrators.base.sample_weights`); (N, B) for B problems at once.
        theta: (K, F + 1) starting ``[W | b]``; (B, K, F + 1) batched.
        penalty: (K, F + 1) non-negative penalty weights (e.g. ODIR: zero on the diagonal of W),
            (B, K, F + 1) batched.
        tol_grad: converged when the largest absolute gradient entry is below this, both as it is
            and for the features scaled to unit root mean square.
        tol_decrease: if given, converged only after a Newton step that decreased the objective
            by less than this as well, or (every parameter penalised) once its gap to the optimum
            is certified below a tenth of it (``_CERTIFIED_GAP_SHARE``). A weak penalty leaves
            directions so flat that the gradient is small far from the optimum; a fit warm-started
            from a stronger penalty's optimum (the cross-validation's path) can start, or stop,
            far from its own.
        max_iter: Newton iterations at most.
        process_group: data-parallel fit; every process passes its shard (and weights that sum
            to 1 over the group), sums over samples are all-reduced, the penalty counted once.
        anchor: (K, F + 1) (batched: (B, K, F + 1)) a fixed part of the map: the scores are
            ``(anchor + theta) @ [x_i, 1]`` and the penalty acts on ``theta``, the deviation from
            it (SMS: the identity).

    Returns:
        ``(theta, record)``: the minimiser, shaped and typed as ``theta``, and a
        :class:`~torchcal.fit.FitRecord` whose ``evaluations`` counts passes over the data
        (gradients, line-search trials and Hessian-vector products). Of the minimisers that differ
        by a constant added to every class's scores (when the penalty does not fix it), the one
        with class-centred columns.

    Example:
        >>> import torch
        >>> from torchcal.calibrators._multinomial import fit_multinomial_logistic
        >>> x = torch.randn(500, 3, dtype=torch.float64)
        >>> y = torch.distributions.Categorical(logits=2 * x).sample()
        >>> start = torch.eye(3, 4, dtype=torch.float64)
        >>> theta, record = fit_multinomial_logistic(x, y, torch.full((500,), 1 / 500, dtype=torch.float64),
        ...                                          start, torch.full((3, 4), 1e-3, dtype=torch.float64))
        >>> record.converged, record.grad_max < 1e-9
        (True, True)
    """
    n, f = features.shape
    shape = theta.shape
    groups = 1 if sample_w.dim() == 1 else sample_w.shape[1]  # B problems, each of K classes
    k = shape[-2]
    dtype = features.dtype
    x = torch.cat([features, features.new_ones(n, 1)], dim=1)  # (N, D), D = F + 1
    w = sample_w.to(dtype).reshape(n, groups).contiguous()  # (views of it are taken below)
    rows = torch.arange(n, device=x.device)
    # The solver works on features scaled to unit root mean square, so that its tolerances and
    # preconditioner mean the same for every column: a feature that varies by 1e-7 (a class
    # whose log-probabilities all sit near 0) needs a weight of 1e7, whose raw gradient is
    # below any tolerance long before it gets there.
    scale = all_reduce_((w.mean(1) @ x.square()).to(torch.float64), process_group).sqrt()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    largest_scale = max(1.0, float(scale.max()))
    x /= scale.to(dtype)
    # Newton directions only need the forcing term's accuracy (at least _MIN_FORCING): the
    # Hessian products run in float32, half the time of a float64 pass, while the gradients,
    # losses, steps and preconditioner blocks near the optimum stay in the features' precision
    # (float32 blocks need a ridge against their round-off that weakens them: 133 -> 471 passes
    # on the CIFAR-100 LeNet-5 logits at lambda = 1e-4).
    low = torch.float32 if _float32_products_are_ieee(x.device) else dtype
    x_low, w_low = x.to(low), w.to(low)
    full_dtype, x_full, w_full = dtype, x, w
    loss_w = w.to(torch.float64)  # (the losses' sums in float64 whatever the passes' precision)
    dtype, x, w = low, x_low, w_low  # gradients and losses too, far from the optimum (_FLOAT32_TOL_GRAD)
    float32_floor = math.exp(exp_floor(torch.float32))  # posteriors below it: float32 subnormals
    # the B problems' parameters as the rows of one (B K, D) matrix, group by group
    penalty = penalty.to(device=x.device, dtype=torch.float64).reshape(-1, f + 1) / scale.square()
    anchor_scaled = 0.0 if anchor is None else anchor.to(device=x.device, dtype=torch.float64).reshape(-1, f + 1) * scale
    column_penalty = penalty.view(groups, k, -1).sum(1, keepdim=True)  # (B, 1, D)

    def shift(c: Tensor) -> Tensor:
        """The constant per column, added to every class of a group, that minimises the penalty of ``c``."""
        best = -(penalty * c).view(groups, k, -1).sum(1, keepdim=True) / torch.where(column_penalty > 0, column_penalty, 1.0)
        return (c.view(groups, k, -1) + best).view(c.shape)

    group_unpenalised = ~(penalty.view(groups, k, -1) > 0).flatten(1).any(1)  # (B,)
    unpenalised = bool(group_unpenalised.all())
    if unpenalised:
        # A sample the map misclassifies (its label's posterior at most 1/2) adds at least
        # log(2) times its weight to the loss. Below that for the least weight, every sample is
        # classified correctly: scaling the map up lowers the loss towards 0, and there is no
        # finite optimum to go on to. (Half of it: the float32 passes' round-off.)
        weighted = sample_w[sample_w > 0]
        least = float(weighted.min()) if weighted.numel() else math.inf  # (an empty shard)
        separated_below = 0.5 * math.log(2) * least_across(least, process_group, sample_w.device)
    # Without a penalty, directions of theta's rows that the features cannot see (a logit column
    # that is constant) change nothing, and CG, preconditioned by blocks
    # singular along them, let round-off walk the parameters out along them: a constant logit
    # column of MatrixScaling grew weights of 5e5 whose cancellation cost float32 inputs two
    # digits (probabilities off by 1e-2). Steps stay orthogonal to them: the smallest-norm optimum.
    blind, sum_directions = _blind_projections(x_full, w_full, group_unpenalised, scale, process_group)  # (B, D, D), (B, D) or None

    def result(c: Tensor) -> Tensor:
        """``theta`` (as it was given) at the centred ``c``: of the optimal maps, where the rows'
        features sum to a constant, the one orthogonal to that direction (see _blind_projections)."""
        theta_rows = shift(c) / scale
        if sum_directions is not None:  # (the map's, the anchor's part included)
            d = sum_directions.repeat_interleave(k, dim=0)  # (B K, D): each group's direction for its classes
            full = theta_rows + anchor_scaled / scale
            theta_rows = theta_rows - ((full * d).sum(1, keepdim=True) / d.square().sum(1, keepdim=True).clamp_min(1e-300)) * d
        return theta_rows.to(theta.dtype).view(shape)

    def centre(v: Tensor) -> Tensor:
        grouped = v.view(groups, k, -1)
        grouped = grouped - grouped.mean(1, keepdim=True)
        return (grouped if blind is None else grouped - grouped @ blind).view(v.shape)

    def by_group(scores: Tensor) -> Tensor:
        """``scores: (N, B K)`` as (N, B, K), its groups of classes, one softmax each."""
        return scores.view(n, groups, k)

    passes = 0
    products = 0  # Hessian-vector products (CG steps), a part of the passes
    damping = 0.0  # of the Newton systems of an unpenalised fit (_DAMPING_AFTER_CUT)
    start_moments: tuple[Tensor, Tensor, Tensor] | None = None  # (see rank_one_preconditioner)

    def forward(c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This process's data loss, the log-posteriors (N, K) and the full parameters at the
        centred ``c``: one forward pass."""
        nonlocal passes
        passes += 1
        full = shift(c)
        log_q = torch.log_softmax(by_group(x @ (full + anchor_scaled).to(dtype).T), dim=2)
        return -(loss_w * log_q[rows, :, labels].to(torch.float64)).sum(), log_q.view(n, -1), full

    def objective(c: Tensor) -> float:
        """The objective at the centred ``c``: one forward pass."""
        data, _, full = forward(c)
        return float(all_reduce_(data.reshape(1), process_group)[0] + (penalty * full.square()).sum())

    def loss_grad(c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Loss, gradient (B K, D) and posteriors q (N, B K) at the centred ``c``: one pass."""
        data, log_q, full = forward(c)
        q = log_q.clamp_(min=exp_floor(dtype)).exp_()  # no subnormal posteriors: they slow every product
        residual = w.unsqueeze(2) * by_group(q)
        residual[rows, :, labels] -= w
        sums = all_reduce_(torch.cat([data.reshape(1), (residual.view(n, -1).T @ x).to(torch.float64).flatten()]), process_group)
        grad = sums[1:].view(full.shape) + 2 * penalty * full
        return sums[0] + (penalty * full.square()).sum(), grad, q

    def passes_in_full_precision() -> None:
        """Gradients and losses in the features' precision from now on."""
        nonlocal dtype, x, w
        dtype, x, w = full_dtype, x_full, w_full

    def products_in_full_precision() -> None:
        """Hessian products (and passes) in the features' precision from now on. Float32 ones can
        stall CG where the Newton system needs curvature below their round-off: on the CIFAR-100
        ResNet-20 logits without 3 of the classes (whose scores the fit drives down without
        bound), CG's step lengths fell 1e4-fold per step and turned negative, CG ran to its cap at
        every Newton step and the fit to the iteration cap, unconverged."""
        nonlocal low, x_low, w_low
        passes_in_full_precision()
        low, x_low, w_low = dtype, x, w

    def in_low(q: Tensor) -> Tensor:
        """The posteriors in ``low``, clamped above float32's subnormals."""
        return q if low == dtype else q.clamp(min=float32_floor).to(low)

    def hessian_product(q: Tensor, v: Tensor) -> Tensor:
        """``H v`` for a centred direction ``v`` (K, D) at posteriors ``q`` in ``low``: one pass."""
        nonlocal passes, products
        passes += 1
        products += 1
        qs = by_group(torch.mm(x_low, v.to(low).T)).mul_(by_group(q))  # one (N, B K) buffer for the whole product
        r = qs.addcmul_(by_group(q), qs.sum(2, keepdim=True), value=-1).mul_(w_low.unsqueeze(2))
        data = all_reduce_((r.view(n, -1).T @ x_low).to(torch.float64), process_group)
        return data + centre(2 * penalty * shift(v)) + damping * v

    def evaluate(c: Tensor) -> tuple[float, Tensor, Tensor, float, float, float]:
        """Loss, gradient, posteriors, the gradient's largest entry (for the original and for
        the scaled features) and its norm at the centred ``c``: one pass, one read-back."""
        loss, grad, q = loss_grad(c)
        # (in the subspace the fit moves in: where the rows' features sum to a constant up to
        # round-off, the gradient along that blind direction is the round-off's, which no step
        # reduces; tested and solved for, it kept unpenalised matrix scaling of Ferrer's CIFAR-10
        # ResNet-20 logits from converging, CG at its cap on every Newton step: 12,773 passes)
        grad = grad if blind is None else centre(grad)
        loss_value, grad_max, size, norm = torch.stack([loss, (grad * scale).abs().max(), grad.abs().max(), grad.norm()]).tolist()
        return loss_value, grad, q, grad_max, size, norm

    blocks = _ClassBlocks()
    low_rank_blocks = _LowRankBlocks()
    too_large = f + 1 > _MAX_BLOCK_SIZE  # for the dense blocks: the low-rank ones, where they serve

    def block_preconditioner(q: Tensor, q_low: Tensor, loose: bool) -> Callable[[Tensor], Tensor]:
        """:class:`_ClassBlocks` (:class:`_LowRankBlocks` above ``_MAX_BLOCK_SIZE``, where they
        serve) at the passes' posteriors ``q`` (not ``q_low``: see the comment at ``low``),
        summed in ``low`` precision for a ``loose`` Newton system."""
        source = x_low if loose else x
        if too_large:
            return low_rank_blocks.factorise(source, w.to(source.dtype), q.to(source.dtype), penalty + damping / 2)
        return blocks.factorise(source, w, q, penalty + damping / 2, loose, process_group)

    def rank_one_preconditioner(q: Tensor, q_low: Tensor, loose: bool) -> Callable[[Tensor], Tensor]:
        """:func:`_rank_one_preconditioner` at the posteriors ``q_low``."""
        nonlocal start_moments
        moments = start_moments if start_moments is not None else _class_moments(x_low, w_low, q_low, process_group)
        start_moments = None  # (those of the starting point, where the fit's first step is)
        return _rank_one_preconditioner(moments, penalty + damping / 2)

    recycled: list[tuple[Tensor, Tensor, Tensor]] = []  # (p, Hp, 1 / p.Hp) of the last CG solve

    def newton_direction(q: Tensor, grad: Tensor, grad_norm: float, solve: Callable[[Tensor], Tensor], forcing: float,
                         checked_from: Tensor | None) -> Tensor | None:
        """Preconditioned CG on ``H d = -grad`` in the centred subspace, to relative residual
        ``forcing``; ``None`` where float32 products fail it: a step whose ``r.z`` or curvature
        ``p.Hp`` is not positive (impossible in exact arithmetic: the sign of round-off swamping
        the curvature), or ``_FLOAT32_CG_STEPS`` steps.

        With ``checked_from`` (the current centred parameters), every ``_CHECK_EVERY`` CG steps
        the objective is evaluated at the iterate, and CG returns the last checked iterate once
        it stops decreasing. Far from the optimum of a nearly separable fit, the quadratic model
        fails along CG's long low-curvature steps: one step of a 5,000 x 300 fit (Jacobi) took
        259 passes for a direction the line search then cut to 1/256. Only on loose Newton systems
        with the rank-one (or diagonal) preconditioner or the low-rank blocks (10,000 x 1,000, the
        first solve on them: 145 CG steps unchecked, 16 checked); with the dense blocks, CG's steps
        are few and the checks cost more than they save (real CIFAR-100, lambda = 1e-3: 339 -> 367
        passes).

        With the blocks, the preconditioner is their L-BFGS update by the last solve's conjugate
        pairs (``_RECYCLED_PAIRS``); this solve's pairs are kept for the next.
        """
        nonlocal recycled
        old_pairs = recycled if preconditioner is block_preconditioner else []
        precondition = _quasi_newton_update(lambda r: centre(solve(r)), old_pairs)

        pairs: list[tuple[Tensor, Tensor, Tensor]] = []
        stride = 1
        step = torch.zeros_like(grad)
        r = -grad
        z = precondition(r)
        p = z
        rz = (r * z).sum()
        target = forcing * grad_norm
        checked, checked_loss = step, math.inf
        for i in range(_MAX_CG_STEPS):
            if i == _FLOAT32_CG_STEPS and low != full_dtype:
                return None  # (see products_in_full_precision)
            hp = hessian_product(q, p)
            curvature = (p * hp).sum()
            alpha = rz / curvature
            step = step + alpha * p
            r = r - alpha * hp
            residual, curvature_value, rz_value = torch.stack([r.norm(), curvature, rz]).tolist()
            if low != full_dtype and not (curvature_value > 0 and rz_value > 0):
                return None  # (see products_in_full_precision)
            if blocks_fit and curvature_value > 0 and i % stride == 0:  # (only the blocks use them)
                pairs.append((p, hp, 1 / curvature))
                if len(pairs) > 2 * _RECYCLED_PAIRS:
                    pairs, stride = pairs[::2], 2 * stride
            if residual <= target or not curvature_value > 0:
                break
            if checked_from is not None and (i + 1) % _CHECK_EVERY == 0:
                trial = objective(checked_from + step)
                if not trial < checked_loss:  # (a first check that is not finite: the gradient)
                    return checked if math.isfinite(checked_loss) else -grad
                checked, checked_loss = step, trial
            z = precondition(r)
            rz_new = (r * z).sum()
            p = z + (rz_new / rz) * p
            rz = rz_new
        recycled = pairs if len(pairs) <= _RECYCLED_PAIRS else pairs[::2]
        return step if bool(torch.isfinite(step).all()) else -grad

    started = time.perf_counter()
    c = centre(theta.to(device=x.device, dtype=torch.float64).reshape(-1, f + 1) * scale)
    # grad is with respect to the scaled parameters; grad * scale with respect to the original ones
    loss_value, grad, q, grad_max, size, grad_norm = evaluate(c)
    previous: tuple[float, float] | None = None  # (gradient norm, forcing) of the last Newton step
    blocks_fit = not too_large or (f + 1 >= _MIN_LOW_RANK_BLOCK_SIZE and world_size(process_group) == 1)
    # the moments at the start decide, and are the rank-one preconditioner's for the first step
    start_moments = moments = _class_moments(x_low, w_low, in_low(q), process_group)
    preconditioner = block_preconditioner if blocks_fit and not _penalty_is_strong(penalty, moments[2]) else rank_one_preconditioner
    solve, kept = None, False  # kept: the last step's blocks serve this one (_KEEP_BLOCKS_TOL_GRAD)
    decrease = math.inf  # of the objective by the last Newton step (tol_decrease)
    certifiable = bool((penalty > 0).all())  # (_CERTIFIED_GAP_SHARE)

    def settled() -> bool:
        """Whether the objective is as close to its optimum as ``tol_decrease`` asks."""
        if tol_decrease is None or decrease <= tol_decrease:
            return True
        return certifiable and 0.25 * float((grad.square() / penalty).sum()) <= _CERTIFIED_GAP_SHARE * tol_decrease

    norms: list[float] = []  # of the parameters after each Newton step (unpenalised fits: _DIVERGING_SPAN)
    for iteration in range(max_iter):
        if dtype != full_dtype and tol_grad < _FLOAT32_TOL_GRAD and max(grad_max, size) <= _FLOAT32_TOL_GRAD:
            passes_in_full_precision()
        if q.dtype != dtype:  # the passes' precision has just risen: the state again, in it
            loss_value, grad, q, grad_max, size, grad_norm = evaluate(c)
        if max(grad_max, size) <= tol_grad and settled():
            return result(c), FitRecord(iteration, passes, loss_value, grad_max, True, "gradient below tolerance")
        if not math.isfinite(loss_value + grad_max):
            break
        # CG's residual is about the next gradient; the stopping test reads it times scale too
        forcing = _forcing(grad_norm, previous, max(_MIN_FORCING, 0.5 * tol_grad / (grad_norm * largest_scale)))
        loose = forcing >= _LOOSE_FORCING
        checked_from = c if loose and (preconditioner is rank_one_preconditioner or too_large) else None
        q_low = in_low(q)
        if not kept or solve is None:
            solve = preconditioner(q, q_low, loose or dtype != full_dtype)  # (see _ClassBlocks.factorise)
        products_before = products
        direction = newton_direction(q_low, grad, grad_norm, solve, forcing, checked_from)
        if direction is None:  # CG stalled by float32 round-off (or a long solve): again in full
            products_in_full_precision()
            continue
        previous = (grad_norm, forcing)
        steps = products - products_before
        slow = steps >= 8 and steps > _RANK_ONE_STEPS_PER_DECADE * math.log10(1 / forcing)
        if preconditioner is rank_one_preconditioner and blocks_fit and slow:
            preconditioner = block_preconditioner  # (see _RANK_ONE_STEPS_PER_DECADE)
        fast = steps <= _KEEP_STEPS_PER_DECADE * math.log10(1 / forcing)
        kept = preconditioner is block_preconditioner and (fast or (not slow and tol_grad >= _KEEP_BLOCKS_TOL_GRAD))
        slope = float((grad * direction).sum())
        slack = 1e-14 * max(1.0, abs(loss_value))  # the decrease near the optimum is round-off
        t = 1.0
        while t > 1e-10:
            new_loss_value, new_grad, new_q, new_grad_max, new_size, new_grad_norm = evaluate(c + t * direction)
            if new_loss_value <= loss_value + 1e-4 * t * slope + slack:
                break
            t /= 2
        if t <= 1e-10 or (new_loss_value >= loss_value and new_grad_max >= grad_max):
            if dtype != full_dtype:  # perhaps a step spoilt by float32 round-off: again in more precision
                passes_in_full_precision()
                continue
            if low != full_dtype:
                products_in_full_precision()
                continue
            converged = grad_max <= STALL_GRAD
            message = "no further decrease" if converged else "line search failed"
            return result(c), FitRecord(iteration, passes, loss_value, grad_max, converged, message)
        if t < 1 and dtype != full_dtype and -slope < 1e3 * torch.finfo(dtype).eps * abs(loss_value):
            passes_in_full_precision()  # a short step that round-off may have cut (see _FLOAT32_TOL_GRAD)
        c, grad, q = c + t * direction, new_grad, new_q
        decrease = loss_value - new_loss_value
        loss_value, grad_max, size, grad_norm = new_loss_value, new_grad_max, new_size, new_grad_norm
        _log.debug("Newton-CG (%d x %d, K = %d) step %d on %s passes: loss %.10f, max gradient %.1e, step length %g, %d passes, %.1f s",
                   n, f, k, iteration + 1, str(new_q.dtype).removeprefix("torch."), loss_value, grad_max, t, passes, time.perf_counter() - started)
        if unpenalised:
            if loss_value < separated_below:
                message = (f"{DIVERGING}: the map classifies every weighted sample correctly (the loss, {loss_value:.3g}, is below "
                           f"half of log(2) times the least sample weight): the data are separable, and the unpenalised fit has no "
                           f"finite optimum")
                return result(c), FitRecord(iteration + 1, passes, loss_value, grad_max, False, message)
            damped = t < _DAMPING_AFTER_CUT or steps >= _MAX_CG_STEPS
            damping = max(4 * damping, _DAMPING_SHARE * grad_norm) if damped else damping / 4 if t == 1 else damping
            norms.append(float(c.norm()))
            if len(norms) > 2 * _DIVERGING_SPAN:
                before, middle, now = norms[-1 - 2 * _DIVERGING_SPAN], norms[-1 - _DIVERGING_SPAN], norms[-1]
                if middle > _DIVERGING_GROWTH * before and now > _DIVERGING_GROWTH * middle:
                    # (no warning here: what to do instead is the caller's to say)
                    message = (f"{DIVERGING}: the parameters' norm grew {now / before:.3g}-fold over the last {2 * _DIVERGING_SPAN} "
                               f"Newton steps while the loss fell to {loss_value:.6g}; the data are (nearly) separable: the "
                               f"unpenalised fit has no finite optimum, or one too far out to reach")
                    return result(c), FitRecord(iteration + 1, passes, loss_value, grad_max, False, message)
    else:
        # the last step's point, tested as the loop's top would (a float32 gradient is not trusted below _FLOAT32_TOL_GRAD)
        trusted = q.dtype == full_dtype or tol_grad >= _FLOAT32_TOL_GRAD  # (the precision its gradient was formed in)
        if trusted and max(grad_max, size) <= tol_grad and settled():
            return result(c), FitRecord(max_iter, passes, loss_value, grad_max, True, "gradient below tolerance")
        warnings.warn(f"Newton-CG did not converge in {max_iter} iterations", ConvergenceWarning, stacklevel=stacklevel_outside_package())
        return result(c), FitRecord(max_iter, passes, loss_value, grad_max, False, f"stopped at the iteration cap ({max_iter})")
    return result(c), FitRecord(iteration, passes, loss_value, grad_max, False, "the loss or its gradient is not finite")
