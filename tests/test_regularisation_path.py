"""Cross-validation of the ODIR / L2 strength (warm-started path, loose selection tolerance,
abandoned points) selects what the exhaustive grid selects, with the same final parameters."""

from __future__ import annotations

import logging
import math
import re
import warnings

import pytest
import torch

import torchcal
from torchcal.fit import _TIE
from torchcal.functional import brier_score, cross_entropy


def _exhaustive(make, grid, logits, labels, loss="log"):
    """Every grid point, every fold, a cold fit to the default tolerance; the argmin and the
    final fit on all the data at it."""
    score = cross_entropy if loss == "log" else brier_score
    losses = [float(score(torchcal.cross_validate(make(lam), logits, labels, folds=5, seed=0, loss=loss), labels)) for lam in grid]
    best = min(range(len(grid)), key=losses.__getitem__)
    return losses, grid[best], make(grid[best]).fit(logits, labels, loss=loss)


def _check_same_selection(make, logits, labels, grid=torchcal.calibrators.matrix.DEFAULT_REG_GRID, together=False, loose_rtol=1e-4,
                          loss="log"):
    """``make(None)`` cross-validates over ``grid`` (lambdas, or (lambda, mu) pairs), ``make(point)``
    fits at one of its points; ``together``: the folds of each point as one batched problem;
    ``loose_rtol``: how far the loose selection fits may move an out-of-fold loss."""
    path = make(None)
    path.cv_together = together
    path.fit(logits, labels, loss=loss)
    losses, best, final = _exhaustive(make, grid, logits, labels, loss)
    assert (path.reg_lambda_, path.reg_mu_) == best if isinstance(best, tuple) else path.reg_lambda_ == best
    torch.testing.assert_close(path.weight, final.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(path.bias, final.bias, rtol=0, atol=1e-6)
    tried = [i for i, v in enumerate(path.cv_losses_) if math.isfinite(v)]
    assert grid.index(best) in tried
    for i in tried:  # the selection tolerance (gradient 1e-4) moves the out-of-fold losses by up to ~3e-5
        assert path.cv_losses_[i] == pytest.approx(losses[i], rel=loose_rtol)
    near_ties = [i for i in tried if path.cv_losses_[i] <= min(path.cv_losses_) * (1 + _TIE)]
    if len(near_ties) > 1:  # fitted again tightly: converged fits' losses
        for i in near_ties:
            assert path.cv_losses_[i] == pytest.approx(losses[i], rel=1e-8)
    for i, v in enumerate(path.cv_losses_):  # an abandoned point was indeed worse than the best
        if not math.isfinite(v):
            assert losses[i] > losses[grid.index(best)]
    return path


@pytest.mark.parametrize("together", [False, True], ids=["fold-by-fold", "folds-together"])
def test_path_selects_what_the_exhaustive_grid_selects_on_real_cifar100_logits(real, together):
    d = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"])
    keep = labels < 15  # the samples and columns of 15 classes: K (K+1) = 240 parameters
    path = _check_same_selection(
        lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits[keep][:, :15], labels[keep], together=together
    )
    assert not all(map(math.isfinite, path.cv_losses_))  # the path did save work here
    # lambda = 100 and 1000 are 2.3e-4 (relative) apart here: a near-tie, decided by tight fits
    assert sum(v <= min(path.cv_losses_) * (1 + _TIE) for v in path.cv_losses_) == 2


def test_the_default_grid_brackets_the_best_strength_on_real_cifar100_logits(real):
    """On the CIFAR-100 ResNet-20 logits the out-of-fold Dir-ODIR loss is lowest at lambda = 1e4,
    above the top of an earlier grid (1e3); the default grid reaches past it, and the path sees the
    loss rise on both sides."""
    d = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"])
    model = torchcal.DirichletCalibration(reg="odir").fit(logits, labels)
    losses = {lam: loss for (lam, _), loss in zip(model.reg_grid, model.cv_losses_)}
    assert model.reg_lambda_ == 1e4
    assert losses[1e5] > losses[1e4] + 5e-4 and losses[1e3] > losses[1e4] + 5e-4, losses


@pytest.mark.parametrize("make", [
    lambda lam: torchcal.MatrixScaling(reg="odir", reg_lambda=lam),
    lambda lam: torchcal.DirichletCalibration(reg="l2", reg_lambda=lam),
], ids=["matrix-odir", "dirichlet-l2"])
@pytest.mark.parametrize("together", [False, True], ids=["fold-by-fold", "folds-together"])
def test_path_selects_what_the_exhaustive_grid_selects_on_random_problems(make, together):
    gen = torch.Generator().manual_seed(12)
    latent = 2 * torch.randn(1500, 8, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(8, dtype=torch.float64) + 0.3 * torch.randn(8, 8, generator=gen, dtype=torch.float64)
    _check_same_selection(make, 3 * latent @ mixing + torch.linspace(-1, 1, 8, dtype=torch.float64), labels, together=together)


_STRONG_GRID = [0.1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5]  # (the default grid's weak end, 1e-4 to 1e-2, takes the test's time)


@pytest.mark.parametrize("make", [
    lambda lam: torchcal.MatrixScaling(reg="odir", reg_lambda=lam, reg_grid=_STRONG_GRID),
    lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam, reg_grid=_STRONG_GRID),
], ids=["MS-ODIR", "Dir-ODIR"])
def test_the_brier_path_selects_what_the_exhaustive_grid_selects_on_real_logits(real, make):
    """The Brier fits' L-BFGS runs in coordinates scaled by each entry's curvature. Unscaled, on
    2,000 rows of the CIFAR-10 ResNet-20 logits, the selection fits at strong penalties stopped on a
    small change of the loss up to 1e-3 above their optimum: MS-ODIR chose 1e5 (the exhaustive
    grid: 10), Dir-ODIR 1e4 (1e3), with out-of-fold scores up to 1.4 % low."""
    data = real("cifar10_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"][:2000]).double(), torch.from_numpy(data["labels"][:2000])
    _check_same_selection(make, logits, labels, grid=_STRONG_GRID, loss="brier")


