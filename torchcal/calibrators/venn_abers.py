"""Venn–Abers predictors: isotonic calibration with a validity guarantee and a ``(p0, p1)`` interval.

The inductive Venn–Abers predictor (IVAP; Vovk & Petej 2014) calibrates the score ``s`` of a test
object by fitting isotonic regression twice to the calibration data plus the test object: once
labelled 0, giving ``p0``, once labelled 1, giving ``p1``. One of the two is the isotonic
calibration the test object would get if its label were known, so the pair is a multiprobability
prediction that is well calibrated whatever the score distribution (under exchangeability); the
narrower ``[p0, p1]``, the less the calibration depends on the one object. The point prediction
is the merge that is minimax for the loss: ``p1 / (1 - p0 + p1)`` for the log-loss,
``p1 + (p0**2 - p1**2) / 2`` for the Brier score (Vovk, Petej & Fedorova 2015).

``p0`` and ``p1`` depend on the test score only through its place among the calibration scores,
so fitting precomputes them for every place from the greatest convex minorants of the cumulative sum
diagram (Vovk, Petej & Fedorova 2015): a sort, then one pass over the distinct scores with a few
exact integer steps each (about 3 µs per score in Python; 0.05 s for 8,000 scores). A prediction
is a table look-up.

Cross Venn–Abers (CVAP, ``folds=F``) splits the calibration data into F folds, fits an IVAP on each
and merges the F intervals by geometric means (log-loss) or means (Brier). Vovk et al.'s CVAP also
retrains the scoring model without each fold; on stored logits the folds share one model, so the
F IVAPs each see only a F-th of the data, and on CIFAR-10 ResNet-110 that costs log-loss (0.236
with F = 5 against 0.212 for the IVAP). IVAP (``folds=1``) is the default.

Multiclass: Venn–Abers is a binary method. ``multiclass="ovr"`` calibrates every class's
log-posterior one-vs-rest and renormalises (Zadrozny & Elkan 2002); ``"pairwise"`` calibrates the
log-odds ``z_j - z_i`` of every pair of classes on the samples of those two classes and couples
the K(K-1)/2 pairwise probabilities (Price et al. 1995), as in Manokhin (2017) and the
``venn-abers`` package. One-vs-rest is the default: K tables instead of K(K-1)/2, each fitted on
all the data rather than on two classes' share of it, and the better of the two on CIFAR-10
ResNet-110 (fitted on the 5,000 validation logits, test log-loss 0.212 against 0.244 pairwise;
temperature scaling 0.209).
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from torchcal._validation import check_count, compute_dtype, finite_log
from torchcal.calibrators.base import Calibrator, nan_rows_stay_nan
from torchcal.fit import FitRecord
from torchcal.functional._ties import tie_group_starts, tie_tolerance
from torchcal.functional.scoring import PER_SAMPLE_SCORES

__all__ = ["VennAbersCalibration", "venn_abers_table"]

_MULTICLASS = ("ovr", "pairwise")
#: Pairwise coupling holds several float64 (N, K(K-1)/2) tables while it scores: measured at K =
#: 100, forward on 50,000 rows peaked at 13.2 GB, about this many bytes per pair and row. Beyond
#: _MAX_PAIRS pairs (K = 200: 1 MiB per row) it is refused; K = 1,000 would ask for 40 GB at once.
_BYTES_PER_PAIR_AND_ROW = 56
_MAX_PAIRS = 20_000


def _upper_values(counts: np.ndarray, positives: np.ndarray) -> np.ndarray:
    """``p1`` at every place of a test object among ``k`` tied groups of sorted calibration scores.

    ``counts: (k,)`` and ``positives: (k,)`` are each group's size and number of label-1 samples.
    Place ``i`` (0..k) means ``i`` groups lie below the test score. ``p1[i]`` is the isotonic fit at
    the test object labelled 1, i.e. the slope of the greatest convex minorant of the cumulative
    sum diagram with the test point inserted: with ``P_a`` the diagram's corners (cumulative
    counts, cumulative positives), the slope of the lower bridge between the left corners shifted
    by ``(-1, -1)``, ``{P_a - (1, 1): a <= i}``, and the right corners ``{P_b: b >= i}``. Both ends
    of the bridge move right as ``i`` grows, so the right end walks each corner once; the left end
    walks back from the newest corner (one or two corners on real scores, but not bounded).
    Integer arithmetic: exact.
    """
    k = len(counts)
    px = [0, *np.cumsum(counts).tolist()]
    py = [0, *np.cumsum(positives).tolist()]

    def left_of(a: int, b: int, c: int) -> bool:
        """Whether corner ``b`` lies strictly below the chord from corner ``a`` to ``c``."""
        return (py[b] - py[a]) * (px[c] - px[a]) < (py[c] - py[a]) * (px[b] - px[a])

    # successor of corner b on the lower hull of the corners b..k (a tree, built right to left)
    successor = [-1] * (k + 1)
    hull: list[int] = []
    for b in range(k, -1, -1):
        while len(hull) >= 2 and not left_of(b, hull[-1], hull[-2]):
            hull.pop()
        successor[b] = hull[-1] if hull else -1
        hull.append(b)

    p1 = np.empty(k + 1)
    left: list[int] = []  # lower hull of the shifted corners 0..i, as a stack
    b = 0
    for i in range(k + 1):
        while len(left) >= 2 and not left_of(left[-2], left[-1], i):
            left.pop()
        left.append(i)
        a_pos, b = len(left) - 1, max(b, i)
        moved = True
        while moved:  # the bridge (a, b) rises by `rise` over `run`
            moved = False
            a = left[a_pos]
            rise, run = py[b] - py[a] + 1, px[b] - px[a] + 1
            # right end: on to the next corner while it lies on or below the bridge
            after = successor[b]
            while after >= 0 and (py[after] - py[a] + 1) * run <= rise * (px[after] - px[a] + 1):
                b, after, moved = after, successor[after], True
                rise, run = py[b] - py[a] + 1, px[b] - px[a] + 1
            # left end: back to the previous corner while it lies on or below the bridge
            while a_pos > 0:
                before = left[a_pos - 1]
                rise_before, run_before = py[b] - py[before] + 1, px[b] - px[before] + 1
                if rise_before * run < rise * run_before:
                    break
                a_pos, rise, run, moved = a_pos - 1, rise_before, run_before, True
        p1[i] = rise / run
    return p1


def venn_abers_table(scores: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The IVAP of binary calibration data as a look-up table.

    Args:
        scores: (N,) calibration scores (any increasing function of the probability of class 1).
        targets: (N,) binary labels (bool, or 0 and 1 of any dtype).

    Returns:
        ``(grid, p0, p1)`` in float64 on the scores' device: ``grid: (k,)`` the tied groups' scores
        in increasing order, ``p0, p1: (k + 1,)``. Calibration scores within two tie tolerances
        of each other (``functional._ties``; neighbour to neighbour) are one group, given by its
        one score or by its lowest and highest, so that a test score within a tolerance of a
        calibration score pools with its group and no other. A test score ``s`` gets
        ``p0[searchsorted(grid, s, right=True)]`` and ``p1[searchsorted(grid, s, right=False)]``
        (a test score tied with calibration scores pools with them); the look-up of
        :class:`VennAbersCalibration` reaches a tie tolerance further on each side.

    Example:
        >>> scores = torch.tensor([0.1, 0.4, 0.35, 0.8], dtype=torch.float64)
        >>> grid, p0, p1 = venn_abers_table(scores, torch.tensor([0, 0, 1, 1]))
        >>> grid.tolist()
        [0.1, 0.35, 0.4, 0.8]
        >>> [round(p, 4) for p in p0.tolist()], [round(p, 4) for p in p1.tolist()]
        ([0.0, 0.0, 0.3333, 0.3333, 0.5], [0.5, 0.6667, 0.6667, 1.0, 1.0])
    """
    if scores.ndim != 1 or targets.shape != scores.shape:
        raise ValueError(f"scores and targets must be 1-D of the same length, got shapes {tuple(scores.shape)} and {tuple(targets.shape)}.")
    if scores.is_complex() or not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite real numbers; found NaN or infinite values.")
    if targets.is_complex() or not bool(((targets == 0) | (targets == 1)).all()):
        raise ValueError(f"targets must be binary labels (bool, or 0 and 1), got values {targets.unique()[:5].tolist()}.")
    s = scores.detach().cpu().to(torch.float64).numpy()
    y = targets.detach().cpu().numpy().astype(np.int64)
    distinct, group = np.unique(s, return_inverse=True)
    # Groups more than two tie tolerances apart: the look-up ties a test score within one tolerance
    # of a group, and one within a tolerance of two groups would read p0 beside one and p1 beside
    # the other, an interval with p0 > p1 (calibration scores 20 ulp apart).
    starts = tie_group_starts(torch.from_numpy(distinct), reach=2).numpy()
    merged = np.cumsum(starts) - 1  # each distinct score's tied group
    group = merged[group]
    counts = np.bincount(group, minlength=int(starts.sum()))
    positives = np.bincount(group, weights=y, minlength=len(counts)).astype(np.int64)
    upper = _upper_values(counts, positives)
    # p0 is p1 of the mirror image (scores negated, labels flipped), read backwards
    lower = 1.0 - _upper_values(counts[::-1], (counts - positives)[::-1])[::-1]
    # The grid holds each group's lowest and, where it differs, highest score. After the first j
    # grid scores, p0 is read at the place after the groups begun and p1 after the groups ended.
    firsts, lasts = starts, np.roll(starts, -1)  # (a group ends where the next begins, the last at the end)
    edge = firsts | lasts
    grid = distinct[edge]
    p0 = lower[np.r_[0, np.cumsum(firsts[edge])]]
    p1 = upper[np.r_[0, np.cumsum(lasts[edge])]]
    return tuple(torch.from_numpy(np.ascontiguousarray(t)).to(scores.device) for t in (grid, p0, p1))  # type: ignore[return-value]


