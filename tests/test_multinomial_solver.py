"""The Newton-CG solver of the full-matrix family (torchcal.calibrators._multinomial) reaches the
optimum of the reference solvers: exact Newton with the dense Hessian (``fit_linear_newton`` with
``FullDesign``, the previous solver), the generic L-BFGS driver, and SciPy in float64."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.optimize import minimize as scipy_minimize
from scipy.special import log_softmax

import torchcal
from torchcal.calibrators._linear import FullDesign, fit_linear_newton
from torchcal.calibrators._multinomial import fit_multinomial_logistic


def _problem(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    latent = 2 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(k, dtype=torch.float64) + 0.2 * torch.randn(k, k, generator=gen, dtype=torch.float64)
    return 2.5 * latent @ mixing + torch.linspace(-1, 1, k, dtype=torch.float64), labels


def _real_subset(real, classes: int = 20):
    """CIFAR-100 ResNet-20 logits restricted to the samples and columns of the first classes."""
    d = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"])
    keep = labels < classes
    return logits[keep][:, :classes], labels[keep]


def _reference(cal: torchcal.MatrixScaling, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Exact Newton (dense (K(K+1))^2 Hessian) on the same objective, from the identity."""
    k = logits.shape[1]
    cal.reg_lambda_ = cal.reg_lambda
    cal.reg_mu_ = cal.reg_lambda if cal.reg_mu is None else cal.reg_mu
    features = cal._features(logits)
    start = torch.eye(k, k + 1, dtype=torch.float64).flatten()
    penalty = cal._penalty_weights(k).flatten() if cal.reg else None
    theta, record = fit_linear_newton(FullDesign(), features, labels, None, start, penalty)
    assert record.converged
    return theta.view(k, k + 1)


def _fitted(cal: torchcal.MatrixScaling) -> torch.Tensor:
    return torch.cat([cal.weight, cal.bias.unsqueeze(1)], dim=1).detach()


@pytest.mark.parametrize("lam", [1e-3, 1.0, 100.0])
@pytest.mark.parametrize(
    "make",
    [
        lambda lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam),
        lambda lam: torchcal.MatrixScaling(reg="odir", reg_lambda=lam, reg_mu=lam / 3),
        lambda lam: torchcal.DirichletCalibration(reg="l2", reg_lambda=lam),
    ],
    ids=["dirichlet-odir", "matrix-odir", "dirichlet-l2"],
)
def test_newton_cg_reaches_the_exact_newton_optimum(make, lam):
    logits, labels = _problem(2000, 6, seed=int(lam * 1000) % 97)
    cal = make(lam).fit(logits, labels)
    reference = _reference(make(lam), logits, labels)
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9
    torch.testing.assert_close(_fitted(cal), reference, rtol=0, atol=1e-6)


def test_newton_cg_reaches_the_exact_newton_optimum_on_real_cifar100_logits(real):
    logits, labels = _real_subset(real)
    for lam in (1e-2, 1.0):
        cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels)
        reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels)
        torch.testing.assert_close(_fitted(cal), reference, rtol=0, atol=1e-6)


def test_unregularised_matrix_scaling_reaches_the_scipy_optimum():
    """No penalty: the optimum is a family (a constant added to every class's scores); the loss
    matches SciPy's float64 L-BFGS-B and the solver returns the class-centred member."""
    logits, labels = _problem(3000, 4, seed=3)
    cal = torchcal.MatrixScaling().fit(logits, labels)
    z, y = logits.numpy(), labels.numpy()
    n, k = z.shape
    onehot = np.eye(k)[y]
    xa = np.c_[z, np.ones(n)]

    def fun(theta):
        w = theta.reshape(k, k + 1)
        log_q = log_softmax(xa @ w.T, axis=1)
        return -log_q[np.arange(n), y].mean(), ((np.exp(log_q) - onehot).T @ xa / n).ravel()

    res = scipy_minimize(fun, np.eye(k, k + 1).ravel(), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-16, "maxiter": 10_000})
    assert cal.fit_record_.loss == pytest.approx(res.fun, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(_fitted(cal).sum(0), torch.zeros(k + 1, dtype=torch.float64), rtol=0, atol=1e-9)


def test_row_order_and_precision_do_not_change_the_fit():
    logits, labels = _problem(3000, 8, seed=4)
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(0))
    fits = [
        torchcal.DirichletCalibration(reg="odir", reg_lambda=0.01).fit(z, y)
        for z, y in ((logits, labels), (logits[perm], labels[perm]), (logits.float(), labels))
    ]
    torch.testing.assert_close(_fitted(fits[1]), _fitted(fits[0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(_fitted(fits[2]), _fitted(fits[0]), rtol=0, atol=1e-4)  # float32 logits are rounded


def _record_mm_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype of every ``torch.mm`` product from now on (the solver's Hessian products)."""
    used = []
    original = torch.mm

    def recording_mm(a, b, **kwargs):
        used.append(a.dtype)
        return original(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    return used


@pytest.mark.parametrize("ieee", [True, False])
def test_float32_hessian_products_reach_the_float64_optimum(monkeypatch, ieee):
    """Hessian products run in float32 (only the Newton directions depend on them); where
    float32 matrix products may round to TF32 / bfloat16 they stay in float64. Either way the fit
    reaches the exact Newton optimum."""
    logits, labels = _problem(3000, 12, seed=9)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_float32_products_are_ieee", lambda device: ieee)
    used = _record_mm_dtypes(monkeypatch)
    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3).fit(logits, labels)
    monkeypatch.undo()
    assert set(used) == {torch.float32 if ieee else torch.float64}
    reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3), logits, labels)
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9
    torch.testing.assert_close(_fitted(cal), reference, rtol=0, atol=1e-6)


def test_a_stalled_float32_cg_hands_over_to_float64_products(monkeypatch):
    """Past ``_FLOAT32_CG_STEPS`` CG steps the fit goes on with float64 products (here at the
    first step) and still reaches the exact Newton optimum."""
    logits, labels = _problem(2000, 6, seed=10)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_float32_products_are_ieee", lambda device: True)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_FLOAT32_CG_STEPS", 0)
    used = _record_mm_dtypes(monkeypatch)
    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels)
    monkeypatch.undo()
    assert set(used) == {torch.float64}
    reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1), logits, labels)
    torch.testing.assert_close(_fitted(cal), reference, rtol=0, atol=1e-6)


