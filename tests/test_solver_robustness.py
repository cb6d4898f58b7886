"""Regression tests for solver bugs found by the property-based and degenerate-data tests:
a saturated row capping the temperature (P1), a constant classifier sent to T -> 0 by float32
round-off (P2), a stalled Newton search reported as converged (P3), and a singular Hessian
raising out of ``fit`` (P4), and an L-BFGS fit ending on NaN reported as converged (P5)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize as scipy_minimize
from scipy.special import expit, log_softmax

import torchcal
from torchcal.calibrators._linear import FullDesign, fit_linear_newton
from torchcal.functional import cross_entropy


def _loss(cal, logits, labels):
    with torch.no_grad():
        return float(cross_entropy(cal(logits.double()), labels))


# --------------------------------------------------------------------------- P1
def test_one_saturated_row_does_not_cap_the_temperature_above_the_identity():
    """fit_inverse_temperature caps beta at 1e4 / (largest row spread). One saturated row with a
    spread of 2e4 nats caps beta at 0.5, i.e. T >= 2, even though the other 199 rows want T < 1:
    the fit ends with a loss far above the identity map's (0.60 -> 0.78 here) and warns, wrongly,
    that the data are "perfectly separable". The cap is only right for separable data; for other
    data the optimum is finite and the bracket finds it (fix: apply beta_max only when every
    true-class logit is the strict row maximum, as before, and start at beta = 1)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=3 * logits).sample()
    logits[0] = torch.tensor([1e4, -1e4, 0.0])
    labels[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = torchcal.TemperatureScaling().fit(logits, labels)
    identity = float(cross_entropy(logits, labels))
    assert _loss(ts, logits, labels) <= identity
    assert ts.temperature < 1  # over-confident by about 3 everywhere but one row


# --------------------------------------------------------------------------- P2
@pytest.mark.filterwarnings("ignore:.*look like probabilities")  # logits of 0.1 at K = 10 do
def test_constant_classifier_gives_an_infinite_temperature():
    """A constant classifier (every logit the same) carries no information: T = inf, with the
    "not positively related" warning (it does so for exact zeros). For other constants the
    derivative at beta = 0 is computed as ``mean(logits) - z_true`` in float32, whose round-off
    is a tiny negative number, and the Newton/doubling search then runs beta up to ~1e38: T =
    2.9e-39, reported as converged, and NaN outputs for K = 10 (fix: compute the derivative at 0
    in float64 and treat |grad| below round-off, or zero curvature, as no information)."""
    failures = []
    for dtype in (torch.float32, torch.float16):
        for value in (-2.302585, 0.1, 1 / 3):
            for k in (10, 100):
                logits = torch.full((50, k), value, dtype=dtype)
                labels = torch.arange(50) % k
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ts = torchcal.TemperatureScaling().fit(logits, labels)
                if not (torch.isfinite(ts(logits)).all() and (ts.temperature == math.inf or ts.temperature > 1e3)):
                    failures.append((dtype, value, k, ts.temperature))
    assert not failures


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_affine_on_a_constant_classifier_is_finite(dtype):
    """The constant classifier again, now through AffineCalibration: it starts from the (broken,
    see above) temperature, alpha = 3.4e38, which overflows in float32: every output is NaN."""
    logits = torch.zeros(2, 10, dtype=dtype)
    labels = torch.tensor([5, 7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = torchcal.AffineCalibration().fit(logits, labels)
    assert torch.isfinite(cal(logits)).all()


# --------------------------------------------------------------------------- P3
def test_a_fit_that_reports_convergence_has_a_small_gradient():
    """fit.newton returns ``converged=True, "no further decrease"`` whenever its line search
    fails (t <= 1e-10), whatever the gradient: here the gradient is 0.4, the loss stays at log 10
    although the biases could bring it towards log 2, and nothing warns (fix: a failed line
    search with a gradient above tolerance is non-convergence: ConvergenceWarning and
    ``converged=False``, or a fallback to the L-BFGS driver)."""
    logits = torch.zeros(2, 10, dtype=torch.float64)
    labels = torch.tensor([5, 7])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = torchcal.AffineCalibration().fit(logits, labels)
    record = cal.fit_record_
    converged_warning = any(issubclass(w.category, torchcal.ConvergenceWarning) for w in caught)
    assert (record.converged and record.grad_max < 1e-6) or (not record.converged and converged_warning), record


# --------------------------------------------------------------------------- P4
@pytest.mark.parametrize("make", [torchcal.AffineCalibration, torchcal.VectorScaling])
def test_saturated_logits_do_not_crash_the_newton_fits(make):
    """Saturated scores (one class at +1e4, the rest below -5e3) give a Hessian that is exactly
    zero: ``ridge = 1e-12 * max|diag|`` is then 0 and ``torch.linalg.solve`` raises the internal
    ``_LinAlgError: ... input matrix is singular`` out of ``fit`` (fix: a positive ridge floor, or
    a gradient step / the L-BFGS driver when the solve fails)."""
    n = 2
    gen = torch.Generator().manual_seed(0)
    logits = -1e4 * (0.5 + 0.5 * torch.rand(n, 10, generator=gen, dtype=torch.float64))
    top = torch.randint(0, 10, (n,), generator=gen)
    logits[torch.arange(n), top] = 1e4
    labels = torch.randint(0, 10, (n,), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = make().fit(logits, labels)
    assert torch.isfinite(cal(logits)).all()
    assert _loss(cal, logits, labels) <= float(cross_entropy(logits, labels))


# --------------------------------------------------------------------------- P5
def _fit_or_clear_error(make, logits):
    """Fit on ``logits`` (60 samples, labels cycling over the 4 classes), warnings silenced; None
    when the fit raises a clear ``ValueError`` instead, which is an acceptable answer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return make().fit(logits, torch.arange(60) % 4)
        except ValueError:
            return None


@pytest.mark.parametrize("make, scale", [(torchcal.DirichletCalibration, 1e150), (torchcal.VectorScaling, 1e300)])
def test_a_nan_fit_is_never_reported_as_converged(make, scale):
    """Beyond the 1e4 range of the issue, but silent: with logits of astronomical magnitude the
    L-BFGS fit of fit.minimize ends with loss = grad = NaN and ``converged=True`` ("loss or step
    change below tolerance", since ``iterations < max_iter``), no warning, and NaN outputs (fix:
    a non-finite loss or gradient is never convergence; warn, or raise a clear error)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the state of the generator picks the failing draw, as in the report
        logits = torch.randn(60, 4, generator=gen, dtype=torch.float64) * 1e30
    logits = torch.randn(60, 4, generator=gen, dtype=torch.float64) * scale
    cal = _fit_or_clear_error(make, logits)
    if cal is None:
        return
    record = cal.fit_record_
    assert math.isfinite(record.loss) or not record.converged, record
    assert torch.isfinite(cal(logits)).all() or not record.converged


@pytest.mark.parametrize("make", [torchcal.VectorScaling, torchcal.MatrixScaling, torchcal.DirichletCalibration])
def test_a_failed_fit_keeps_finite_parameters(make):
    """Beyond the 1e4 range of the issue, but silent: with logits of astronomical magnitude
    (1e200) the fit falls back to L-BFGS (fit.minimize), which ends with loss = grad = NaN after
    2002 evaluations and reports ``converged=True`` ("loss or step change below tolerance", as
    ``iterations < max_iter``): no warning, and every output is NaN. Fix: a non-finite loss or
    gradient is never convergence: ConvergenceWarning and ``converged=False`` (or a clear error),
    and keep the last finite parameters."""
    gen = torch.Generator().manual_seed(0)
    logits = 1e200 * torch.randn(60, 4, generator=gen, dtype=torch.float64)
    cal = _fit_or_clear_error(make, logits)
    if cal is None:
        return
    record = cal.fit_record_
    assert math.isfinite(record.loss) or not record.converged, record
    assert torch.isfinite(cal(logits)).all()


# --------------------------------------------------------------------------- P6
def _near_certain_class(n: int = 3000, k: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities whose class 0 sits within 1e-4 (mostly 1e-7) of 0 in every row, and
    labels that depend on exactly that tiny variation (issue 15, item 1: real 9-class medical
    logits behave so)."""
    gen = torch.Generator().manual_seed(0)
    others = -18 + 2 * torch.randn(n, k - 1, generator=gen, dtype=torch.float64)
    log_probs = torch.log_softmax(torch.cat([torch.zeros(n, 1, dtype=torch.float64), others], 1), 1)
    scores = log_probs + 18
    scores[:, 0] = 1e7 * log_probs[:, 0] + 3
    return log_probs, torch.multinomial(torch.softmax(scores, 1), 1, generator=gen).squeeze(1)


def _scipy_optimum(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Float64 SciPy optimum of vector scaling, solved on features scaled to unit root mean
    square (where the problem is well scaled) and mapped back: (loss, weight of class 0)."""
    scale = x.square().mean(0).sqrt().numpy()
    xs, y = x.numpy() / scale, y.numpy()
    n, k = xs.shape
    onehot = np.eye(k)[y]

    def fun(t):
        log_q = log_softmax(t[:k] * xs + t[k:], axis=1)
        r = (np.exp(log_q) - onehot) / n
        return -log_q[np.arange(n), y].mean(), np.r_[(r * xs).sum(0), r.sum(0)]

    res = scipy_minimize(fun, np.r_[scale, np.zeros(k)], jac=True, method="L-BFGS-B", options={"maxiter": 20_000, "gtol": 1e-13, "ftol": 1e-16})
    return res.fun, res.x[0] / scale[0]


def test_a_near_certain_class_reaches_the_optimum_in_every_row_order():
    """Before: Newton's ridge ``1e-12 * max|diag H|`` swamped the curvature of the near-0 class's
    weight (about 1e-14); Newton hit its cap and L-BFGS stopped with that weight at 1.0 instead
    of 1.04e7, 3.4 % above the optimum, differing with the row order in the last digits. The
    ridge is now relative to each parameter's own curvature."""
    logits, labels = _near_certain_class()
    loss, weights = _scipy_optimum(logits, labels)
    for seed in range(3):
        perm = torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(seed))
        cal = torchcal.VectorScaling().fit(logits[perm], labels[perm])
        assert cal.fit_record_.loss == pytest.approx(loss, rel=1e-10)
        assert float(cal.weight[0]) == pytest.approx(weights, rel=1e-5)


def test_dirichlet_with_a_near_certain_class_reaches_the_dense_newton_optimum_in_every_row_order():
    """The same data through Dirichlet-ODIR (lambda = mu = 1e-2): before, Newton's cap and then
    L-BFGS's, 7 % above the optimum and different for every row order (W[0, 0] = 0.04 where it
    is 1.4e7). Now Newton-CG on scaled features, against the dense-Hessian Newton reference."""
    logits, labels = _near_certain_class(1500)
    reference = torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2)
    reference.reg_lambda_ = reference.reg_mu_ = 1e-2
    start = torch.eye(9, 10, dtype=torch.float64).flatten()
    theta, record = fit_linear_newton(FullDesign(), logits, labels, None, start, reference._penalty_weights(9).flatten())
    assert record.converged
    for seed in range(3):
        perm = torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(seed))
        cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2).fit(logits[perm], labels[perm])
        assert cal.fit_record_.loss == pytest.approx(record.loss, rel=1e-12)
        torch.testing.assert_close(cal.weight[:, 0].detach(), theta.view(9, 10)[:, 0], rtol=1e-4, atol=1e-4 * float(theta[0]))


@pytest.mark.parametrize("loss", ["log", "brier"])
def test_temperature_fit_is_the_same_at_any_scale_of_the_logits(loss):
    """Temperature scaling absorbs a scale of the logits into the temperature. In float32 the fit
    of logits scaled by 1e19 overflowed (the curvature sums e^(beta w) w^2 with w^2 ~ 1e40) and
    ended at T = inf, cross-entropy log(10) instead of 0.22, reported converged; at 1e20, at 1.05
    (fix: the search runs on the logits divided by a power of 2 near their typical margin)."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 10, generator=gen, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 2).sample()
    fits = {}
    for dtype in (torch.float32, torch.float64):
        for scale in (1e-10, 1e-3, 1.0, 1e18, 1e19, 1e20, 1e30):
            scaled = (logits * scale).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ts = torchcal.TemperatureScaling().fit(scaled, labels, loss=loss)
            assert ts.fit_record_.converged, (dtype, scale)
            fits[dtype, scale] = (_loss(ts, scaled, labels), ts.temperature / scale)
    reference_loss, reference_temperature = fits[torch.float64, 1.0]
    assert 1.5 < reference_temperature < 4
    for key, (value, temperature) in fits.items():
        assert (value, temperature) == pytest.approx((reference_loss, reference_temperature), rel=1e-5), key


def test_rescaled_temperature_fit_of_tiny_margins_keeps_a_masked_class_finite():
    """Logits of typical margin below 2^-16 are rescaled up; in float32 a class masked at
    float32's lowest value overflowed to -inf there, and the fit's loss was NaN."""
    from torchcal.calibrators.temperature import fit_inverse_temperature

    gen = torch.Generator().manual_seed(0)
    logits = 1e-6 * torch.randn(2000, 5, generator=gen)
    logits[:, -1] = torch.finfo(torch.float32).min
    labels = torch.multinomial(torch.softmax(logits[:, :-1].double() * 1e6, 1), 1, generator=gen).squeeze(1)
    beta64, record64 = fit_inverse_temperature(logits.double(), labels)
    beta32, record32 = fit_inverse_temperature(logits, labels)
    assert record32.converged and record64.converged
    assert beta32 == pytest.approx(beta64, rel=1e-8) and 0.5 < beta64 * 1e-6 < 2


# ----------------------------------------------- review findings: preconditioned L-BFGS records
def _brier_objective_gradient(cal, features, labels, penalty):
    """Float64 autograd: the largest gradient entry of the mean Brier score plus ``penalty(W, b)``
    in the map's own parameters ``[W | b]`` (an independent computation of the record's)."""
    weight, bias = cal.weight.detach().clone().requires_grad_(True), cal.bias.detach().clone().requires_grad_(True)
    q = torch.softmax(features @ weight.T + bias, 1)
    value = (q - torch.nn.functional.one_hot(labels, q.shape[1])).square().sum(1).mean() + penalty(weight, bias)
    return max(float(g.abs().max()) for g in torch.autograd.grad(value, [weight, bias]))


@pytest.mark.parametrize("scale", [3.0, 30.0])
def test_preconditioned_lbfgs_records_the_gradient_of_the_maps_own_parameters(scale):
    """MatrixScaling's Brier fit runs L-BFGS in curvature-scaled coordinates; its record (and the
    convergence test) reported their gradient, 5-20x below [W | b]'s at logits of scale 30."""
    gen = torch.Generator().manual_seed(3)
    logits = scale * torch.randn(2000, 5, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(2 * logits / scale, 1), 1, generator=gen).squeeze(1)
    off = ~torch.eye(5, dtype=torch.bool)
    for make, penalty in (
        (torchcal.MatrixScaling, lambda w, b: 0.0),
        (lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=10.0),
         lambda w, b: 10.0 / 20 * w[off].square().sum() + 10.0 / 5 * b.square().sum()),
    ):
        cal = make().fit(logits, labels, loss="brier")
        features = logits if type(cal) is torchcal.MatrixScaling else torch.log_softmax(logits, 1)
        assert cal.fit_record_.grad_max == pytest.approx(_brier_objective_gradient(cal, features, labels, penalty), rel=1e-6)
        assert f"{cal.fit_record_.grad_max:.2e}" in cal.fit_record_.message


