"""Structured vector / matrix scaling and quadratic scaling: the optimum of an independent float64
SciPy fit of the same penalised objective, agreement with probmetrics (the authors' implementation)
on real logits, cross-validation against a cold-started grid, and the calibrator contract."""

from __future__ import annotations

import logging
import math
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo import spawn_gloo
from scipy.optimize import brentq, minimize
from scipy.special import log_softmax, softmax

import torchcal
from torchcal.fit import fold_indices

MODELS = {"svs": torchcal.StructuredVectorScaling, "sms": torchcal.StructuredMatrixScaling}


def _data(n: int = 400, k: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Over-confident, class-mixed and shifted logits: every part of SMS has something to fix."""
    gen = torch.Generator().manual_seed(seed)
    latent = 1.5 * torch.randn(n, k, generator=gen)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    mixing = torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen)
    return 3 * latent @ mixing + torch.linspace(-1, 1, k), labels


# ------------------------------------------------------------- independent NumPy / SciPy reference
def ts_mix_features(z: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Temperature scaling (the root of the log-loss's derivative in the inverse temperature, by
    Brent's method), then mixing with the uniform distribution at weight 1 / (N + 1)."""
    n, k = z.shape
    log_p = log_softmax(z.astype(np.float64), axis=1)

    def derivative(beta):
        return ((softmax(beta * log_p, axis=1) * log_p).sum(1) - log_p[np.arange(n), y]).mean()

    beta = brentq(derivative, 1e-3, 1e3, xtol=1e-15, rtol=1e-15)
    eps = 1 / (n + 1)
    return beta, np.log((1 - eps) * softmax(beta * log_p, axis=1) + eps / k)


def penalty_weights(name: str, k: int, n: int, reg_lambda: float) -> np.ndarray:
    """Penalty weights on the deviation from the identity (SVS: [v; b] (2, K); SMS: [D + M | b])."""
    if name == "svs":
        return np.full((2, k), reg_lambda * k / n)
    weights = np.full((k, k + 1), reg_lambda * k * (k - 1) / n)
    weights[np.arange(k), np.arange(k)] = reg_lambda * k / n
    weights[:, k] = reg_lambda * k / n
    return weights


def objective(name: str, theta: np.ndarray, x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean log-loss plus penalty, and its analytic gradient, at the deviation ``theta``."""
    n, k = x.shape
    theta = theta.reshape(weights.shape)
    scores = x * (1 + theta[0]) + theta[1] if name == "svs" else x + x @ theta[:, :k].T + theta[:, k]
    log_q = log_softmax(scores, axis=1)
    r = np.exp(log_q)
    r[np.arange(n), y] -= 1
    r /= n
    grad = np.stack([(r * x).sum(0), r.sum(0)]) if name == "svs" else np.c_[r.T @ x, r.sum(0)]
    loss = -log_q[np.arange(n), y].mean() + (weights * theta**2).sum()
    return loss, (grad + 2 * weights * theta).ravel()


def scipy_fit(name: str, x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray]:
    result = minimize(lambda t: objective(name, t, x, y, weights), np.zeros(weights.size), jac=True, method="L-BFGS-B",
                      options={"maxiter": 10_000, "gtol": 1e-11, "ftol": 1e-16})
    return result.fun, result.x.reshape(weights.shape)


def fitted_deviation(name: str, model) -> np.ndarray:
    weight, bias = model.weight.detach().numpy(), model.bias.detach().numpy()
    if name == "svs":
        return np.stack([weight - 1, bias])
    return np.c_[weight - np.eye(len(bias)), bias]


def assert_at_the_svs_optimum(model, logits: torch.Tensor, labels: torch.Tensor, reg_lambda: float) -> None:
    """The fitted SVS's objective is at most SciPy's optimum of the same objective (+ 1e-12)."""
    z, y = logits.numpy(), labels.numpy()
    _, x = ts_mix_features(z, y)
    weights = penalty_weights("svs", z.shape[1], len(y), reg_lambda)
    best, _ = scipy_fit("svs", x, y, weights)
    assert objective("svs", fitted_deviation("svs", model), x, y, weights)[0] <= best + 1e-12


@pytest.mark.parametrize("reg_lambda", [1.0, 0.02])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reaches_the_optimum_of_an_independent_scipy_fit(name, reg_lambda):
    logits, labels = _data()
    z, y = logits.numpy(), labels.numpy()
    beta, x = ts_mix_features(z, y)
    weights = penalty_weights(name, z.shape[1], len(y), reg_lambda)
    best, theta = scipy_fit(name, x, y, weights)

    model = MODELS[name](reg_lambda=reg_lambda).fit(logits, labels)
    assert model.inverse_temperature.item() == pytest.approx(beta, rel=1e-7)
    assert model.mix.item() == 1 / (len(y) + 1)
    ours = fitted_deviation(name, model)
    # the fit's record and the reference's objective at our parameters: both at SciPy's optimum
    assert model.fit_record_.converged
    assert model.fit_record_.loss == pytest.approx(best, abs=1e-10)
    assert objective(name, ours, x, y, weights)[0] <= best + 1e-10
    # Parameters and posteriors agree as far as the flattest direction allows: its curvature is
    # about twice the weakest penalty (8e-4 at lambda = 0.02), so gradients of 1e-7 leave ~1e-4.
    np.testing.assert_allclose(ours, theta, atol=1e-4)
    scores = x * (1 + theta[0]) + theta[1] if name == "svs" else x + x @ theta[:, :-1].T + theta[:, -1]
    np.testing.assert_allclose(model(logits.double()).detach().numpy(), log_softmax(scores, axis=1), atol=5e-5)


def test_svs_at_the_weakest_penalty_of_the_grid_converges():
    """At lambda = 4^-6 only the penalty held the shift of every bias (which the softmax ignores),
    and L-BFGS crawled along it to its 1,000-iteration cap, warning, at a gradient of 4e-7. The
    bias is centred in the search, which leaves the optimum (a centred bias) where it was."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(1500, 5, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits / 3 + 0.3 * torch.randn(5, generator=g, dtype=torch.float64), 1)
    labels = torch.multinomial(probs, 1, generator=g).squeeze(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchcal.ConvergenceWarning)
        model = torchcal.StructuredVectorScaling(reg_lambda=4.0**-6).fit(logits, labels)
    assert model.fit_record_.converged and model.fit_record_.iterations < 50
    assert_at_the_svs_optimum(model, logits, labels, 4.0**-6)


def test_svs_is_finished_by_newton_to_its_optimum_on_real_logits(real):
    """On the SST-2 GPT-2 4-shot logits (K = 2, lambda = 4^-4: the weights near 16, badly
    conditioned) L-BFGS stopped at a gradient of 6e-7 with the weights 3.7e-4 from the optimum, and
    a fit from another start (the cross-validation's) elsewhere; Newton's method with the exact
    Hessian finishes the fit: both starts reach the same parameters, at SciPy's optimum."""
    d = real("sst2_gpt2-4shot_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"]).long()
    cold = torchcal.StructuredVectorScaling(reg_lambda=4.0**-4).fit(logits, labels)
    warm = torchcal.StructuredVectorScaling(reg_lambda=4.0**-4)
    warm.load_state_dict(cold.state_dict())
    with torch.no_grad():
        warm.weight.mul_(1.01)
    warm.fit(logits, labels, warm_start=True)
    assert cold.fit_record_.converged and cold.fit_record_.grad_max < 1e-10 and "Newton" in cold.fit_record_.message
    torch.testing.assert_close(warm.weight, cold.weight, rtol=0, atol=1e-8)
    torch.testing.assert_close(warm.bias, cold.bias, rtol=0, atol=1e-8)
    assert_at_the_svs_optimum(cold, logits, labels, 4.0**-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_log_loss_functions_gradients_are_autograds(name):
    """SVS and SMS form their log-loss's gradient in the forward pass (one (n, K) buffer, column
    sums); torch.autograd.gradcheck compares it, in float64, with finite differences, and the loss
    with log_softmax's."""
    model = MODELS[name]
    logits, labels = _data(n=60, k=5, seed=1)
    design = model._design(torch.log_softmax(logits.double(), 1))
    sample_w = torch.rand(60, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    shape = (2, 5) if name == "svs" else (5, 6)
    theta = (0.3 * torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))).requires_grad_(True)
    # (scaled, so the backward must scale by its grad_output)
    assert torch.autograd.gradcheck(lambda t: 2.5 * model._log_loss(design, t, labels, sample_w), (theta,))
    reference = -(sample_w * torch.log_softmax(model._map_theta(design, theta), 1)[torch.arange(60), labels]).sum()
    torch.testing.assert_close(model._log_loss(design, theta, labels, sample_w), reference, rtol=1e-13, atol=0)


@pytest.mark.parametrize("k", [4, 30])
def test_svs_by_newton_alone_fits_and_selects_as_lbfgs_does(k, monkeypatch):
    """SVS's log-loss fits, cross-validation's included, by Newton's method from their start (the
    GPU's path, and a CPU's up to _NEWTON_CPU_CLASSES) or by L-BFGS finished by Newton: the same
    out-of-fold losses within the selection fits' tolerance, the same lambda, the same final fit."""
    logits, labels = _data(n=1500, k=k, seed=3)
    module = torchcal.calibrators.structured
    fits = {}
    for newton_classes in (0, 1000):
        monkeypatch.setattr(module, "_NEWTON_CPU_CLASSES", newton_classes)
        fixed = torchcal.StructuredVectorScaling(reg_lambda=0.25).fit(logits, labels)
        chosen = torchcal.StructuredVectorScaling().fit(logits, labels)
        assert fixed.fit_record_.converged and chosen.fit_record_.converged
        assert fixed.fit_record_.message.startswith("Newton") == (newton_classes > 0)
        fits[newton_classes] = fixed, chosen
    (fixed_a, chosen_a), (fixed_b, chosen_b) = fits[0], fits[1000]
    for a, b in ((fixed_a, fixed_b), (chosen_a, chosen_b)):
        torch.testing.assert_close(a.weight, b.weight, atol=1e-7, rtol=0)
        torch.testing.assert_close(a.bias, b.bias, atol=1e-7, rtol=0)
    assert chosen_a.reg_lambda_ == chosen_b.reg_lambda_
    finite = [i for i, v in enumerate(chosen_a.cv_losses_) if math.isfinite(v) and math.isfinite(chosen_b.cv_losses_[i])]
    assert chosen_a.reg_grid.index(chosen_a.reg_lambda_) in finite
    np.testing.assert_allclose([chosen_a.cv_losses_[i] for i in finite], [chosen_b.cv_losses_[i] for i in finite], rtol=1e-5)


def test_svs_capped_between_lbfgs_and_newton_names_the_fits_cap():
    """Past L-BFGS's iterations, Newton has what is left of max_iter; where it stops there, the
    record and the warning name the fit's cap and both stages (they named Newton's share, 2 of 7)."""
    logits, labels = _data(n=2000, k=20, seed=5)
    free = torchcal.StructuredVectorScaling(reg_lambda=4.0**-6).fit(logits, labels)
    assert free.fit_record_.converged and free.fit_record_.message.startswith("no further decrease")  # (L-BFGS, then Newton)
    cap = free.fit_record_.iterations - 1
    with pytest.warns(torchcal.ConvergenceWarning, match=rf"StructuredVectorScaling stopped at the iteration cap \({cap}: \d+ L-BFGS"):
        capped = torchcal.StructuredVectorScaling(reg_lambda=4.0**-6).fit(logits, labels, max_iter=cap)
    assert capped.fit_record_.iterations == cap and not capped.fit_record_.converged
    assert capped.fit_record_.message.startswith(f"stopped at the iteration cap ({cap}: ")


def test_ts_mix_without_mixing_stays_finite():
    """ts-mix at eps = 0 (no fit sets it; a state can): posteriors that underflow give the floor's
    log, not -inf (whose products with a zero weight would be NaN)."""
    model = torchcal.StructuredVectorScaling(reg_lambda=1.0).fit(*_data())
    with torch.no_grad():
        model.mix.zero_()
    log_probs = torch.log_softmax(torch.tensor([[0.0, -5000.0, 5.0]], dtype=torch.float64), 1)
    out = model._ts_mix(log_probs)
    assert torch.isfinite(out).all()
    expected = torch.log_softmax(model.inverse_temperature * log_probs, 1)  # (eps = 0: temperature scaling)
    torch.testing.assert_close(out[0, [0, 2]], expected[0, [0, 2]], atol=1e-12, rtol=0)


def test_svs_keeps_to_the_iteration_cap_newton_included(real, monkeypatch):
    """``max_iter`` caps L-BFGS and the Newton steps that finish the fit together: at 3, L-BFGS
    takes them all and the fit says it stopped there (Newton had gone on to 7 iterations, converged,
    beside L-BFGS's warning)."""
    d = real("sst2_gpt2-4shot_ferrer")
    logits, labels = torch.from_numpy(d["logits"]).double(), torch.from_numpy(d["labels"]).long()
    for newton_classes in (0, 16):  # L-BFGS, then Newton; Newton alone (K = 2)
        monkeypatch.setattr(torchcal.calibrators.structured, "_NEWTON_CPU_CLASSES", newton_classes)
        with pytest.warns(torchcal.ConvergenceWarning, match="iteration cap|did not converge in 3 iterations"):
            model = torchcal.StructuredVectorScaling(reg_lambda=4.0**-4).fit(logits, labels, max_iter=3)
        assert model.fit_record_.iterations <= 3 and not model.fit_record_.converged


def test_sms_hands_over_to_lbfgs_where_newton_cg_stops_short(monkeypatch):
    """SMS fits the log-loss by Newton-CG, without L-BFGS; a Newton-CG fit capped at one step
    (unconverged) hands over to the preconditioned L-BFGS, which goes on from Newton-CG's point
    within the rest of the cap, reaches SciPy's optimum too, and leaves no warning behind."""
    logits, labels = _data()
    z, y = logits.numpy(), labels.numpy()
    _, x = ts_mix_features(z, y)
    best, _ = scipy_fit("sms", x, y, penalty_weights("sms", z.shape[1], len(y), 0.02))
    module = torchcal.calibrators.structured
    calls = []
    monkeypatch.setattr(module, "minimize", lambda *args, **kwargs: calls.append(1) or torchcal.fit.minimize(*args, **kwargs))
    newton = torchcal.StructuredMatrixScaling(reg_lambda=0.02).fit(logits, labels)
    assert not calls and newton.fit_record_.loss == pytest.approx(best, abs=1e-10)
    monkeypatch.setattr(module, "MAX_NEWTON_STEPS", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchcal.fit.ConvergenceWarning)
        handed_over = torchcal.StructuredMatrixScaling(reg_lambda=0.02).fit(logits, labels)
    record = handed_over.fit_record_
    assert calls and record.converged and "after Newton: stopped at the iteration cap (1)" in record.message
    assert record.loss == pytest.approx(best, abs=1e-10)
    calls.clear()
    with pytest.warns(torchcal.fit.ConvergenceWarning, match="StructuredMatrixScaling did not converge: stopped at the iteration cap") as caught:
        capped = torchcal.StructuredMatrixScaling(reg_lambda=0.02).fit(logits, labels, max_iter=1)
    assert len(caught) == 1 and capped.fit_record_.iterations == 1 and not capped.fit_record_.converged
    assert not calls  # (no L-BFGS once Newton-CG used the whole cap)


def test_quadratic_scaling_is_logistic_regression_on_llr_and_its_square():
    gen = torch.Generator().manual_seed(3)
    llr = 2.5 * torch.randn(600, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(torch.sigmoid(0.4 * llr - 0.1 * llr.square() + 0.5), generator=gen).long()
    logits = torch.stack([0.3 * torch.ones_like(llr), llr + 0.3], dim=1)
    model = torchcal.QuadraticScaling().fit(logits, labels)

    basis = np.c_[np.ones(600), llr.numpy(), llr.numpy() ** 2]
    y = labels.numpy()

    def loss(c):
        s = basis @ c
        return np.mean(np.logaddexp(0, s) - y * s), basis.T @ (1 / (1 + np.exp(-s)) - y) / len(y)

    reference = minimize(loss, np.zeros(3), jac=True, method="BFGS", options={"gtol": 1e-12})
    np.testing.assert_allclose(model.coefficients.detach().numpy(), reference.x, rtol=1e-6, atol=1e-8)
    assert model.fit_record_.loss == pytest.approx(reference.fun, abs=1e-12)
    p1 = 1 / (1 + np.exp(-basis @ reference.x))
    np.testing.assert_allclose(model.predict_proba(logits)[:, 1].detach().numpy(), p1, atol=1e-9)


@pytest.mark.parametrize("masked", [-1e10, -1e30, "float32 min", "float64 min"])
def test_quadratic_scaling_with_a_masked_row_fits_the_others(real, masked):
    """SST-2 GPT-2 4-shot scores plus one row whose class 1 is masked by a large negative number
    (label 0). Its loss is 0 only where the map's limit there says class 0, which rules out the
    clean fit's upward quadratic term: the optimum is Platt's map (c = 0; SciPy on the other rows),
    converged. The mean and standard deviation of the log-odds had been the masked row's, every
    other row standardised to the same value, and the fit fell back to the intercept (log-loss
    0.693 against 0.279, reported converged; a binary review); at float64's lowest value the
    forward pass of a fitted map was NaN."""
    data = real("sst2_gpt2-4shot_ferrer")
    dtype = torch.float32 if masked == "float32 min" else torch.float64
    logits, labels = torch.from_numpy(data["logits"]).to(dtype), torch.from_numpy(data["labels"])
    low = torch.finfo(dtype).min if isinstance(masked, str) else masked
    with_masked = torch.cat([logits, torch.tensor([[0.0, low]], dtype=dtype)])
    model = torchcal.QuadraticScaling().fit(with_masked, torch.cat([labels, torch.tensor([0])]))

    llr = (logits[:, 1].double() - logits[:, 0].double()).numpy()
    y = labels.numpy()

    def platt(c):
        s = c[0] + c[1] * llr
        return np.mean(np.logaddexp(0, s) - y * s), np.array([np.mean(1 / (1 + np.exp(-s)) - y), np.mean((1 / (1 + np.exp(-s)) - y) * llr)])

    reference = minimize(platt, np.zeros(2), jac=True, method="BFGS", options={"gtol": 1e-12})
    np.testing.assert_allclose(model.coefficients.detach().numpy(), [*reference.x, 0.0], rtol=1e-6, atol=1e-8)
    assert model.fit_record_.converged
    assert model.fit_record_.loss == pytest.approx(reference.fun * len(y) / (len(y) + 1), abs=1e-10)  # (the masked row: 0)
    assert float(model(with_masked[-1:]).detach()[0, 1]) < -1e9  # its class 1 at probability 0

    clean = torchcal.QuadraticScaling().fit(logits, labels)  # an upward quadratic term: class 1 at both ends
    assert float(clean.coefficients.detach()[2]) > 0
    far = torch.tensor([[0.0, torch.finfo(torch.float64).min], [0.0, -1e308]], dtype=torch.float64)
    torch.testing.assert_close(clean(far).exp(), torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("n, clipped_share", [(2000, 0.8), (100_000, 0.9992)])
def test_quadratic_scaling_with_a_masked_row_and_clipped_log_odds(n, clipped_share):
    """80 % (or all but 80) of the rows at log-odds of exactly 4 (clipped scores) and one masked
    row: the quartiles coincide, and the scale fell back to the standard deviation, the masked
    row's, and the fit to the intercept (log-loss 0.486 against 0.315, reported converged; two
    reviews of the first fix). The wider percentiles, or the median distance of the rows off the
    median, give the scale; the masked row agrees with the downward quadratic term, so the fit is
    scikit-learn's on the other rows."""
    from sklearn.linear_model import LogisticRegression

    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (n,), generator=gen)
    llr = (2 * labels - 1) * 1.5 + 1.2 * torch.randn(n, generator=gen, dtype=torch.float64)
    clipped = torch.rand(n, generator=gen) < clipped_share
    llr[clipped] = 4.0
    labels[clipped] = (torch.rand(int(clipped.sum()), generator=gen) < 0.9).long()
    reference = LogisticRegression(C=1e12, tol=1e-12, max_iter=10000).fit(np.stack([llr.numpy(), llr.numpy() ** 2], 1), labels.numpy())
    logits = torch.stack([torch.zeros(n + 1, dtype=torch.float64), torch.cat([llr, llr.new_tensor([-1e30])])], dim=1)
    model = torchcal.QuadraticScaling().fit(logits, torch.cat([labels, torch.tensor([0])]))
    np.testing.assert_allclose(model.coefficients.detach().numpy(), [*reference.intercept_, *reference.coef_[0]], rtol=1e-5, atol=1e-6)  # (scikit-learn: lbfgs to 1e-12)
    assert model.fit_record_.converged and float(model.coefficients.detach()[2]) < 0


# --------------------------------------------------------------------- probmetrics, real logits
def _probmetrics():
    """probmetrics' calibrators; it imports numba for its SAGA solvers, which are not used here:
    without numba installed a stub decorator stands in for ``numba.njit``."""
    pytest.importorskip("probmetrics")
    pytest.importorskip("torchmin")
    try:
        import numba  # noqa: F401
    except ImportError:
        stub = types.ModuleType("numba")
        stub.njit = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda f: f)
        sys.modules.setdefault("numba", stub)
    from probmetrics.calibrators import get_calibrator

    return get_calibrator


@pytest.mark.parametrize(
    ("name", "data"),
    [("svs", "cifar10_resnet110_kangsepp"), ("sms", "cifar10_resnet110_kangsepp"), ("sms", "cifar100_resnet20_ferrer")],
)
def test_agrees_with_probmetrics_on_real_logits(real, name, data):
    d = real(data)
    if "logits_val" in d:
        fit, test = (d["logits_val"], d["labels_val"]), (d["logits"], d["labels"])
    else:  # one evaluation set: first half to fit, second half to test
        half = len(d["labels"]) // 2
        fit, test = (d["logits"][:half], d["labels"][:half]), (d["logits"][half:], d["labels"][half:])
    get_calibrator = _probmetrics()
    reference = get_calibrator(name).fit(softmax(fit[0].astype(np.float64), axis=1), fit[1])
    ref_test = reference.predict_proba(softmax(test[0].astype(np.float64), axis=1))

    model = MODELS[name](reg_lambda=1.0).fit(torch.from_numpy(fit[0]), torch.from_numpy(fit[1]))
    ours_test = model.predict_proba(torch.from_numpy(test[0]).double()).detach().numpy()
    assert model.inverse_temperature.item() == pytest.approx(reference.ts_.cal_.invtemp_, rel=1e-6)

    # probmetrics stops its float32 L-BFGS at gradients of ~1e-4: on the training objective
    # (float64, ts-mix features of the same temperature) our fit is at least as good ...
    x = model._ts_mix(torch.log_softmax(torch.from_numpy(fit[0]).double(), 1)).numpy()
    weights = penalty_weights(name, x.shape[1], len(fit[1]), 1.0)
    if name == "svs":
        theirs = np.stack([reference.v_ - 1, reference.b_])
    else:
        theirs = reference.W_ - np.c_[np.eye(x.shape[1]), np.zeros(x.shape[1])]
    ours_objective = objective(name, fitted_deviation(name, model), x, fit[1], weights)[0]
    assert ours_objective <= objective(name, theirs, x, fit[1], weights)[0] + 1e-9
    # ... and the test log-losses differ by what that early stop moves them (measured <= 6e-5
    # nats), far below the gaps between calibrators (TS 0.2093 vs SMS 0.2031 on CIFAR-10)
    rows = np.arange(len(test[1]))
    ours_nll = -np.log(ours_test[rows, test[1]]).mean()
    ref_nll = -np.log(ref_test[rows, test[1]]).mean()
    assert abs(ours_nll - ref_nll) < 5e-4
    assert np.abs(ours_test - ref_test).max() < 2e-2


# ------------------------------------------------------------------------------ cross-validation
def test_cross_validated_lambda_matches_a_cold_started_grid():
    logits, labels = _data(300, 4, seed=5)
    grid = [1e-3, 0.01, 0.05, 1.0, 20.0]
    model = torchcal.StructuredMatrixScaling(reg_lambda=None, reg_grid=grid, cv_folds=3).fit(logits, labels)
    totals = np.zeros(len(grid))
    for test in fold_indices(labels, 3, 0, scores=logits):
        train = torch.ones(len(labels), dtype=torch.bool)
        train[test] = False
        for i, reg_lambda in enumerate(grid):
            fold = torchcal.StructuredMatrixScaling(reg_lambda=reg_lambda).fit(logits[train], labels[train])
            log_q = fold(logits[test]).detach()
            totals[i] -= log_q[torch.arange(len(test)), labels[test]].sum().item()
    best = int(np.argmin(totals))
    assert model.reg_lambda_ == grid[best]
    tried = np.isfinite(model.cv_losses_)
    assert tried[best] and not tried.all()  # the path stopped once the loss had risen twice
    # the selection fits stop at a looser tolerance than the cold, final ones (up to ~1e-5 apart)
    np.testing.assert_allclose(np.array(model.cv_losses_)[tried], totals[tried] / len(labels), rtol=2e-5)
    assert (totals[~tried] > totals[best]).all()
    # the final fit starts from the folds' mean map: the same optimum, reached from elsewhere
    refit = torchcal.StructuredMatrixScaling(reg_lambda=model.reg_lambda_).fit(logits, labels)
    torch.testing.assert_close(model.weight, refit.weight, atol=1e-6, rtol=0)


def test_near_ties_of_the_cross_validation_are_fitted_again_tightly(caplog):
    """Two lambdas 0.1 % apart have out-of-fold losses within fit._TIE of each other: both are
    fitted again to _TIE_TOL_CHANGE from their loose fits, and their losses then agree with cold,
    converged fits (the loose ones were 2.3e-6 off here)."""
    logits, labels = _data(300, 4, seed=5)
    grid = [1e-3, 0.05, 0.05 * 1.001, 20.0]
    with caplog.at_level(logging.INFO, logger="torchcal.fit"):
        model = torchcal.StructuredMatrixScaling(reg_lambda=None, reg_grid=grid, cv_folds=3).fit(logits, labels)
    refitted = [r.getMessage() for r in caplog.records if "fitted again tightly" in r.getMessage()]
    assert len(refitted) == 2 and all("lambda = 0.05" in m for m in refitted), refitted
    for i in (1, 2):
        total = 0.0
        for test in fold_indices(labels, 3, 0, scores=logits):
            train = torch.ones(len(labels), dtype=torch.bool)
            train[test] = False
            fold = torchcal.StructuredMatrixScaling(reg_lambda=grid[i]).fit(logits[train].double(), labels[train])
            total -= fold(logits[test].double())[torch.arange(len(test)), labels[test]].sum().item()
        assert model.cv_losses_[i] == pytest.approx(total / len(labels), rel=1e-6)


# -------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", sorted(MODELS))
def test_state_dict_round_trip_and_head(name):
    logits, labels = _data()
    model = MODELS[name](reg_lambda=0.5).fit(logits, labels)
    fresh = MODELS[name]()
    fresh.load_state_dict(model.state_dict())
    assert fresh.reg_lambda_ == 0.5 and fresh.num_classes == 4
    torch.testing.assert_close(fresh(logits), model(logits), rtol=0, atol=0)

    net = torch.nn.Linear(4, 4, dtype=torch.float64)
    with torch.no_grad():
        net.weight.copy_(torch.eye(4))
        net.bias.zero_()
    head = torchcal.attach(net, MODELS[name](reg_lambda=0.5), [(logits.double(), labels)])
    with torch.no_grad():
        torch.testing.assert_close(head(logits.double()), model(logits.double()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dtype_and_row_order_invariance(name):
    logits, labels = _data(500, 5, seed=2)
    # a fixed lambda: cross-validation's folds follow the row order
    model = MODELS[name](reg_lambda=1.0).fit(logits, labels)
    wide = MODELS[name](reg_lambda=1.0).fit(logits.double(), labels)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    permuted = MODELS[name](reg_lambda=1.0).fit(logits[perm], labels[perm])
    for other in (wide, permuted):
        torch.testing.assert_close(other.weight, model.weight, atol=1e-5, rtol=0)
        torch.testing.assert_close(other.bias, model.bias, atol=1e-5, rtol=0)
    out32, out64 = model(logits), model(logits.double())
    assert out32.dtype == torch.float32 and out64.dtype == torch.float64
    torch.testing.assert_close(out32.double(), out64, atol=1e-4, rtol=0)
    torch.testing.assert_close(out64.logsumexp(1), torch.zeros(len(labels), dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_float32_forward_keeps_small_margins(name):
    """The features were float32 log-softmaxes, whose log-sum-exp rounds margins of 1e-4, which
    the fitted beta (about 6e4 here) multiplies: float32 logits came out 2e-2 off the float64
    ones, against temperature scaling's 4e-6 (review finding). Fitted on float64 logits."""
    logits, labels = _data(2000, 5, seed=4)
    small = 1e-5 * logits.double()
    model = MODELS[name](reg_lambda=1.0).fit(small, labels)
    assert float(model.inverse_temperature) > 1e3
    torch.testing.assert_close(model(small.float()).double(), model(small), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("name", "num_classes", "loss"), [("svs", 20, "log"), ("svs", 4, "brier"), ("sms", 4, "brier")])
def test_scores_that_say_nothing_fit_the_class_frequencies(name, num_classes, loss):
    """Constant logits (a collapsed model): the ts-mix fit's beta is 0, every per-class block of
    the preconditioner rank one, and its float32 sums' round-off failed their Cholesky
    factorisation under the grid's weak penalties (review finding). The fit is the penalised
    intercepts' optimum: the class frequencies, up to the ridge's shrinkage."""
    n = 20000
    labels = torch.randint(0, num_classes, (n,), generator=torch.Generator().manual_seed(n))
    model = MODELS[name]().fit(torch.zeros(n, num_classes), labels, loss=loss)
    frequencies = torch.bincount(labels, minlength=num_classes).double() / n
    torch.testing.assert_close(model.predict_proba(torch.zeros(1, num_classes)).double()[0], frequencies, atol=2e-3, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fits_on_the_logits_device(name):
    logits, labels = _data()
    cpu = MODELS[name]().fit(logits, labels)
    gpu = MODELS[name]().fit(logits.cuda(), labels.cuda())
    assert gpu.reg_lambda_ == cpu.reg_lambda_
    assert gpu.weight.device.type == "cuda"
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, atol=1e-5, rtol=0)


def test_brier_fit_is_stationary_for_the_brier_objective():
    logits, labels = _data()
    model = torchcal.StructuredMatrixScaling(reg_lambda=1.0).fit(logits, labels, loss="brier")
    x = model._ts_mix(torch.log_softmax(logits.double(), 1))
    theta = model._theta().detach().clone().requires_grad_(True)
    weights = torch.from_numpy(penalty_weights("sms", 4, len(labels), 1.0))
    q = torch.softmax(model._map_theta(model._design(x), theta), 1)
    loss = (q - torch.nn.functional.one_hot(labels, 4)).square().sum(1).mean() + (weights * theta.square()).sum()
    (grad,) = torch.autograd.grad(loss, theta)
    assert grad.abs().max() < 1e-6


def test_bad_input_is_refused_with_a_clear_message():
    logits, labels = _data()
    with pytest.raises(ValueError, match="reg_lambda must be finite and >= 0"):
        torchcal.StructuredMatrixScaling(reg_lambda=-1.0)
    with pytest.raises(ValueError, match="reg_grid"):
        torchcal.StructuredVectorScaling(reg_lambda=None, reg_grid=[])
    with pytest.raises(ValueError, match="K = 2"):
        torchcal.QuadraticScaling().fit(logits, labels)
    with pytest.raises(RuntimeError, match="not fitted"):
        torchcal.StructuredVectorScaling()(logits)
    model = torchcal.StructuredVectorScaling().fit(logits, labels)
    with pytest.raises(ValueError, match="K = 3 classes but 4"):
        model(logits[:, :3])
    with pytest.raises(ValueError, match="loss must be"):
        torchcal.StructuredMatrixScaling().fit(logits, labels, loss="hinge")


def test_cli_methods_list_them():
    from torchcal.report import make_calibrator

    assert isinstance(make_calibrator("sms"), torchcal.StructuredMatrixScaling)
    assert isinstance(make_calibrator("svs", reg_lambda=None), torchcal.StructuredVectorScaling)


# ------------------------------------------------------------------------------- data-parallel
SPLIT = 250


def _worker(rank: int, out: str) -> None:
    logits, labels = _data()
    shard = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    fitted = {}
    for name, cls in MODELS.items():
        model = cls(reg_lambda=0.3).fit(logits[shard], labels[shard], process_group=dist.group.WORLD)
        fitted[name] = {"state": model.state_dict(), "loss": model.fit_record_.loss}
    torch.save(fitted, Path(out) / f"rank{rank}.pt")


def _two_processes(worker, tmp_path: Path, stem: str) -> list:
    """What ``worker`` saved as ``<stem><rank>.pt`` in each of two gloo processes."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spawn_gloo(worker, 2, str(tmp_path))
    return [torch.load(tmp_path / f"{stem}{r}.pt", weights_only=False) for r in range(2)]


def test_two_processes_match_one_process_on_the_union(tmp_path):
    ranks = _two_processes(_worker, tmp_path, "rank")
    logits, labels = _data()
    for name, cls in MODELS.items():
        single = cls(reg_lambda=0.3).fit(logits, labels)
        for fitted in ranks:
            assert fitted[name]["loss"] == pytest.approx(single.fit_record_.loss, rel=1e-9)
            for key, value in single.state_dict().items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(fitted[name]["state"][key], value, rtol=1e-6, atol=1e-6)


def _cv_worker(rank: int, out: str) -> None:
    logits, labels = _data()
    shard = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    grid = [1e-3, 0.05, 1.0, 20.0]
    model = torchcal.StructuredMatrixScaling(reg_grid=grid, cv_folds=3)
    model.fit(logits[shard], labels[shard], process_group=dist.group.WORLD)
    torch.save({"cv_losses": model.cv_losses_, "reg_lambda": model.reg_lambda_, "weight": model.weight}, Path(out) / f"cv{rank}.pt")


def test_two_processes_cross_validate_along_one_path(tmp_path):
    """Every process walks the same path (the abandon and stop decisions read summed losses), and
    fold f is the union of every process's own fold f."""
    ranks = _two_processes(_cv_worker, tmp_path, "cv")
    assert ranks[0]["cv_losses"] == ranks[1]["cv_losses"] and ranks[0]["reg_lambda"] == ranks[1]["reg_lambda"]
    torch.testing.assert_close(ranks[0]["weight"], ranks[1]["weight"], rtol=0, atol=0)
    logits, labels = _data()
    grid = [1e-3, 0.05, 1.0, 20.0]
    shards = [torch.arange(SPLIT), torch.arange(SPLIT, len(labels))]
    folds = [fold_indices(labels[shard], 3, 0, scores=logits[shard]) for shard in shards]
    assert np.isfinite(ranks[0]["cv_losses"]).sum() >= 2
    for i, loss in enumerate(ranks[0]["cv_losses"]):
        if not np.isfinite(loss):
            continue
        total = 0.0
        for f in range(3):
            test = torch.cat([shard[fold[f]] for shard, fold in zip(shards, folds)])
            train = torch.ones(len(labels), dtype=torch.bool)
            train[test] = False
            log_q = torchcal.StructuredMatrixScaling(reg_lambda=grid[i]).fit(logits[train], labels[train])(logits[test]).detach()
            total -= log_q[torch.arange(len(test)), labels[test]].sum().item()
        # the selection fits stop at a gradient of 1e-4: out-of-fold losses within 3e-5 (SELECTION_TOLERANCES)
        assert loss == pytest.approx(total / len(labels), rel=3e-5)