def test_absent_classes_converge_with_float32_products(real, monkeypatch):
    """CIFAR-100 ResNet-20 logits without 3 of the classes: ODIR leaves their diagonal weights
    free, so their scores run down without bound and CG needs curvature below float32 round-off.
    Float32 products alone stalled CG at every Newton step (1,017 passes and 408 s, unconverged);
    the hand-over to float64 converges, to the float64 fit's objective and present classes."""
    d = real("cifar100_resnet20_ferrer")
    logits, labels = torch.from_numpy(d["logits"]), torch.from_numpy(d["labels"])
    keep = labels >= 3
    fits = {}
    for ieee in (True, False):
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_float32_products_are_ieee", lambda device, ieee=ieee: ieee)
        with pytest.warns(UserWarning, match="no sample"):
            fits[ieee] = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0).fit(logits[keep], labels[keep])
    assert fits[True].fit_record_.converged and fits[True].fit_record_.grad_max < 1e-9
    assert fits[True].fit_record_.loss == pytest.approx(fits[False].fit_record_.loss, abs=1e-10)
    torch.testing.assert_close(_fitted(fits[True])[3:], _fitted(fits[False])[3:], rtol=0, atol=1e-6)


def _pass_precisions(caplog) -> list[str]:
    """The precision of the gradients and losses of every Newton step logged."""
    return [m.group(1) for r in caplog.records if (m := re.search(r"step \d+ on (\w+) passes", r.getMessage()))]


def test_float32_passes_far_from_the_optimum_then_float64_ones(monkeypatch, caplog):
    """A fit on float64 features takes its first Newton steps on float32 gradients and losses and
    its last ones on float64 ones, and reaches the exact Newton optimum; a fit to
    ``_FLOAT32_TOL_GRAD`` (cross-validation's selection fits) runs on float32 passes alone."""
    logits, labels = _problem(3000, 12, seed=9)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_float32_products_are_ieee", lambda device: True)
    with caplog.at_level(logging.DEBUG, logger="torchcal.calibrators._multinomial"):
        cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0).fit(logits, labels)
    steps = _pass_precisions(caplog)
    switch = steps.index("float64")
    assert switch >= 2 and set(steps[switch:]) == {"float64"}, steps
    reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0), logits, labels)
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9
    torch.testing.assert_close(_fitted(cal), reference, rtol=0, atol=1e-6)

    caplog.clear()
    k = logits.shape[1]
    features = torch.log_softmax(logits, dim=1)
    loose = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0)
    loose.reg_lambda_ = loose.reg_mu_ = 1.0
    with caplog.at_level(logging.DEBUG, logger="torchcal.calibrators._multinomial"):
        theta, record = fit_multinomial_logistic(
            features, labels, torch.full((3000,), 1 / 3000, dtype=torch.float64), torch.eye(k, k + 1, dtype=torch.float64),
            loose._penalty_weights(k), tol_grad=torchcal.calibrators._multinomial._FLOAT32_TOL_GRAD,
        )
    assert record.converged and set(_pass_precisions(caplog)) == {"float32"}
    assert (theta - reference).abs().max() < 1e-2

    # A float32 gradient that falls below a tighter tolerance (here 1e-3 -> 3e-6 in one step) is
    # checked on a float64 pass: the record holds the float64 objective, not the float32 one
    # (4e-9 below it here).
    theta, record = fit_multinomial_logistic(
        features, labels, torch.full((3000,), 1 / 3000, dtype=torch.float64), torch.eye(k, k + 1, dtype=torch.float64),
        loose._penalty_weights(k), tol_grad=1e-5,
    )
    scores = features @ theta[:, :-1].T + theta[:, -1]
    objective = torch.nn.functional.cross_entropy(scores, labels) + (loose._penalty_weights(k) * theta.square()).sum()
    assert record.converged and record.loss == pytest.approx(float(objective), abs=1e-13)


def test_a_short_step_on_float32_passes_ends_them(monkeypatch, caplog):
    """Here the float32 gradient's round-off (2e-4: large scores leave the softmax few digits)
    stays above ``_FLOAT32_TOL_GRAD``, and the line search cut the Newton steps ever shorter on the
    float32 loss's round-off: 251 steps, 6,339 passes. A short step whose predicted decrease is
    near that round-off ends the float32 passes instead."""
    logits, labels = _problem(2000, 8, seed=11)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_float32_products_are_ieee", lambda device: True)
    with caplog.at_level(logging.DEBUG, logger="torchcal.calibrators._multinomial"):
        cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1e5).fit(logits, labels)
    steps = _pass_precisions(caplog)
    assert "float32" in steps and steps[-1] == "float64"
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9 and cal.fit_record_.evaluations <= 40


def test_tight_systems_on_float32_passes_sum_their_blocks_about_the_mean(real):
    """The cross-validation's path fits lambda = 1e-3 from its 1e-2 fit, both to a gradient of
    1e-4, so on float32 passes throughout. Blocks for its tight Newton systems summed from the
    float32 rows as they are (not about their mean, as for loose systems) lost the small
    eigenvalues of these nearly singular blocks to round-off: Cholesky failed even with the
    stronger ridge, and the fit raised. Summed about the mean, they converge."""
    d = real("cifar100_resnet20_ferrer")
    features, labels = torch.log_softmax(torch.from_numpy(d["logits"]).double(), dim=1), torch.from_numpy(d["labels"])
    n, k = features.shape
    sample_w = torch.full((n,), 1 / n, dtype=torch.float64)
    theta = torch.eye(k, k + 1, dtype=torch.float64)
    for lam in (1e-2, 1e-3):
        cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam)
        cal.reg_lambda_ = cal.reg_mu_ = lam
        theta, record = fit_multinomial_logistic(features, labels, sample_w, theta, cal._penalty_weights(k), tol_grad=1e-4)
        assert record.converged and record.grad_max < 1e-4