def _merge(p0: Tensor, p1: Tensor, loss: str) -> Tensor:
    """Merge fold intervals ``(..., F)`` into one probability ``(...)``, minimax for ``loss``."""
    if loss == "log":
        top = p1.log().mean(-1).exp()
        return top / ((1 - p0).log().mean(-1).exp() + top)
    return p1.mean(-1) + (p0.square().mean(-1) - p1.square().mean(-1)) / 2


class VennAbersCalibration(Calibrator):
    """Inductive (``folds=1``) or cross (``folds > 1``) Venn–Abers predictor.

    ``fit(logits, labels, loss=...)`` stores the ``(p0, p1)`` tables; ``loss`` (``"log"`` or
    ``"brier"``) picks the merge of the interval into one probability. :meth:`predict_interval`
    returns the intervals themselves. Binary scores are the log-odds ``z1 - z0``; multiclass ones are
    described in the module docs. Scores are formed in float64 for every input dtype (the tables
    are step functions: float32 round-off would move scores across steps); the output is in the
    input's compute dtype. The tables need all the calibration scores in one place, so there is no
    data-parallel fit. Deployment ``priors`` are not a weighting of the data (the validity guarantee
    is for exchangeable, unweighted data): the posteriors are moved from the data's class
    frequencies to the priors by Bayes' rule, as :func:`torchcal.label_shift.adapt_to_priors` does;
    :meth:`predict_interval` stays at the data's frequencies.

    Args:
        folds: F, the number of folds of a cross Venn–Abers predictor (1: inductive). Folds are
            stratified: the samples in order of (label, score) are dealt to the folds in turn, the
            positives going on from the fold after the last negative's, so the split does not
            depend on the order of the rows and leaves no fold empty.
        multiclass: ``"ovr"`` (one-vs-rest) or ``"pairwise"``, for K > 2. Pairwise scoring holds
            about 56 bytes per pair and row (K = 100: 270 KB per row, so apply it in batches of a
            few thousand rows); it is refused above 20,000 pairs (K > 200).

    Example:
        >>> import torch
        >>> from torchcal import VennAbersCalibration
        >>> logits = 3 * torch.randn(2000, 2)
        >>> labels = torch.distributions.Categorical(logits=logits / 3).sample()
        >>> va = VennAbersCalibration().fit(logits, labels)
        >>> p0, p1 = va.predict_interval(logits[:5])  # (5, 1, 1): one binary problem, one fold
        >>> p = va.predict_proba(logits[:5])[:, 1]  # p1 / (1 - p0 + p1), inside the interval
        >>> bool(((p0[:, 0, 0] <= p) & (p <= p1[:, 0, 0])).all())
        True
    """

    _buffer_names = ("grid", "p0", "p1", "log_prior_ratio")
    _free_last_dims: ClassVar[dict[str, int]] = {"grid": 2, "p0": 2, "p1": 2}  # (folds, the widest fold's grid)
    _supports_process_group = False

    def __init__(self, folds: int = 1, multiclass: str = "ovr") -> None:
        super().__init__()
        folds = check_count(folds, "folds (1: inductive Venn-Abers)")
        if multiclass not in _MULTICLASS:
            raise ValueError(f"multiclass must be one of {_MULTICLASS}, got {multiclass!r}.")
        self.folds = folds
        self.multiclass = multiclass
        self.loss = "log"

    # ------------------------------------------------------------------ binary problems
    def _pairs(self, num_classes: int) -> list[tuple[int, int]]:
        """The binary problems as (negative class, positive class); -1 stands for "the rest"."""
        if num_classes == 2:
            return [(0, 1)]
        if self.multiclass == "ovr":
            return [(-1, k) for k in range(num_classes)]
        count = num_classes * (num_classes - 1) // 2
        if count > _MAX_PAIRS:
            raise ValueError(
                f"multiclass='pairwise' at K = {num_classes} has {count:,} binary problems, and scoring holds "
                f"about {_BYTES_PER_PAIR_AND_ROW * count / 2**20:.0f} MiB per row: use multiclass='ovr' "
                f"({num_classes} problems)."
            )
        return list(combinations(range(num_classes), 2))

    def _features(self, logits: Tensor) -> Tensor:
        """Binary scores (N, C), float64: one column per problem of :meth:`_pairs`."""
        logits = logits.to(torch.float64)
        pairs = self._pairs(logits.shape[1])
        if pairs[0][0] == -1:
            return torch.log_softmax(logits, dim=1)
        negative, positive = (torch.tensor(side, device=logits.device) for side in zip(*pairs))
        return logits[:, positive] - logits[:, negative]

    def _identity(self, num_classes: int) -> dict[str, Tensor]:
        shape = (len(self._pairs(num_classes)), self.folds)
        return {
            "grid": torch.zeros(*shape, 1),
            "p0": torch.zeros(*shape, 2),
            "p1": torch.ones(*shape, 2),
            "log_prior_ratio": torch.zeros(num_classes),
        }

    def _fold_of(self, scores: Tensor, targets: Tensor) -> Tensor:
        """Fold index (N,) of each sample: stratified, dealt in turn in order of (target, score),
        the positives going on where the negatives ended, so that no fold is empty when N >= F
        (each label dealt from fold 0 left the last folds empty when both had fewer than F)."""
        order = torch.argsort(scores, stable=True)
        order = order[torch.argsort(targets[order].to(torch.int8), stable=True)]
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        return rank % self.folds

    def _fit(self, features, labels, weights, loss, max_iter, process_group=None) -> FitRecord:
        pairs = self._pairs(self.num_classes)
        tables = []
        for column, (negative, positive) in enumerate(pairs):
            rows = slice(None) if negative == -1 else (labels == negative) | (labels == positive)
            scores, targets = features[rows, column], labels[rows] == positive
            if 0 < scores.numel() < self.folds:
                which = f"class {positive} against the rest" if negative == -1 else f"classes {(negative, positive)}"
                raise ValueError(f"{scores.numel()} calibration samples for {which} cannot fill {self.folds} folds; "
                                 f"use fewer folds.")
            fold = self._fold_of(scores, targets)
            tables.append([venn_abers_table(scores[fold == f], targets[fold == f]) for f in range(self.folds)])
        width = max(1, max(len(grid) for row in tables for grid, _, _ in row))
        shape = (len(pairs), self.folds)
        device = features.device
        self.grid = torch.full((*shape, width), torch.inf, dtype=torch.float64, device=device)
        self.p0 = torch.zeros((*shape, width + 1), dtype=torch.float64, device=device)
        self.p1 = torch.ones((*shape, width + 1), dtype=torch.float64, device=device)
        for c, row in enumerate(tables):
            for f, (grid, p0, p1) in enumerate(row):
                self.grid[c, f, : len(grid)] = grid
                self.p0[c, f, : len(p0)], self.p0[c, f, len(p0) :] = p0, p0[-1]
                self.p1[c, f, : len(p1)], self.p1[c, f, len(p1) :] = p1, p1[-1]
        # deployment priors: Bayes' rule from the data's class frequencies, log(priors / frequencies)
        # (finite_log: a prior of 0 leaves its class at exp(-708), not at log(0) = -inf)
        self.log_prior_ratio = (torch.zeros(self.num_classes, dtype=torch.float64, device=device) if weights is None
                                else finite_log(weights))
        self.loss = loss
        return FitRecord(0, 1, float("nan"), 0.0, True, "closed form")

    # ------------------------------------------------------------------------ prediction
    def _intervals(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """``(p0, p1)``, each (N, C, F), for binary scores (N, C)."""
        lower, upper = [], []
        for c in range(scores.shape[1]):
            s = scores[:, c].contiguous()
            for f in range(self.folds):
                # bucketize (searchsorted has no ONNX function): venn_abers_table's look-up with ties
                # within a tie tolerance of the grid (shifted on the grid: ONNX exporters fold
                # s - 1e-12 into s). The groups are more than two tolerances apart, so one group's
                # raised end and the next group's lowered start do not cross; where they round onto
                # each other, a test score there ties with the lower group for p0 as for p1 (both
                # searches count the shifted scores strictly below it). Exact ties alone made a
                # calibration sample's own output depend on the last bit of its log-softmax (ONNX
                # Runtime moved 64 of 2,000 AG News calibration rows to the neighbouring step).
                grid = self.grid[c, f]
                margin = torch.where(torch.isfinite(grid), tie_tolerance(grid), 0.0)  # (the padding: +inf)
                lower.append(self.p0[c, f][torch.bucketize(s, grid - margin, right=False)])
                upper.append(self.p1[c, f][torch.bucketize(s, grid + margin, right=False)])
        shape = (scores.shape[0], scores.shape[1], self.folds)
        return torch.stack(lower, 1).reshape(shape), torch.stack(upper, 1).reshape(shape)

    def _scores(self, features: Tensor) -> Tensor:
        return nan_rows_stay_nan(features, self._class_scores(_merge(*self._intervals(features), self.loss)) + self.log_prior_ratio)

    def _class_scores(self, probs: Tensor) -> Tensor:
        """Unnormalised class log-posteriors (N, K) from the binary problems' probabilities (N, C)."""
        k = self.num_classes
        if k == 2:
            return torch.cat([(-probs).log1p(), probs.log()], dim=1)
        if self.multiclass == "ovr":
            return probs.log()
        # pairwise coupling: P_k = 1 / (sum_{l != k} 1 / P(k | k or l) - (K - 2)), the sums as
        # products with the (C, K) incidence matrices of the pairs (an index_add_ with repeated
        # indices becomes an overwriting ScatterElements in the legacy ONNX exporter)
        eye = torch.eye(k, dtype=probs.dtype, device=probs.device)
        negative, positive = (eye[list(side)] for side in zip(*self._pairs(k)))
        return -((1 / probs) @ positive + (1 / (1 - probs)) @ negative - (k - 2)).log()

    def forward(self, logits: Tensor) -> Tensor:
        """Calibrated log-posteriors (N, K), the same map for every input dtype, returned in the
        input's compute dtype."""
        logits = self._check_input(logits)
        return torch.log_softmax(self._scores(self._features(logits)), dim=1).to(compute_dtype(logits.dtype))

    def predict_interval(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The Venn–Abers intervals ``(p0, p1)`` of ``logits: (N, K)``, each (N, C, F) in float64.

        ``C`` indexes the binary problems: one for K = 2 (class 1), K for one-vs-rest (class k
        against the rest), K(K-1)/2 for pairwise (pairs ``(i, j)``, ``i < j``, in lexicographic
        order; probability of ``j`` given ``i`` or ``j``). ``F`` indexes the folds. ``p0 <= p1``.
        """
        logits = self._check_input(logits)
        features = self._features(logits)
        return tuple(nan_rows_stay_nan(features, p) for p in self._intervals(features))  # type: ignore[return-value]

    def get_extra_state(self) -> dict[str, Any]:
        return {**super().get_extra_state(), "loss": self.loss, "folds": self.folds, "multiclass": self.multiclass}

    def _set_stored_options(self, state: dict[str, Any]) -> None:
        """Restores the folds and the multiclass scheme with the tables: they say how to read them
        (a state loaded into an instance built with other options must not be misread)."""
        self.loss = str(state.get("loss", "log"))
        if self.loss not in PER_SAMPLE_SCORES:
            raise ValueError(f"stored loss must be one of {sorted(PER_SAMPLE_SCORES)}, got {self.loss!r}.")
        self.folds = int(state.get("folds", self.folds))
        self.multiclass = str(state.get("multiclass", self.multiclass))
        if self.multiclass not in _MULTICLASS:
            raise ValueError(f"stored multiclass must be one of {_MULTICLASS}, got {self.multiclass!r}.")

    def set_extra_state(self, state: dict[str, Any]) -> None:
        super().set_extra_state(state)
        if self.is_fitted and self.grid.shape[:2] != (len(self._pairs(self.num_classes)), self.folds):
            raise ValueError(
                f"the stored tables {tuple(self.grid.shape[:2])} do not match {self.folds} folds of "
                f"{self.multiclass!r} problems for K = {self.num_classes}."
            )

    def extra_repr(self) -> str:
        return f"folds={self.folds}, multiclass={self.multiclass!r}, loss={self.loss!r}, " + super().extra_repr()