@pytest.mark.parametrize("make", [torchcal.MatrixScaling, torchcal.DirichletCalibration])
def test_brier_fits_at_strong_odir_penalties_converge(make):
    """The penalty (lambda / (K (K - 1)) per off-diagonal weight, the diagonal free) against the
    data's curvature: unscaled, L-BFGS ran to the 1,000-iteration cap at lambda = 1e5 (gradients
    of 1e-4) and stopped on the loss's change at a gradient of 2e-5 at 1e3; scaled, a few dozen
    iterations reach a stationary point that SciPy's L-BFGS-B cannot improve. (The gradient is
    [W | b]'s, not the scaled coordinates': a few 1e-6 on weights whose penalty's curvature is
    2 lambda / 56, a parameter error far below 1e-6; the fits stop where L-BFGS's model leaves
    nothing to gain.)"""
    scipy_optimize = pytest.importorskip("scipy.optimize")
    gen = torch.Generator().manual_seed(12)
    latent = 2 * torch.randn(1500, 8, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(8, dtype=torch.float64) + 0.3 * torch.randn(8, 8, generator=gen, dtype=torch.float64)
    logits = 3 * latent @ mixing + torch.linspace(-1, 1, 8, dtype=torch.float64)
    features = logits if make is torchcal.MatrixScaling else torch.log_softmax(logits, 1)
    one_hot = torch.nn.functional.one_hot(labels, 8).double()
    off_diagonal = ~torch.eye(8, dtype=torch.bool)
    for lam in (1e3, 1e5):
        model = make(reg="odir", reg_lambda=lam).fit(logits, labels, loss="brier")
        record = model.fit_record_
        assert record.converged and record.grad_max < 1e-5 and record.iterations < 100, record

        def objective(flat, lam=lam):
            theta = torch.tensor(flat, requires_grad=True)
            weight, bias = theta[:64].view(8, 8), theta[64:]
            q = torch.softmax(features @ weight.T + bias, 1)
            value = (q - one_hot).square().sum(1).mean() + lam / 56 * weight[off_diagonal].square().sum() + lam / 8 * bias.square().sum()
            value.backward()
            return float(value), theta.grad.detach().numpy()

        start = torch.cat([model.weight.detach().flatten(), model.bias.detach()]).numpy()
        polished = scipy_optimize.minimize(objective, start, jac=True, method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-10})
        assert objective(start)[0] == pytest.approx(record.loss, rel=1e-12)
        assert objective(start)[0] - polished.fun < 1e-10