def test_blocks_left_indefinite_by_round_off_get_a_stronger_ridge(real):
    """Raw CIFAR-100 logits 100 times too large, matrix scaling at lambda = 1e-4: some blocks
    summed from float32 rows had eigenvalues of -6e-9 times their largest, which the ridge of 1e-6
    of the mean diagonal did not cover, and Cholesky raised. The ridge grows on the blocks that
    fail until they factorise."""
    d = real("cifar100_resnet20_ferrer")
    logits, labels = 100 * torch.from_numpy(d["logits"][:1000]).double(), torch.from_numpy(d["labels"][:1000])
    with pytest.warns(torchcal.ConvergenceWarning, match="perfectly separated"):  # 10,100 parameters, 1,000 samples
        cal = torchcal.MatrixScaling(reg="odir", reg_lambda=1e-4).fit(logits, labels)
    assert cal.fit_record_.grad_max < 1e-9 and "gradient below tolerance" in cal.fit_record_.message


def test_a_loose_warm_started_fit_keeps_its_blocks(real, monkeypatch):
    """A fit to ``_KEEP_BLOCKS_TOL_GRAD`` started from the fit at the next stronger penalty (as the
    cross-validation's path does) forms its blocks once and keeps them while CG converges fast; a
    tight fit keeps them only while CG needs at most ``_KEEP_STEPS_PER_DECADE`` steps per decade
    (none: it forms them at every Newton step). All reach their tolerance."""
    logits, labels = _real_subset(real)
    features = torch.log_softmax(logits, dim=1)
    n, k = features.shape
    sample_w = torch.full((n,), 1 / n, dtype=torch.float64)
    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0)
    cal.reg_lambda_ = cal.reg_mu_ = 10.0
    start, _ = fit_multinomial_logistic(features, labels, sample_w, torch.eye(k, k + 1, dtype=torch.float64), cal._penalty_weights(k))
    cal.reg_lambda_ = cal.reg_mu_ = 1.0
    factorisations = []
    original = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda *args, **kwargs: factorisations.append(1) or original(*args, **kwargs))
    module = torchcal.calibrators._multinomial

    def steps_and_factorisations(tol: float) -> tuple[int, int]:
        factorisations.clear()
        _, record = fit_multinomial_logistic(features, labels, sample_w, start, cal._penalty_weights(k), tol_grad=tol)
        assert record.converged and record.grad_max <= tol
        return record.iterations, len(factorisations)

    loose_steps, loose_formed = steps_and_factorisations(module._KEEP_BLOCKS_TOL_GRAD)
    tight_steps, tight_formed = steps_and_factorisations(1e-9)
    monkeypatch.setattr(module, "_KEEP_STEPS_PER_DECADE", 0.0)
    never_kept_steps, never_kept_formed = steps_and_factorisations(1e-9)
    assert loose_formed == 1 < loose_steps
    assert 1 < tight_formed < tight_steps
    assert never_kept_formed == never_kept_steps


def test_float32_passes_sum_their_losses_in_float64(real, monkeypatch):
    """With the float32 passes' losses summed in float32, the first fold fit at lambda = 1e4 of
    the CIFAR-100 VGG-19 cross-validation crawled at a gradient of 1.2e-4 for 20 Newton steps (449
    passes): the sum's round-off passed the Armijo test for steps of 1e-3 to 1e-10 that made no
    progress. Summed in float64, every fold fit takes a few dozen passes."""
    d = real("cifar100_vgg19bn_ferrer")
    logits, labels = torch.from_numpy(d["logits"]), torch.from_numpy(d["labels"])
    records = []
    original = torchcal.calibrators.matrix.fit_multinomial_logistic

    def recording(*args, **kwargs):
        theta, record = original(*args, **kwargs)
        records.append(record)
        return theta, record

    monkeypatch.setattr(torchcal.calibrators.matrix, "fit_multinomial_logistic", recording)
    torchcal.DirichletCalibration(reg="odir", reg_grid=[1e5, 1e4]).fit(logits, labels)
    assert len(records) >= 11 and all(r.converged for r in records)
    assert max(r.evaluations for r in records) <= 60, [r.evaluations for r in records]