def test_matrix_newton_cg_hands_over_from_its_point_within_the_cap(monkeypatch):
    """A Newton-CG fit stopped short (here its own step cap) hands over to L-BFGS from its point,
    with the rest of the fit's cap, and without a warning where L-BFGS converges; capped by the
    fit's max_iter it keeps its point, with one warning, and no L-BFGS. (L-BFGS restarted from the
    starting point with the whole cap, after Newton-CG's warning.)"""
    from torchcal.calibrators import matrix

    gen = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(1500, 6, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=gen).squeeze(1)
    reference = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels)
    starts = []
    original = torchcal.calibrators.base.Calibrator._fit

    def spy(self, *args, **kwargs):
        starts.append(self._theta().clone())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torchcal.calibrators.base.Calibrator, "_fit", spy)
    monkeypatch.setattr(matrix, "MAX_NEWTON_STEPS", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchcal.ConvergenceWarning)
        handed = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels, max_iter=500)
    record = handed.fit_record_
    assert len(starts) == 1 and not torch.equal(starts[0], torch.eye(6, 7, dtype=torch.float64) * starts[0][0, 0])
    assert record.converged and "after Newton: stopped at the iteration cap (2)" in record.message
    assert record.iterations <= 500 and record.loss == pytest.approx(reference.fit_record_.loss, abs=1e-9)
    starts.clear()
    with pytest.warns(torchcal.ConvergenceWarning, match="DirichletCalibration did not converge") as caught:
        capped = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(logits, labels, max_iter=2)
    assert len(caught) == 1 and not starts and capped.fit_record_.iterations == 2