def test_a_grid_of_lambda_mu_pairs_is_searched_past_the_first_lambda(real):
    """Kull et al.'s ODIR search: every (lambda, mu) of two lists. The path visits the pairs lambda
    by lambda, each from its largest mu; it stopped once the loss had risen twice, at the second
    lambda's two largest mus, and chose lambda = 1e4 here where the exhaustive search's best is
    lambda = 100 (MS-ODIR, the Kängsepp CIFAR-10 validation logits)."""
    d = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(d["logits_val"]).double(), torch.from_numpy(d["labels_val"])
    grid = {"lambda": [1e4, 1e2, 1.0], "mu": [1e3, 1e1, 1e-3]}
    pairs = [(lam, mu) for lam in grid["lambda"] for mu in grid["mu"]]

    def make(point):
        if point is None:
            return torchcal.MatrixScaling(reg="odir", reg_grid=grid)
        return torchcal.MatrixScaling(reg="odir", reg_lambda=point[0], reg_mu=point[1])

    path = _check_same_selection(make, logits, labels, grid=pairs)
    assert path.reg_grid == pairs and (path.reg_lambda_, path.reg_mu_) == (1e2, 1e-3)
    with pytest.raises(ValueError, match="exactly the keys 'lambda' and 'mu'"):
        torchcal.MatrixScaling(reg="odir", reg_grid={"lambda": [1.0]})