@pytest.mark.parametrize(
    ("setting", "cpu", "cuda"),
    [
        ("pass", True, True),
        ("torch.set_float32_matmul_precision('high')", False, False),
        ("torch.backends.cuda.matmul.allow_tf32 = True", True, False),
        ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", True, False),
        ("torch.backends.mkldnn.matmul.fp32_precision = 'bf16'", False, True),
        ("torch.backends.fp32_precision = 'tf32'", False, False),
    ],
)
def test_lowered_float32_matmul_precision_is_detected_whatever_the_api(setting, cpu, cuda):
    """Read in a fresh process, as PyTorch's legacy getter raises once the per-backend API was
    used (reading it there would crash the fit); the fit runs under every setting."""
    script = (
        "import torch, torchcal\n"
        f"{setting}\n"
        "from torchcal.calibrators._multinomial import _float32_products_are_ieee as ieee\n"
        "torchcal.DirichletCalibration(reg='odir', reg_lambda=1.0).fit(torch.randn(200, 3), torch.arange(200) % 3)\n"
        "print(ieee(torch.device('cpu')), ieee(torch.device('cuda')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(cpu), str(cuda)]


def test_class_weights_reach_the_exact_newton_optimum():
    logits, labels = _problem(2000, 5, seed=6)
    priors = torch.tensor([0.4, 0.1, 0.2, 0.2, 0.1], dtype=torch.float64)
    cal = torchcal.MatrixScaling(reg="odir", reg_lambda=0.1).fit(logits, labels, priors=priors)
    weights = priors / (torch.bincount(labels, minlength=5).double() / 2000)
    ref = torchcal.MatrixScaling(reg="odir", reg_lambda=0.1)
    ref.reg_lambda_ = ref.reg_mu_ = 0.1
    penalty = ref._penalty_weights(5).flatten()
    theta, _ = fit_linear_newton(FullDesign(), logits, labels, weights, torch.eye(5, 6, dtype=torch.float64).flatten(), penalty)
    torch.testing.assert_close(_fitted(cal), theta.view(5, 6), rtol=0, atol=1e-6)


def test_block_rows_hold_each_class_curvature_and_sample_the_rest_without_bias():
    """Each class's block is summed from its rows of largest curvature and a draw from the others
    weighted by their total: the weights add up to the class's whole curvature, and over many
    draws the block averages to the one summed over every row (NumPy, float64)."""
    from torchcal.calibrators._multinomial import _block_rows

    gen = torch.Generator().manual_seed(3)
    n, k, m = 400, 3, 40
    curvature = torch.rand(n, k, generator=gen, dtype=torch.float64) ** 4
    curvature[:5, 2] = 10.0  # a class whose curvature sits almost all on a few rows
    curvature[5:, 1] = 0.0  # and one whose curvature the top rows hold entirely
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    exact = np.einsum("nk,ni,nj->kij", curvature.numpy(), x.numpy(), x.numpy())

    weight, index = _block_rows(curvature.clone(), m, torch.Generator().manual_seed(0))
    assert weight.shape == index.shape == (m, k)
    torch.testing.assert_close(weight.sum(0), curvature.sum(0), rtol=1e-12, atol=0)
    top = m - m // 4
    assert set(index[:top, 0].tolist()) == set(curvature[:, 0].topk(top).indices.tolist())
    assert (weight[top:, 1] == 0).all()

    def block(weight: torch.Tensor, index: torch.Tensor) -> np.ndarray:
        rows = x[index]  # (m, K, 4)
        return torch.einsum("mk,mki,mkj->kij", weight, rows, rows).numpy()

    draws = np.stack([block(*_block_rows(curvature.clone(), m, torch.Generator().manual_seed(s))) for s in range(2000)])
    error = np.abs(draws.mean(0) - exact)
    standard_error = draws.std(0) / np.sqrt(len(draws))
    assert (error <= 4 * standard_error + 1e-12).all(), (error / (standard_error + 1e-300)).max()
    # the top rows alone (the blocks before the draws) fall short by far more than that
    top_only = block(torch.where(torch.arange(m).unsqueeze(1) < top, weight, 0.0), index)
    assert (np.abs(top_only - exact)[0] > 10 * standard_error[0]).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_low_rank_blocks_solve_their_approximation_of_each_class_block(monkeypatch, dtype):
    """Above the dense blocks' size, each class's block is its top rows exactly plus the other
    rows' diagonal about their mean and that mean (rank one), inverted by Woodbury's identity:
    the solve equals NumPy's float64 solve with that matrix formed densely, also for a class
    whose curvature the top rows hold entirely (its other rows have none)."""
    from torchcal.calibrators._multinomial import _LowRankBlocks

    monkeypatch.setattr(torchcal.calibrators._multinomial, "_BLOCK_ROWS_PER_FEATURE", 2)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_BLOCK_ROWS", 1)
    gen = torch.Generator().manual_seed(4)
    n, d, k = 500, 25, 4
    m = min(2 * n // d, d // 2)  # (at most half the features)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) - 3.0  # a large common offset, as log-posteriors have
    q = torch.softmax(2 * torch.randn(n, k, generator=gen, dtype=torch.float64), 1)
    q[m // 2 :, 3] = 0.0  # class 3: curvature on fewer rows than the top rows
    w = torch.rand(n, generator=gen, dtype=torch.float64) / n
    penalty = torch.full((k, d), 1e-4, dtype=torch.float64)
    penalty[:, 0] = 0.0  # an unpenalised column

    solve = _LowRankBlocks().factorise(x.to(dtype), w.to(dtype), q.to(dtype), penalty)
    r = torch.randn(k, d, generator=gen, dtype=torch.float64)
    z = solve(r)

    c, xs = (w[:, None] * q * (1 - q)).numpy(), x.numpy()
    for j in range(k):
        top = np.argsort(-c[:, j], kind="stable")[:m]
        rest = np.setdiff1d(np.arange(n), top)
        block = np.einsum("n,ni,nj->ij", c[top, j], xs[top], xs[top])
        t = c[rest, j].sum()
        mean = c[rest, j] @ xs[rest] / t if t > 0 else np.zeros(d)
        diagonal = c[rest, j] @ (xs[rest] - mean) ** 2 + 2 * penalty[j].numpy()
        diagonal += 1e-3 * np.diag(block) + 1e-10 * diagonal + 1e-14 * diagonal.mean() + 1e-300  # (_LOW_RANK_RIDGE)
        block += np.diag(diagonal) + t * np.outer(mean, mean)
        expected = np.linalg.solve(block, r[j].numpy())
        tolerance = 1e-9 if dtype == torch.float64 else 1e-3
        np.testing.assert_allclose(z[j].numpy(), expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())
    assert torch.isfinite(z).all()


def test_the_rows_drawn_for_the_blocks_leave_the_global_random_state_alone():
    logits, labels = _problem(3000, 30, seed=5)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    fits = [torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3).fit(logits, labels) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(_fitted(fits[0]), _fitted(fits[1]))  # the same draws: the same fit, bit for bit


def test_passes_do_not_blow_up_as_lambda_shrinks():
    """The reason for the solver: L-BFGS needed ~10x more iterations per decade of lambda here.
    Newton-CG's pass count (gradients plus Hessian-vector products) stays within a small factor."""
    logits, labels = _problem(4000, 30, seed=7)
    passes = {lam: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels).fit_record_.evaluations for lam in (1.0, 1e-4)}
    assert passes[1e-4] <= 3 * passes[1.0], passes


@pytest.mark.parametrize("make", [
    lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e5),
    lambda: torchcal.MatrixScaling(reg="l2", reg_lambda=1e5),
], ids=["dirichlet-odir", "matrix-l2"])
def test_a_strong_penalty_takes_the_rank_one_preconditioner_to_the_same_optimum(monkeypatch, make):
    """Where the penalty is strong against the data's curvature, CG is preconditioned by the
    blocks' diagonals plus their mean rows: the fit reaches the exact Newton optimum and the block
    path's fit (forced here by an unreachable threshold), by the other path."""
    logits, labels = _problem(2000, 8, seed=11)
    rank_one = make().fit(logits, labels)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_STRONG_PENALTY", math.inf)
    blocks = make().fit(logits, labels)
    reference = _reference(make(), logits, labels)
    assert rank_one.fit_record_.converged and rank_one.fit_record_.grad_max < 1e-9
    # the other path ran: other passes, or at least another round-off
    assert (rank_one.fit_record_.evaluations, rank_one.fit_record_.grad_max) != (blocks.fit_record_.evaluations, blocks.fit_record_.grad_max)
    torch.testing.assert_close(_fitted(rank_one), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(_fitted(rank_one), _fitted(blocks), rtol=0, atol=1e-6)


def test_float32_blocks_of_loose_newton_systems_precondition_as_well_as_float64_ones(monkeypatch):
    """Loose Newton systems get per-class blocks summed in float32 about each class's mean row
    (the mean added back in float64). Forced for every system, or for none, the fits take about as
    many passes and reach the same optimum: the blocks are the same up to float32 round-off."""
    logits, labels = _problem(3000, 20, seed=12)
    fits = {}
    for name, threshold in (("float32", 0.0), ("float64", math.inf)):
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_LOOSE_FORCING", threshold)
        fits[name] = torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2).fit(logits, labels)
    passes = {name: fit.fit_record_.evaluations for name, fit in fits.items()}
    assert all(fit.fit_record_.converged and fit.fit_record_.grad_max < 1e-9 for fit in fits.values())
    assert passes["float32"] <= 1.2 * passes["float64"] + 2, passes
    torch.testing.assert_close(_fitted(fits["float32"]), _fitted(fits["float64"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("check_every", [8, 1], ids=["checks-default", "check-every-cg-step"])
@pytest.mark.parametrize("lam", [1e-3, 1.0])
def test_the_large_k_rank_one_preconditioner_reaches_the_same_optimum(monkeypatch, lam, check_every):
    """Above ``_MAX_BLOCK_SIZE`` features CG is preconditioned by the blocks' diagonals plus their
    mean rows (and checks the objective along its iterates): forced onto that path, a small problem
    reaches the exact Newton optimum and the block path's fit, also when CG checks at every step."""
    logits, labels = _problem(2000, 8, seed=11)
    blocks = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_CHECK_EVERY", check_every)
    rank_one = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels)
    reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels)
    assert rank_one.fit_record_.converged and rank_one.fit_record_.grad_max < 1e-9
    assert rank_one.fit_record_.evaluations != blocks.fit_record_.evaluations  # the other path ran
    torch.testing.assert_close(_fitted(rank_one), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(_fitted(rank_one), _fitted(blocks), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lam", [1e-3, 1.0])
def test_the_large_k_low_rank_blocks_reach_the_same_optimum(monkeypatch, lam):
    """From ``_MIN_LOW_RANK_BLOCK_SIZE`` features a single-process fit preconditions CG by the
    low-rank blocks: forced onto that path, a small problem reaches the exact Newton optimum and
    the dense blocks' fit."""
    logits, labels = _problem(2000, 8, seed=11)
    blocks = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_LOW_RANK_BLOCK_SIZE", 0)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_BLOCK_ROWS", 4)  # fewer rows than features
    low_rank = torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels)
    reference = _reference(torchcal.DirichletCalibration(reg="odir", reg_lambda=lam), logits, labels)
    assert low_rank.fit_record_.converged and low_rank.fit_record_.grad_max < 1e-9
    # the other path ran: other passes, or at least another round-off
    assert (low_rank.fit_record_.evaluations, low_rank.fit_record_.grad_max) != (blocks.fit_record_.evaluations, blocks.fit_record_.grad_max)
    torch.testing.assert_close(_fitted(low_rank), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(_fitted(low_rank), _fitted(blocks), rtol=0, atol=1e-6)


def test_the_low_rank_blocks_cut_the_large_k_passes(monkeypatch, real):
    """On 40 classes of the CIFAR-100 ResNet-20 logits, forced onto the large-K path, Dir-ODIR at
    lambda = 0.1 takes 486 passes with the low-rank blocks (20 rows each, half the features) and
    626 with the rank-one preconditioner alone, to the same optimum (at lambda = 1 245 and 300; 60
    classes at 0.1 1,103 and 1,577; the blocks as good as their diagonals, by a huge ridge: 4,844)."""
    logits, labels = _real_subset(real, 40)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    rank_one = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_LOW_RANK_BLOCK_SIZE", 0)
    low_rank = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels)
    assert rank_one.fit_record_.converged and low_rank.fit_record_.converged
    assert low_rank.fit_record_.evaluations <= 0.85 * rank_one.fit_record_.evaluations, (rank_one.fit_record_, low_rank.fit_record_)
    torch.testing.assert_close(_fitted(low_rank), _fitted(rank_one), rtol=0, atol=1e-6)


def test_the_rank_one_term_cuts_the_large_k_passes_on_real_logits(monkeypatch, real):
    """The large-K preconditioner's rank-one term (each class's curvature-weighted mean row)
    carries the log-posteriors' common offsets and the bias: on 20 classes of the CIFAR-100
    ResNet-20 logits, forced onto that path, Dir-ODIR at lambda = 1 takes 152 passes; the blocks'
    diagonals alone (the preconditioner before it) took 841."""
    logits, labels = _real_subset(real, 20)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0).fit(logits, labels)
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9
    assert cal.fit_record_.evaluations <= 300, cal.fit_record_


def test_a_slow_rank_one_solve_hands_over_to_the_blocks(monkeypatch, real):
    """The penalty's share does not always tell when the rank-one preconditioner suffices: MS-ODIR
    on 40 classes of the CIFAR-100 ResNet-20 logits at lambda = 10 starts on it, and CG needs more
    than _RANK_ONE_STEPS_PER_DECADE steps per decade there; the fit goes on with the blocks and
    takes 64 passes, where staying takes 130 (and the blocks from the start 47). Same optimum."""
    logits, labels = _real_subset(real, 40)
    switching = torchcal.MatrixScaling(reg="odir", reg_lambda=10.0).fit(logits, labels)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_RANK_ONE_STEPS_PER_DECADE", math.inf)
    staying = torchcal.MatrixScaling(reg="odir", reg_lambda=10.0).fit(logits, labels)
    assert switching.fit_record_.converged and staying.fit_record_.converged
    assert switching.fit_record_.evaluations <= 80 < 110 <= staying.fit_record_.evaluations, (switching.fit_record_, staying.fit_record_)
    torch.testing.assert_close(_fitted(switching), _fitted(staying), rtol=0, atol=1e-6)


@pytest.mark.parametrize("anchored", [False, True])
def test_the_solver_function_on_its_own(anchored):
    """The module-level interface (for other full linear maps): a 3-class problem on 2 features
    whose optimum SciPy finds in float64 from the same objective written out by hand; with an
    ``anchor`` (SMS's identity, here a random map) the scores are those of ``anchor + theta`` and
    the penalty acts on ``theta``."""
    logits, labels = _problem(1500, 3, seed=8)
    x = logits[:, :2]
    w = torch.full((1500,), 1 / 1500, dtype=torch.float64)
    penalty = torch.tensor([[0.0, 0.1, 0.2], [0.3, 0.0, 0.1], [0.1, 0.1, 0.0]], dtype=torch.float64)
    anchor = torch.randn(3, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64) if anchored else None
    theta, record = fit_multinomial_logistic(x, labels, w, torch.zeros(3, 3, dtype=torch.float64), penalty, anchor=anchor)
    xa = np.c_[x.numpy(), np.ones(1500)]
    y = labels.numpy()
    p = penalty.numpy()
    a = anchor.numpy() if anchored else 0.0

    def fun(t):
        t = t.reshape(3, 3)
        log_q = log_softmax(xa @ (a + t).T, axis=1)
        grad = (np.exp(log_q) - np.eye(3)[y]).T @ xa / 1500 + 2 * p * t
        return -log_q[np.arange(1500), y].mean() + (p * t**2).sum(), grad.ravel()

    res = scipy_minimize(fun, np.zeros(9), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-16, "maxiter": 10_000})
    assert record.converged
    np.testing.assert_allclose(theta.numpy().ravel(), res.x, atol=1e-6)