@pytest.mark.parametrize("make", [torchcal.StructuredMatrixScaling, lambda: torchcal.DirichletCalibration(reg="odir")])
def test_cross_validation_with_a_small_cap_warns_once_with_a_count(make):
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(600, 5, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=gen).squeeze(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make().fit(logits, labels, max_iter=1)
    messages = [str(w.message) for w in caught if issubclass(w.category, torchcal.ConvergenceWarning)]
    summaries = [m for m in messages if "from the cross-validation's fits" in m]
    assert len(summaries) == 1 and len(messages) <= 3, messages  # the summary, the final fit's (and its TS start's)
    assert int(summaries[0].split()[0]) > 5


def test_structured_lbfgs_records_the_gradient_of_the_maps_own_parameters():
    """The same for SVS's Brier fit, whose L-BFGS runs in per-class-block coordinates."""
    gen = torch.Generator().manual_seed(6)
    logits = 4 * torch.randn(1500, 6, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=gen).squeeze(1)
    cal = torchcal.StructuredVectorScaling(reg_lambda=1.0).fit(logits, labels, loss="brier")
    x = cal._ts_mix(torch.log_softmax(logits, 1))
    weight, bias = cal.weight.detach().clone().requires_grad_(True), cal.bias.detach().clone().requires_grad_(True)
    q = torch.softmax(weight * x + bias, 1)
    value = (q - torch.nn.functional.one_hot(labels, 6)).square().sum(1).mean() + 6 / 1500 * ((weight - 1).square().sum() + bias.square().sum())
    expected = max(float(g.abs().max()) for g in torch.autograd.grad(value, [weight, bias]))
    assert cal.fit_record_.grad_max == pytest.approx(expected, rel=1e-6)


def test_a_masked_class_in_float32_logits_is_searched_in_float64():
    """A class masked at -1e30 overflowed the float32 curvature sums (w^2): with samples labelled
    with it the fit reported converged at T = 4e28, a loss of 5.08 against the uniform posteriors'
    2.30, without a warning; float64 logits gave T = inf, warned."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 10, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=gen).squeeze(1)
    logits[:, 3] = -1e30
    for dtype in (torch.float64, torch.float32):
        with pytest.warns(torchcal.ConvergenceWarning, match="best temperature is infinite"):
            assert torchcal.TemperatureScaling().fit(logits.to(dtype), labels).temperature == math.inf
    kept = labels != 3  # no sample of the masked class: a finite temperature, the same in both
    temperatures = [torchcal.TemperatureScaling().fit(logits[kept].to(dtype), labels[kept]).temperature
                    for dtype in (torch.float64, torch.float32)]
    assert temperatures[1] == pytest.approx(temperatures[0], rel=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1e5])
def test_beta_calibration_reaches_scipys_optimum_at_any_scale_of_the_log_odds(scale):
    """Beta's log-loss fit is Newton's method (logistic regression on [1, log q1, -log q0]),
    started from temperature scaling: L-BFGS stopped 2 % above the optimum on log-odds of 1e5 and
    reported converged. Against SciPy's optimum, also under a prior of 1e-6 (where L-BFGS stopped
    at once on an absolute gradient tolerance, 4.5e-5 above it)."""
    gen = torch.Generator().manual_seed(0)
    llr = 2 * torch.randn(3000, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(torch.sigmoid(0.6 * llr - 0.5), generator=gen).long()
    logits = torch.stack([torch.zeros_like(llr), scale * llr], dim=1)
    log_q = torch.log_softmax(logits, 1).numpy()
    y = labels.numpy()
    for priors in (None, torch.tensor([1e-6, 1 - 1e-6], dtype=torch.float64)):
        counts = np.bincount(y, minlength=2) / len(y)
        w = np.ones(2) if priors is None else priors.numpy() / counts

        def objective(theta):
            c, a, b = theta
            z = a * log_q[:, 1] - b * log_q[:, 0] + c
            per_sample = np.logaddexp(0, z) - y * z
            residual = (expit(z) - y) * w[y] / len(y)
            return float(np.mean(w[y] * per_sample)), np.array([residual.sum(), residual @ log_q[:, 1], -residual @ log_q[:, 0]])

        reference = scipy_minimize(objective, np.array([0.0, 1 / scale, 1 / scale]), jac=True, method="BFGS", options={"gtol": 1e-14})
        cal = torchcal.BetaCalibration().fit(logits, labels, priors=priors)
        assert cal.fit_record_.converged
        assert cal.fit_record_.loss == pytest.approx(reference.fun, rel=1e-9)
        torch.testing.assert_close(torch.stack([cal.c, cal.a, cal.b]).detach(), torch.from_numpy(reference.x), rtol=1e-4, atol=1e-10)