def test_the_path_and_the_newton_steps_are_logged(caplog):
    """A long fit says what it is doing: every Newton step (logger torchcal.calibrators._multinomial,
    DEBUG) and every strength the path tries (torchcal.fit, INFO), with the losses it records."""
    gen = torch.Generator().manual_seed(3)
    latent = 2 * torch.randn(600, 5, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    with caplog.at_level(logging.DEBUG, logger="torchcal"):
        model = torchcal.DirichletCalibration(reg="odir").fit(3 * latent, labels)
    steps = [r for r in caplog.records if r.name == "torchcal.calibrators._multinomial"]
    assert steps and all(r.levelno == logging.DEBUG and "Newton-CG (" in r.getMessage() for r in steps)
    assert f"loss {model.fit_record_.loss:.10f}" in steps[-1].getMessage()
    logged = {}
    for record in caplog.records:
        # the first value of a point, and again if it was a near-tie fitted again tightly
        found = re.match(r"regularisation path: DirichletCalibration lambda = (\S+), mu = \S+[, ].*out-of-fold loss (\S+)", record.getMessage())
        if found:
            logged[float(found[1])] = float(found[2])
    tried = {lam: loss for (lam, _), loss in zip(model.reg_grid, model.cv_losses_) if math.isfinite(loss)}
    assert logged.keys() == tried.keys()
    for lam, loss in tried.items():
        assert logged[lam] == pytest.approx(loss, abs=1e-6)


def test_secant_start_extrapolates_in_log_lambda_at_most_one_step():
    from torchcal.fit import secant_start

    one, two = torch.tensor([1.0, -2.0]), torch.tensor([2.0, -1.0])
    torch.testing.assert_close(secant_start([(100.0, one), (10.0, two)], 1.0), torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(secant_start([(100.0, one), (10.0, two)], 10 ** 0.5), torch.tensor([2.5, -0.5]))
    torch.testing.assert_close(secant_start([(100.0, one), (10.0, two)], 1e-3), torch.tensor([3.0, 0.0]))  # capped
    assert secant_start([(10.0, two)], 1.0) is None  # one fit: start from it
    assert secant_start([(100.0, one), (10.0, two)], 0.0) is None  # lambda = 0 is off the log scale
    assert secant_start([(10.0, one), (10.0, two)], 1.0) is None  # (lambda, mu) pairs of one lambda


def test_the_warm_path_chains_the_starts_and_refits_near_ties_from_the_loose_fits():
    """``cross_validate_warm_path`` hands every fold fit its start: nothing (the model's own
    state) for the first fold at the first point, the previous fold's fit for the other folds
    there, the fold's own last fit at the second point (``None``), the secant extrapolation from
    the third on, and the loose fit itself for a near-tie's tight refit. It returns the folds'
    mean parameters at the best point."""
    from torchcal.fit import cross_validate_warm_path

    strengths = [100.0, 10.0, 1.0, 1.0 + 1e-9]
    # fold losses: point 1 is best, point 3 within the tie margin of it, point 2 well behind
    point_loss = {0: 3.0, 1: 1.0, 2: 2.0, 3: 1.0 + 1e-6}
    calls = []

    def fit_fold(point, fold, start, tight):
        calls.append((point, fold, None if start is None else start.tolist(), tight))
        theta = torch.tensor([float(point), float(fold)]) + (0.5 if tight else 0.0)
        return torch.tensor(point_loss[point], dtype=torch.float64), theta

    losses, start = cross_validate_warm_path([0, 1, 2, 3], strengths, 2, fit_fold, 2, patience=5, tie=1e-4, race=None)
    loose = {(p, f): s for p, f, s, tight in calls if not tight}
    assert loose[0, 0] is None and loose[0, 1] == [0.0, 0.0]  # the first point: the previous fold's fit
    assert loose[1, 0] is None and loose[1, 1] is None  # one fit before: the model's own last fit
    assert loose[2, 0] == [2.0, 0.0] and loose[2, 1] == [2.0, 1.0]  # secant from (100, 10) to 1
    refits = {(p, f): s for p, f, s, tight in calls if tight}
    assert refits == {(1, 0): [1.0, 0.0], (1, 1): [1.0, 1.0], (3, 0): [3.0, 0.0], (3, 1): [3.0, 1.0]}
    assert losses == pytest.approx([3.0, 1.0, 2.0, 1.0 + 1e-6])  # (2 samples: a fold loss each)
    torch.testing.assert_close(start, torch.tensor([1.5, 1.0]))  # the best point's refits, averaged


def test_the_path_races_a_point_behind_the_best_on_the_same_folds(caplog):
    """A point that trails the best on the test samples of its first folds by more than ``race``
    standard errors of the mean paired difference is abandoned there; one inside that margin, or
    any point with ``race=None`` that could still win, is fitted on every fold. Below
    ``_RACE_MIN_SAMPLES`` test samples or ``_RACE_MIN_FOLDS`` folds so far, no point is raced; the
    standard error is the larger of the samples' and the folds' (whose losses move together)."""
    from torchcal.fit import _RACE, _RACE_MIN_FOLDS, _RACE_MIN_SAMPLES, cross_validate_path

    assert _RACE == 3.0 and _RACE_MIN_SAMPLES == 200 and _RACE_MIN_FOLDS == 3

    def fold_losses(fold_size: int, behind: dict[int, list[float]]):
        """Per-sample losses: the best point's 2.0 each; point p's 2.0 + behind[p][fold] +- 1 (so the
        paired differences have mean behind[p][fold] and standard deviation 1)."""
        noise = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(fold_size // 2)
        return lambda point, fold: 2.0 + (behind[point][fold] + noise if point else 0 * noise)

    behind = {0: [0.0] * 5, 1: [0.2, 0.2, -0.5, -0.5, -0.5], 2: [0.3] * 5, 3: [0.05] * 5, 4: [0.6, 0.0, 0.6, -3.0, -3.0]}
    fitted = []
    loss = fold_losses(100, behind)

    def fold_loss(point, fold):
        fitted.append((point, fold))
        return loss(point, fold)

    # after three folds (300 samples) one standard error is 1 / sqrt(300): point 2 is 5.2 behind
    with caplog.at_level(logging.INFO, logger="torchcal.fit"):
        losses = cross_validate_path([0, 2, 3, 1, 4], 5, fold_loss, 500, patience=5)
    assert [f for p, f in fitted if p == 2] == [0, 1, 2] and losses[2] == math.inf  # (after two folds: too few)
    assert "grid point 2 abandoned after 3 of 5 folds (behind the best by 5.2 standard errors on them)" in caplog.text
    assert [f for p, f in fitted if p == 3] == [0, 1, 2, 3, 4] and losses[3] == pytest.approx(2.05)  # 0.9 standard errors
    assert [f for p, f in fitted if p == 1] == [0, 1, 2, 3, 4] and losses[1] == pytest.approx(1.78)  # ahead after three
    # point 4: 6.7 standard errors behind over the samples after three folds, but its folds' sums
    # (60, 0, 60) spread so that it is 2 behind over the folds: kept, and the best in the end
    assert [f for p, f in fitted if p == 4] == [0, 1, 2, 3, 4] and losses[4] == pytest.approx(1.04)
    fitted.clear()
    losses = cross_validate_path([0, 2, 3, 1, 4], 5, fold_loss, 500, patience=5, race=None)
    assert losses == pytest.approx([2.0, 1.78, 2.3, 2.05, 1.04])  # the bound alone rules nothing out here
    # folds of 20 samples, point 2 0.5 behind on each: 5 standard errors after all 100, but too few to race on
    small = fold_losses(20, {**behind, 2: [0.5] * 5})
    losses = cross_validate_path([0, 2, 3, 1], 5, small, 100, patience=5)
    assert losses[2] == pytest.approx(2.5)
    # behind by the same on every sample: no spread, infinitely many standard errors
    with caplog.at_level(logging.INFO, logger="torchcal.fit"):
        losses = cross_validate_path([0, 1], 5, lambda point, fold: torch.full((100,), 1.0 + 0.5 * point, dtype=torch.float64), 500)
    assert losses[1] == math.inf and "behind the best by inf standard errors" in caplog.text


def test_the_path_walks_on_over_a_plateau_within_the_loose_fits_error():
    """The loss counts as risen only above ``tie`` (relative) past the best: a plateau of strong
    penalties whose loose losses wobble by 1e-5 (Dir-ODIR on the SST-2 GPT-2 logits: 0.3470570,
    0.3470585, 0.3470586 at lambda = 1e5, 1e4, 1e3, which stopped the path there) does not stop the
    path before the weak penalties where the loss falls."""
    from torchcal.fit import cross_validate_path

    curve = [0.3470570, 0.3470585, 0.3470586, 0.3470584, 0.3469968, 0.3465050, 0.3441517, 0.3460000, 0.3470000]
    losses = cross_validate_path(range(len(curve)), 1, lambda point, fold: torch.tensor([curve[point]], dtype=torch.float64), 1)
    assert min(range(len(curve)), key=losses.__getitem__) == 6
    assert losses[7] == pytest.approx(curve[7]) and losses[8] == pytest.approx(curve[8])  # two rises past the best, then stop


def test_the_warm_path_fits_a_point_s_folds_together_and_refines_them_together():
    """With ``fit_folds``, each point's folds are fitted in one call, from the folds' starts (none
    at the first point, the secant from the third), near-ties refitted in one call from their loose
    fits; a point behind the best on its first folds is not raced away (its folds are all fitted)."""
    from torchcal.fit import cross_validate_warm_path

    strengths = [100.0, 10.0, 1.0, 1.0 + 1e-9]
    point_loss = {0: 3.0, 1: 1.0, 2: 2.0, 3: 1.0 + 1e-6}
    calls = []

    def fit_folds(point, starts, tight):
        calls.append((point, [None if s is None else s.tolist() for s in starts], tight))
        thetas = [torch.tensor([float(point), float(fold)]) + (0.5 if tight else 0.0) for fold in range(2)]
        return [torch.tensor([point_loss[point]], dtype=torch.float64)] * 2, thetas

    def fit_fold(point, fold, start, tight):
        raise AssertionError("the folds one by one")

    losses, start = cross_validate_warm_path([0, 1, 2, 3], strengths, 2, fit_fold, 2, patience=5, tie=1e-4, fit_folds=fit_folds)
    assert calls == [
        (0, [None, None], False), (1, [None, None], False), (2, [[2.0, 0.0], [2.0, 1.0]], False), (3, [[2.0, 0.0], [2.0, 1.0]], False),
        (1, [[1.0, 0.0], [1.0, 1.0]], True), (3, [[3.0, 0.0], [3.0, 1.0]], True),
    ]
    assert losses == pytest.approx([3.0, 1.0, 2.0, 1.0 + 1e-6])
    torch.testing.assert_close(start, torch.tensor([1.5, 1.0]))


def test_folds_fitted_together_that_do_not_converge_are_fitted_one_by_one(monkeypatch):
    """A batched fit that stops unconverged (here at a cap of one Newton step) hands its point to
    the folds one by one (each then finishing by L-BFGS): the selection and the final fit are those
    of the folds one by one."""
    monkeypatch.setattr(torchcal.calibrators.matrix, "MAX_NEWTON_STEPS", 1)
    gen = torch.Generator().manual_seed(5)
    latent = 2 * torch.randn(600, 4, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    fitted = {together: torchcal.DirichletCalibration(reg="odir", reg_grid=(1e-2, 1.0, 100.0), cv_together=together).fit(3 * latent, labels)
              for together in (True, False)}
    assert fitted[True].reg_lambda_ == fitted[False].reg_lambda_
    torch.testing.assert_close(fitted[True].weight, fitted[False].weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("together", [False, True], ids=["fold-by-fold", "folds-together"])
def test_a_tiny_data_set_is_not_raced(together):
    """40 samples, folds of 8: the race's earlier relative margin, 0.5 / sqrt(n), dropped lambda = 1
    after its first fold (18 % behind there, 2 % ahead of lambda = 10 in the end), and the path
    stopped at 10, short of the best (0.01). Below ``_RACE_MIN_SAMPLES`` test samples no point is
    raced, and both ways of fitting the folds select what the exhaustive grid selects."""
    gen = torch.Generator().manual_seed(3)
    latent = 2 * torch.randn(40, 3, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(3, dtype=torch.float64) + 0.3 * torch.randn(3, 3, generator=gen, dtype=torch.float64)
    logits = 3 * latent @ mixing + torch.linspace(-1, 1, 3, dtype=torch.float64)
    path = _check_same_selection(lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels, together=together)
    assert path.reg_lambda_ == 0.01


def test_a_plateau_of_strong_penalties_does_not_stop_the_path_on_real_logits(real):
    """Dir-ODIR on the SST-2 GPT-2 0-shot logits (K = 2): from lambda = 1e5 to 1e2 the out-of-fold
    loss is flat to 1e-6 (the free diagonal already gives any log-odds line), and the loose fits'
    error made two of those points look like rises, so the path stopped at 1e3, 0.85 % above the
    best (1e-4). It walks on now, and selects what the exhaustive grid selects."""
    d = real("sst2_gpt2-0shot_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"]).long()
    path = _check_same_selection(lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels)
    assert path.reg_lambda_ == 1e-4


def test_the_race_keeps_the_eventual_best_on_real_cifar100_logits(real):
    """MS-ODIR on 10 classes of the CIFAR-100 RepVGG-A2 logits (1,000 samples): lambda = 0.1, the
    best, trails lambda = 1 by 4.2 % after three folds; the relative race margin of before (0.5 /
    sqrt(n): 2.0 %) dropped it and the path chose 1, 3.4 % worse. Three standard errors of the
    paired differences keep it."""
    d = real("cifar100_repvgg-a2_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"])
    keep = labels < 10
    # on 1,000 samples the loose fits move the out-of-fold losses by up to 1.5e-4 (lambda = 1e5)
    path = _check_same_selection(lambda lam: torchcal.MatrixScaling(reg="odir", reg_lambda=lam), logits[keep][:, :10], labels[keep],
                                 loose_rtol=_TIE)
    assert path.reg_lambda_ == 0.1


def _rows(real, name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = real(name)
    keep = torch.randperm(len(d["labels"]), generator=torch.Generator().manual_seed(seed))[:n]
    return torch.from_numpy(d["logits"]).double()[keep], torch.from_numpy(d["labels"])[keep]


def test_small_problems_select_on_converged_fits_as_the_exhaustive_grid(real):
    """800 CIFAR-10 VGG-19 rows, Dir-ODIR: an unpenalised diagonal entry grows from 2.2 to 71 on the
    way to a fold's optimum at lambda = 1e5 while the loss falls by 4e-4, so the selection fits
    (to a gradient of 1e-4) stopped early: out-of-fold losses 24 % low, lambda = 1e5 chosen
    against the exhaustive grid's 10 (a review). Small problems' selection fits are tight."""
    logits, labels = _rows(real, "cifar10_vgg19bn_ferrer", 800, 3)
    path = _check_same_selection(lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels,
                                 loose_rtol=1e-6)
    assert path.reg_lambda_ == 10


def test_the_race_waits_for_the_folds_to_vary(real):
    """500 CIFAR-10 ResNet-110 rows, Dir-ODIR: lambda = 10 trailed lambda = 100 by 3.1 standard
    errors of the samples after two folds (fold sums [51.3, 22.2] against [41.1, 16.7]) and was
    dropped, though its third fold (212.6 against 261.5) makes it the best, 0.644 against 0.703."""
    logits, labels = _rows(real, "cifar10_resnet110_kangsepp", 500, 2)
    path = _check_same_selection(lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels,
                                 loose_rtol=1e-6)
    assert path.reg_lambda_ == 10


def test_the_race_leaves_near_ties_to_the_tight_refits():
    """A point 1e-5 (relative) behind the best on every sample is many standard errors behind on
    2,000 samples, but well inside the loose fits' error (``tie``): it is not raced, its tight refit
    puts it ahead, and it wins; a point 1 % behind is raced."""
    from torchcal.fit import cross_validate_path

    gen = torch.Generator().manual_seed(0)
    base = -torch.log(torch.rand(2000, generator=gen, dtype=torch.float64))
    split = torch.arange(2000).chunk(5)
    loose = {0: base, 1: base * (1 + 1e-5), 2: base * 1.01}
    tight = {0: base, 1: base * (1 - 1e-5), 2: base * 1.01}
    losses = cross_validate_path([0, 1, 2], 5, lambda p, f: loose[p][split[f]], 2000, refine=lambda p, f: tight[p][split[f]])
    assert min(range(3), key=losses.__getitem__) == 1 and losses[2] == math.inf
    assert losses[1] == pytest.approx(float(tight[1].mean()), rel=1e-12)


def test_losses_that_are_not_finite_count_as_rises():
    """A point whose loss is infinite (a test sample given probability 0) or NaN is no new best and
    no near-tie: past a finite best it counts toward patience; before one, the path walks on (it
    had reset the count at every point, and refitted every one of them as a near-tie of inf)."""
    from torchcal.fit import cross_validate_path

    curve = [math.inf, math.nan, 1.0, 0.9, math.inf, math.nan, 0.5]
    refits = []

    def refine(point, fold):
        refits.append(point)
        return torch.tensor([curve[point]], dtype=torch.float64)

    losses = cross_validate_path(range(len(curve)), 1, lambda point, fold: torch.tensor([curve[point]], dtype=torch.float64), 1, refine=refine)
    assert losses[3] == 0.9 and losses[6] == math.inf and refits == []  # two rises after 0.9: stopped before 0.5
    assert losses[1] == losses[5] == math.inf  # NaN: no loss (as the first point, it would have won every min())
    losses = cross_validate_path(range(2), 1, lambda point, fold: torch.tensor([math.inf], dtype=torch.float64), 1, refine=refine)
    assert losses == [math.inf, math.inf] and refits == []


def test_the_final_fit_starts_from_the_identity_where_the_folds_went_astray():
    """Few rows, classes missing from the folds' training parts: the folds' mean deviation, where
    the final fit started, was far worse than the identity (300 CIFAR-100 rows: objective 4e4
    against 1.2; here 60 rows of K = 20), and the final fit stopped at its cap, unconverged and
    over-fitted to nonsense. It starts from the better of the two, and reaches the optimum of a
    cold fit at the selected strengths."""
    torch.manual_seed(0)
    latent = torch.randn(60, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=2 * latent).sample()
    logits = 10 * latent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = torchcal.DirichletCalibration(reg="odir").fit(logits, labels)
        cold = torchcal.DirichletCalibration(reg="odir", reg_lambda=chosen.reg_lambda_, reg_mu=chosen.reg_mu_).fit(logits, labels)
    assert chosen.fit_record_.converged and chosen.fit_record_.loss == pytest.approx(cold.fit_record_.loss, abs=1e-9)
    with torch.no_grad():
        assert cross_entropy(chosen(logits), labels) < cross_entropy(logits, labels)