def _overconfident_mixed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-posterior features (n, k), labels and uniform sample weights, float64: the benchmarks'
    recipe, over-confident by 2.5 and mildly class-mixed."""
    gen = torch.Generator().manual_seed(0)
    latent = 3 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(k, dtype=torch.float64) + 0.05 * torch.randn(k, k, generator=gen, dtype=torch.float64)
    return torch.log_softmax(2.5 * latent @ mixing, 1), labels, torch.full((n,), 1 / n, dtype=torch.float64)


def test_a_loose_fit_with_a_decrease_tolerance_does_not_stop_far_from_a_weak_penalty_optimum():
    """Warm-started from the lambda = 100 optimum (the cross-validation's path), the lambda = 1 fit
    at K = 150 meets the selection's gradient tolerance (1e-4) 5e-4 above its optimum: the
    directions that only the penalty curves are nearly flat. With ``tol_decrease`` it goes on
    until a Newton step gains less than that, and stops within 1e-5 of the optimum."""
    n, k = 2000, 150
    features, labels, sample_w = _overconfident_mixed(n, k)
    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0)

    def penalty(lam):
        cal.reg_lambda_ = cal.reg_mu_ = lam
        return cal._penalty_weights(k)

    start, _ = fit_multinomial_logistic(features, labels, sample_w, torch.eye(k, k + 1, dtype=torch.float64), penalty(100.0), tol_grad=1e-4)
    _, optimum = fit_multinomial_logistic(features, labels, sample_w, start, penalty(1.0))
    _, loose = fit_multinomial_logistic(features, labels, sample_w, start, penalty(1.0), tol_grad=1e-4)
    _, guarded = fit_multinomial_logistic(features, labels, sample_w, start, penalty(1.0), tol_grad=1e-4, tol_decrease=1e-4)
    assert optimum.converged and loose.converged and guarded.converged
    assert loose.loss - optimum.loss > 2e-4
    assert guarded.loss - optimum.loss < 1e-5 and guarded.iterations > loose.iterations


def test_a_loose_fit_stops_once_its_gap_to_the_optimum_is_certified_small(monkeypatch):
    """Where every parameter is penalised (SMS), the objective is strongly convex and its gap to
    the optimum at most ``sum g^2 / (4 p)``. Started at 0.95 times the optimum (lambda = 1,
    K = 50), a fit with the selection's tolerances meets the gradient tolerance after a Newton step
    that gained more than ``tol_decrease``; the certified gap is below a tenth of it, so the fit
    stops there: fewer Newton steps than where only the last step's decrease may stop it, and as
    close to the optimum. The bound itself holds at every start tried. With Dir-ODIR's free
    diagonal there is no certificate, and the fit is the same as without it."""
    n, k = 2000, 50
    features, labels, sample_w = _overconfident_mixed(n, k)
    penalty = torchcal.StructuredMatrixScaling._penalty_weights(k, float(n), 1.0)
    anchor = torch.eye(k, k + 1, dtype=torch.float64)
    optimum, tight = fit_multinomial_logistic(features, labels, sample_w, torch.zeros(k, k + 1, dtype=torch.float64), penalty, anchor=anchor)
    for shrink in [0.0, 0.5, 0.9, 0.99]:
        theta = (shrink * optimum).requires_grad_(True)
        scores = torch.nn.functional.pad(features, (0, 1), value=1.0) @ (anchor + theta).T
        objective = -(sample_w * scores.log_softmax(1)[torch.arange(n), labels]).sum() + (penalty * theta.square()).sum()
        (grad,) = torch.autograd.grad(objective, theta)
        assert tight.loss <= float(objective.detach()) <= tight.loss + 0.25 * float((grad.square() / penalty).sum())

    def loose(start, penalty, anchor, share):
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_CERTIFIED_GAP_SHARE", share, raising=False)
        return fit_multinomial_logistic(features, labels, sample_w, start, penalty, anchor=anchor, tol_grad=1e-4, tol_decrease=1e-4)[1]

    certified, measured = loose(0.95 * optimum, penalty, anchor, 0.1), loose(0.95 * optimum, penalty, anchor, 0.0)
    assert tight.converged and certified.converged and measured.converged
    assert certified.iterations < measured.iterations
    assert abs(certified.loss - tight.loss) < 1e-5 and abs(measured.loss - tight.loss) < 1e-5

    odir = torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0)
    odir.reg_lambda_ = odir.reg_mu_ = 1.0
    start = torch.eye(k, k + 1, dtype=torch.float64) * 0.9
    assert loose(start, odir._penalty_weights(k), None, 0.1) == loose(start, odir._penalty_weights(k), None, 0.0)


@pytest.mark.parametrize("path", ["blocks", "rank-one", "low-rank"])
def test_a_batched_fit_solves_each_problem_as_alone(monkeypatch, path):
    """B problems on the same rows, each with its own weights (zero on a fifth of the rows, as a
    cross-validation fold's test rows), penalty, anchor and start, solved together as one (the
    weights (N, B), the parameters (B, K, F + 1)) reach the optimum of each solved alone on its
    own rows; one batch of one problem is the plain fit; weights that are not contiguous give the
    same fit. On every preconditioner's path."""
    if path != "blocks":
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    if path == "low-rank":
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_LOW_RANK_BLOCK_SIZE", 0)
        monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_BLOCK_ROWS", 4)
    logits, labels = _problem(2000, 6, seed=21)
    features = torch.log_softmax(logits, 1)
    b, k = 4, 6
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(2000, b, generator=gen, dtype=torch.float64) * (torch.rand(2000, b, generator=gen) > 0.2)
    w /= w.sum(0)
    penalty = 10.0 ** torch.empty(b, 1, 1, dtype=torch.float64).uniform_(-3, 1, generator=gen) * torch.rand(b, k, k + 1, generator=gen, dtype=torch.float64)
    anchor = 0.1 * torch.randn(b, k, k + 1, generator=gen, dtype=torch.float64)
    start = torch.eye(k, k + 1, dtype=torch.float64) + 0.1 * torch.randn(b, k, k + 1, generator=gen, dtype=torch.float64)
    together, record = fit_multinomial_logistic(features, labels, w, start, penalty, anchor=anchor)
    assert record.converged and record.grad_max < 1e-9 and together.shape == (b, k, k + 1)
    for i in range(b):
        rows = w[:, i] > 0
        alone, alone_record = fit_multinomial_logistic(features[rows], labels[rows], w[rows, i], start[i], penalty[i], anchor=anchor[i])
        assert alone_record.converged
        torch.testing.assert_close(together[i], alone, rtol=0, atol=1e-6)
    transposed = w.T.contiguous().T  # the same weights, not contiguous
    again, _ = fit_multinomial_logistic(features, labels, transposed, start, penalty, anchor=anchor)
    torch.testing.assert_close(again, together, rtol=0, atol=0)
    one, _ = fit_multinomial_logistic(features, labels, w[:, :1], start[:1], penalty[:1], anchor=anchor[:1])
    plain, _ = fit_multinomial_logistic(features, labels, w[:, 0], start[0], penalty[0], anchor=anchor[0])
    torch.testing.assert_close(one[0], plain, rtol=0, atol=0)


def test_unpenalised_fits_of_rows_that_sum_to_a_constant_score_shifted_rows_alike(real):
    """Logits centred per row (each row sums to 0): ``W + v 1^T`` scores every such row alike, and
    the fit had grown ``v`` to 93, so rows shifted by a constant (which softmax ignores) scored a
    log-loss of 369 for 0.245 (review finding). The fit is the one with ``W 1 = 0`` (SciPy's
    L-BFGS from the identity leaves it at 1e-14)."""
    data = real("cifar10_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"]).long()
    centred = logits - logits.mean(1, keepdim=True)
    test = centred[2000:]
    shifted = test + torch.randn(len(test), 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model = torchcal.MatrixScaling().fit(centred[:2000], labels[:2000])
    assert model.fit_record_.converged
    torch.testing.assert_close(model.weight.detach().sum(1), torch.zeros(10, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(model(shifted).detach(), model(test).detach(), rtol=0, atol=1e-9)
    # centred in float32 (rows sum to 0 within 4e-6): the same fit (the diff review found W 1 of 7e6)
    narrow = torchcal.MatrixScaling().fit(centred[:2000].float(), labels[:2000])
    assert float(narrow.weight.detach().sum(1).abs().max()) < 1e-5
    torch.testing.assert_close(narrow(test).detach(), model(test).detach(), rtol=0, atol=1e-4)


def test_unpenalised_fits_of_stored_rows_that_sum_to_a_constant_converge_at_any_scale(real):
    """Ferrer's CIFAR-10 ResNet-20 logits as stored (float32 rows summing to a constant within
    4e-4): the solver moves orthogonally to the row-sum direction but tested, and solved for, the
    whole gradient, whose part along it (round-off's) no step reduces: CG ran to its cap at every
    Newton step, 12,773 passes, "converged" only by the stall test, and the same logits times 10
    fell back to L-BFGS and another map, posteriors 0.35 apart (review finding)."""
    data = real("cifar10_resnet20_ferrer")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"]).long()
    rows = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(0))
    train, test = rows[:5000], rows[5000:]
    fits = [torchcal.MatrixScaling().fit(scale * logits[train], labels[train]) for scale in (1.0, 10.0)]
    for fit in fits:
        record = fit.fit_record_
        assert record.converged and record.message == "gradient below tolerance" and record.evaluations < 100
    torch.testing.assert_close(fits[1].predict_proba(10 * logits[test]), fits[0].predict_proba(logits[test]), rtol=0, atol=1e-6)


def test_unpenalised_fits_stay_off_the_directions_the_features_cannot_see():
    """A logit column that is constant (here 2: ``W[:, 0] + c, b - 2 c`` leaves every score as it
    is): without a penalty any move along that direction is an optimum too. The fit is the
    smallest one, orthogonal to it (in the features scaled to unit root mean square), so its
    predictions keep their digits on float32 inputs; before, round-off walked the weights out to
    5e5 and float32 probabilities were off by 1e-2. A column that varies by 1e-8 of its size
    carries information, and is used (a threshold on the second moments' eigenvalues had taken it
    for blind: a loss of 0.980 for 0.651)."""
    gen = torch.Generator().manual_seed(0)
    latent = 2 * torch.randn(600, 4, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    logits = 2.5 * latent
    logits[:, 0] = 2.0
    cal = torchcal.MatrixScaling().fit(logits, labels)
    assert cal.fit_record_.converged and cal.fit_record_.grad_max < 1e-9
    weight, bias = cal.weight.detach(), cal.bias.detach()
    # orthogonal to (2 e_0 - e_bias) / sqrt(5) in the scaled features (column scale 2, bias 1)
    torch.testing.assert_close(bias, 2 * weight[:, 0], rtol=0, atol=1e-8)
    assert weight.abs().max() < 5
    torch.testing.assert_close(cal.predict_proba(logits.float()).double(), cal.predict_proba(logits).detach(), rtol=0, atol=1e-6)

    informative = 100.0 + 1e-6 * (torch.randn(600, generator=gen, dtype=torch.float64) + 3.0 * (labels == 0).double())
    logits[:, 0] = informative
    tiny = torchcal.MatrixScaling().fit(logits, labels)
    logits[:, 0] = (informative - 100.0) * 1e6
    plain = torchcal.MatrixScaling().fit(logits, labels)
    assert tiny.fit_record_.loss == pytest.approx(plain.fit_record_.loss, abs=1e-8)


def test_a_batched_fit_finds_each_group_s_own_blind_directions():
    """A logit column constant on the rows one group counts (a fold without the rows where it
    varies), batched with a group that sees it vary, and with a penalised group: the first group's
    fit stays small (it had drifted to weights of 460, giving its left-out rows a loss of inf), at
    the optimum of its own rows."""
    gen = torch.Generator().manual_seed(0)
    latent = 2 * torch.randn(600, 4, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    logits = 2.5 * latent
    held_out = torch.arange(600) < 120
    logits[:, 0] = 2.0
    logits[held_out, 0] += torch.randn(120, generator=gen, dtype=torch.float64)
    w = torch.zeros(600, 3, dtype=torch.float64)
    w[~held_out, 0] = 1 / 480
    w[:, 1:] = 1 / 600
    start = torch.eye(4, 5, dtype=torch.float64).expand(3, 4, 5).clone()
    penalty = torch.zeros(3, 4, 5, dtype=torch.float64)
    penalty[2] = 1e-3
    together, record = fit_multinomial_logistic(logits, labels, w, start, penalty)
    alone, alone_record = fit_multinomial_logistic(logits[~held_out], labels[~held_out], w[~held_out, 0], start[0], penalty[0])
    assert record.converged and alone_record.converged
    assert together[0].abs().max() < 5 and alone.abs().max() < 5
    x = torch.cat([logits[~held_out], torch.ones(480, 1, dtype=torch.float64)], 1)
    loss = lambda theta: torch.nn.functional.cross_entropy(x @ theta.T, labels[~held_out]).item()
    assert loss(together[0]) == pytest.approx(loss(alone), abs=1e-12)


def test_a_fit_that_converges_on_its_last_allowed_step_says_so():
    """The test ran only at the top of the loop: with max_iter equal to the Newton steps a fit
    needs, the same parameters came back reported as stopped at the cap, with a warning."""
    import warnings

    from torchcal import MatrixScaling

    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(2000, 4, dtype=torch.float64, generator=gen)
    y = torch.distributions.Categorical(logits=x / 3).sample()
    full = MatrixScaling(reg="odir", reg_lambda=1e-2).fit(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capped = MatrixScaling(reg="odir", reg_lambda=1e-2).fit(x, y, max_iter=full.fit_record_.iterations)
    assert capped.fit_record_.converged and capped.fit_record_.message == "gradient below tolerance"
    assert torch.equal(capped.weight, full.weight) and torch.equal(capped.bias, full.bias)


@pytest.mark.parametrize("make", [torchcal.MatrixScaling, torchcal.DirichletCalibration])
def test_an_over_parametrised_unpenalised_fit_stops_once_it_classifies_every_sample_correctly(make):
    """1,000 samples for 10,100 unpenalised parameters: the Newton systems are nearly singular, CG
    ran to its cap at every Newton step, and the norm test stopped the fits after 22 steps and
    1,187 (Dirichlet) or 5,491 passes (matrix scaling, 24 s). Damped after such a step, the fit
    soon classifies every sample correctly, which proves that it has no finite optimum, and stops
    there."""
    import warnings

    logits, labels = _problem(1000, 100, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = make().fit(logits, labels)
    record = cal.fit_record_
    assert not record.converged and record.message.startswith("diverging: the map classifies every weighted sample correctly")
    assert any("classifies every weighted sample correctly" in str(w.message) and "reg='odir'" in str(w.message) for w in caught)
    assert record.evaluations < 1000
    with torch.no_grad():
        assert torch.equal(cal(logits).argmax(1), labels)
        # (the stopped fit's map is kept; its loss was summed on float32 passes)
        assert torch.nn.functional.cross_entropy(cal(logits), labels).item() == pytest.approx(record.loss, rel=1e-3)
    assert record.loss < math.log(2) / 1000


def test_a_separated_fit_s_certificate_counts_the_least_sample_weight():
    """The certificate is the loss below log(2) times the least sample weight, not 1 / N: with the
    samples of one class weighted 50 times less (a class prior), a fit stopped on it classifies
    every sample correctly all the same."""
    logits, labels = _problem(400, 40, 0)
    features = torch.log_softmax(logits, 1)
    theta = torch.eye(40, 41, dtype=torch.float64)
    penalty = torch.zeros(40, 41, dtype=torch.float64)
    weights = torch.where(labels == labels[0], 0.02, 1.0).double()
    weights /= weights.sum()
    fitted, record = fit_multinomial_logistic(features, labels, weights, theta, penalty)
    assert record.message.startswith("diverging: the map classifies every weighted sample correctly")
    assert record.loss < 0.5 * math.log(2) * float(weights.min())
    scores = torch.cat([features, torch.ones(400, 1, dtype=torch.float64)], 1) @ fitted.T
    assert torch.equal(scores.argmax(1), labels)
