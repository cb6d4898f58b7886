"""Label shift: prior estimation against a NumPy EM, a SciPy maximum of the likelihood and a NumPy
SQUAREM-accelerated EM run to convergence (real logits where plain EM crawls, random problems with
absent classes, K = 1,000); on real CIFAR-10 logits resampled to shifted priors, recovery within the
standard errors and a lower test log-loss after adaptation, next to the known-prior answer."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import load_real
from gloo import spawn_gloo
from label_shift_reference import numpy_squarem

from torchcal import AffineCalibration, ConvergenceWarning, IsotonicCalibration
from torchcal.functional.scoring import class_frequencies, cross_entropy
from torchcal.label_shift import LabelShiftAdapter, adapt_to_priors, estimate_priors

K = 10
SHIFTED = torch.tensor(0.7, dtype=torch.float64) ** torch.arange(K)  # 0.31 down to 0.012
SHIFTED /= SHIFTED.sum()


def _validation_split() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_real("cifar10_resnet110_kangsepp")
    return torch.from_numpy(data["logits_val"]), torch.from_numpy(data["labels_val"])


@pytest.fixture(scope="module")
def cifar10():
    data = load_real("cifar10_resnet110_kangsepp")
    z_test, y_test = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    adapter = LabelShiftAdapter().fit(*_validation_split())  # BCTS on the validation split
    return adapter, z_test, y_test


def _shifted_sample(logits, labels, priors, n, seed):
    """n test samples drawn i.i.d. from the test set re-weighted to ``priors``."""
    gen = torch.Generator().manual_seed(seed)
    wanted = torch.multinomial(priors, n, replacement=True, generator=gen)
    index = torch.empty(n, dtype=torch.long)
    for k in range(len(priors)):
        members = (labels == k).nonzero().flatten()
        chosen = wanted == k
        index[chosen] = members[torch.randint(len(members), (int(chosen.sum()),), generator=gen)]
    return logits[index], labels[index]


def _numpy_em(posteriors: np.ndarray, source: np.ndarray, iterations: int) -> np.ndarray:
    """Saerens et al. (2002), as written there: adapt the posteriors, average them, repeat."""
    priors = source.copy()
    for _ in range(iterations):
        adapted = posteriors * priors / source
        adapted /= adapted.sum(axis=1, keepdims=True)
        priors = adapted.mean(axis=0)
    return priors


def test_em_matches_numpy_em_and_the_maximum_likelihood(cifar10):
    scipy_optimize = pytest.importorskip("scipy.optimize")
    adapter, z_test, y_test = cifar10
    z, _ = _shifted_sample(z_test, y_test, SHIFTED, 1500, seed=0)
    with torch.no_grad():
        calibrated = adapter.calibrator(z).double()
    source = adapter.source_priors
    for iterations in (1, 7):  # the first ten steps are EM's
        with pytest.warns(ConvergenceWarning, match="iteration cap"):
            estimate = estimate_priors(calibrated, source, max_iter=iterations)
        assert estimate.record.iterations == iterations and not estimate.record.converged
        expected = _numpy_em(calibrated.exp().numpy(), source.numpy(), iterations)
        np.testing.assert_allclose(estimate.priors.numpy(), expected, rtol=0, atol=1e-12)
    # the converged estimate maximises the target likelihood over the simplex
    estimate = estimate_priors(calibrated, source, tol=1e-12)
    ratio = (calibrated.exp() / source).numpy()

    def negative_log_likelihood(theta):
        priors = np.exp(theta - theta.max())
        priors /= priors.sum()
        mixture = ratio @ priors
        gradient_priors = -(ratio / mixture[:, None]).mean(0)
        return -np.log(mixture).mean(), priors * (gradient_priors - priors @ gradient_priors)

    optimum = scipy_optimize.minimize(negative_log_likelihood, np.zeros(K), jac=True, method="L-BFGS-B", tol=1e-14)
    optimum_priors = np.exp(optimum.x - optimum.x.max()) / np.exp(optimum.x - optimum.x.max()).sum()
    np.testing.assert_allclose(estimate.priors.numpy(), optimum_priors, rtol=0, atol=1e-6)
    assert estimate.record.loss == pytest.approx(optimum.fun, abs=1e-8)
    assert estimate.record.converged and estimate.record.grad_max <= 1e-12


def test_converges_where_em_crawls(real):
    """CIFAR-100 LeNet-5 logits, BCTS on 5,000 of them, the other 5,000 resampled to Dirichlet(0.5)
    priors: the classes' scores overlap so much that plain EM, after 1,000 steps, was still 1.2e-3
    off (and needed 57,343 to change no prior by more than 1e-13). Ten EM and ten Newton steps reach
    the maximum, 56 classes at exactly 0."""
    data = real("cifar100_lenet5_netcal")
    logits, labels = torch.from_numpy(data["logits"]).double(), torch.from_numpy(data["labels"])
    rng = np.random.default_rng(0)
    order = rng.permutation(len(labels))
    calibration, rest = order[:5000], order[5000:]
    weights = rng.dirichlet(np.full(100, 0.5))[labels[rest]]
    target = torch.from_numpy(rng.choice(rest, 5000, p=weights / weights.sum()))
    adapter = LabelShiftAdapter().fit(logits[calibration], labels[calibration]).adapt(logits[target])
    estimate = adapter.estimate_
    assert estimate.record.converged and estimate.record.iterations <= 25
    with torch.no_grad():
        posteriors = adapter.calibrator(logits[target]).exp().numpy()
    reference = numpy_squarem(posteriors, adapter.source_priors.numpy())
    np.testing.assert_allclose(estimate.priors.numpy(), reference, rtol=0, atol=1e-10)
    assert int((estimate.priors == 0).sum()) == int((reference < 1e-9).sum()) == 56
    assert estimate.record.grad_max <= 1e-12


def _gaussian_problem(num_classes, n, signal, concentration, seed) -> tuple[np.ndarray, np.ndarray]:
    """Target logits (n, K) and source priors (K,): classes ``N(signal e_k, I)`` with Dirichlet(5)
    source and Dirichlet(concentration) target priors; ``signal * z + log(source)`` are the logits of
    the exact source posteriors."""
    rng = np.random.default_rng(seed)
    source, target = rng.dirichlet(np.full(num_classes, 5.0)), rng.dirichlet(np.full(num_classes, concentration))
    scores = rng.standard_normal((n, num_classes))
    scores[np.arange(n), rng.choice(num_classes, n, p=target)] += signal
    return signal * scores + np.log(source), source


@pytest.mark.parametrize(
    "problem",
    [
        (10, 3000, 0.3, 1.0, 0),  # heavily overlapping classes
        (50, 3000, 0.3, 0.1, 1),  # and 28 classes absent from the target
        (200, 500, 1.0, 0.1, 2),  # 146 absent
        (1000, 4000, 4.0, 0.3, 3),  # K = 1,000, 457 absent
    ],
)
def test_matches_the_squarem_reference_on_random_problems(problem):
    logits, source = _gaussian_problem(*problem)
    estimate = estimate_priors(torch.from_numpy(logits), torch.from_numpy(source))
    assert estimate.record.converged and estimate.record.grad_max <= 1e-12
    posteriors = np.exp(logits - logits.max(1, keepdims=True))
    reference = numpy_squarem(posteriors / posteriors.sum(1, keepdims=True), source)
    np.testing.assert_allclose(estimate.priors.numpy(), reference, rtol=0, atol=1e-10)


def test_warns_where_it_stops_at_the_iteration_cap():
    logits, source = (torch.from_numpy(x) for x in _gaussian_problem(50, 3000, 0.3, 0.1, 1))
    with pytest.warns(ConvergenceWarning, match=r"iteration cap \(max_iter=12\) after 10 EM and 2 Newton steps"):
        estimate = estimate_priors(logits, source, max_iter=12)
    assert not estimate.record.converged and estimate.record.iterations == 12
    assert "the mean log-likelihood is within" in estimate.record.message
    assert estimate.record.grad_max > 1e-6  # how far: the gradient's largest entry is that far above 1


def test_recovers_shifted_priors_within_their_standard_errors(cifar10):
    adapter, z_test, y_test = cifar10
    standardised = []
    for seed in range(12):
        z, _ = _shifted_sample(z_test, y_test, SHIFTED, 2000, seed=seed)
        estimate = adapter.adapt(z).estimate_
        assert estimate.record.converged
        standardised.append(((estimate.priors - SHIFTED) / estimate.stderr).numpy())
    standardised = np.array(standardised)
    # every class of every draw within 3.5 standard errors (largest of the 120: 3.18), and the errors
    # are as large as the standard errors say: root-mean-square z 0.98 (1.17 without calibration)
    assert np.abs(standardised).max() < 3.5
    assert 0.7 < np.sqrt(np.mean(standardised**2)) < 1.3


def test_adaptation_lowers_the_log_loss_under_shift_like_the_known_priors(cifar10):
    adapter, z_test, y_test = cifar10
    z, y = _shifted_sample(z_test, y_test, SHIFTED, 3000, seed=100)
    with torch.no_grad():
        calibrated = adapter.calibrator(z)
        estimated = adapter.adapt(z)(z)
        known = adapter.adapt(priors=SHIFTED)(z)
    torch.testing.assert_close(known, adapt_to_priors(calibrated, adapter.source_priors, SHIFTED))
    before, after, oracle = (cross_entropy(lp, y).item() for lp in (calibrated, estimated, known))
    # measured: 0.205 -> 0.173 (known priors 0.172); uncalibrated 0.351
    assert after < before - 0.02
    assert after == pytest.approx(oracle, abs=0.003)
    # the same comparison without resampling: the whole test set weighted to the shifted priors
    # (Ferrer & Ramos App. A, the scoring functions' priors=): measured 0.203 -> 0.167
    with torch.no_grad():
        calibrated = adapter.calibrator(z_test)
    weighted_before = cross_entropy(calibrated, y_test, priors=SHIFTED).item()
    weighted_after = cross_entropy(adapt_to_priors(calibrated, adapter.source_priors, SHIFTED), y_test, priors=SHIFTED).item()
    assert weighted_after < weighted_before - 0.02
    assert weighted_after == pytest.approx(oracle, abs=0.01)


@pytest.mark.parametrize("confidence", [0.9, 0.99])
def test_a_class_absent_from_the_target_ends_at_exactly_zero_also_when_em_alone_converges(confidence):
    """No target sample of class 1: the gradient at (1, 0) is (1 - p) / p < 1, so the maximum has
    the class at 0. At p = 0.99 the ten EM steps alone reached the maximum's likelihood and left
    the prior at 1.1e-20 (a review finding); p = 0.9 takes a Newton step, which projects it."""
    posteriors = torch.tensor([[confidence, 1 - confidence]] * 100, dtype=torch.float64)
    estimate = estimate_priors(posteriors.log(), torch.tensor([0.5, 0.5]))
    assert estimate.priors.tolist() == [1.0, 0.0]
    assert estimate.record.converged


def test_classes_estimated_at_zero_keep_a_finite_log_posterior():
    """The likelihood's maximum sets a class's prior to exactly 0 wherever the target scores are
    explained without it, also when a few of its samples are there: adapted to those priors, the
    posteriors gave such samples probability 0 and the log-loss was inf (now about exp(-708) and a
    log-loss in the hundreds: adapt_to_priors floors a prior of 0). With the default
    pseudocount (0.5 target samples per class) it falls below the calibrated one, as the known
    priors' does."""
    data = load_real("cifar100_resnet20_ferrer")
    z, y = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(y), generator=gen)
    source, target = perm[:5000], perm[5000:]
    priors = torch.from_numpy(np.random.default_rng(1).dirichlet(np.full(100, 0.5)))
    z_t, y_t = _shifted_sample(z[target], y[target], priors, 3000, seed=1)
    adapter = LabelShiftAdapter().fit(z[source], y[source])
    with torch.no_grad():
        calibrated = cross_entropy(adapter.calibrator(z_t), y_t).item()
        mle = adapter.adapt(z_t, pseudocount=0)(z_t)
        estimate = adapter.estimate_
        smoothed = adapter.adapt(z_t)(z_t)
    torch.testing.assert_close(adapter.estimate_.priors, estimate.priors)  # estimate_ stays the maximum
    n = len(y_t)
    torch.testing.assert_close(adapter.target_priors, (n * estimate.priors + 0.5) / (n + 50))
    with torch.no_grad():
        known = adapter.adapt(priors=class_frequencies(y_t, 100).clamp(min=1e-12))(z_t)
    at_zero = estimate.priors == 0
    present = torch.bincount(y_t, minlength=100) > 0
    assert bool((at_zero & present).any())  # the case: present classes estimated at 0
    assert float(mle.gather(1, y_t.unsqueeze(1)).min()) < -700  # samples given probability about 0
    assert bool(smoothed.isfinite().all())
    after, oracle = cross_entropy(smoothed, y_t).item(), cross_entropy(known, y_t).item()
    assert after < calibrated - 0.1 and oracle < after  # measured: 1.119 -> 0.871 (known priors 0.774); 16 at 0, 8 present
    with pytest.raises(ValueError, match="pseudocount"):
        adapter.adapt(z_t, pseudocount=-1.0)


def test_no_shift_estimates_the_source_priors(cifar10):
    adapter, z_test, y_test = cifar10
    estimate = adapter.adapt(z_test).estimate_
    frequencies = class_frequencies(y_test, K)
    assert bool(((estimate.priors - frequencies).abs() < 3 * estimate.stderr).all())


def test_standard_errors_are_infinite_where_the_data_leave_priors_unidentified():
    """Two classes whose posteriors are always equal: only their priors' sum is identified, so
    their standard errors are infinite (pinv's were finite, 0.0106), and the third class's equal
    to that of the merged two-class problem."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2000, 3, dtype=torch.float64, generator=gen)
    z[:, 1] = z[:, 0]
    estimate = estimate_priors(z, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert estimate.stderr[:2].isinf().all()
    merged = estimate_priors(torch.stack([z[:, 0] + np.log(2), z[:, 2]], 1), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(estimate.priors[2], merged.priors[1], rtol=0, atol=1e-9)
    torch.testing.assert_close(estimate.stderr[2], merged.stderr[1], rtol=1e-6, atol=0)
    full_rank = estimate_priors(torch.randn(2000, 3, dtype=torch.float64, generator=gen), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert full_rank.stderr.isfinite().all()


def test_a_flat_likelihood_converges_at_once_with_every_prior_unidentified():
    """Posteriors equal to non-uniform source priors (what BCTS gives a useless classifier): every
    prior vector is a maximum. Newton's regularised steps wandered along the flat likelihood, driven
    by round-off, for 190 steps to the cap (with a warning) and one finite standard error of 1.2e7."""
    source = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2], dtype=torch.float64)
    estimate = estimate_priors(source.log().expand(50, 5), source)
    assert estimate.record.converged and estimate.record.iterations == 10
    assert "within" in estimate.record.message and estimate.record.grad_max <= 1e-14
    torch.testing.assert_close(estimate.priors, source, rtol=0, atol=1e-15)
    assert estimate.stderr.isinf().all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_copy_of_a_class_at_zero_leaves_both_unidentified_in_either_precision(dtype):
    """Class 3's scores copy class 0's, so only the sum of their priors is identified. From float32
    scores the copies differ by round-off, the maximum put class 3 at 0 (its gradient 1 - 1e-9), and
    the standard errors claimed class 0 to 0.010 and class 3 NaN: 2N times the log-likelihood
    ratio moves by 1.3e-5 over the whole range of the split (a review's reproducer)."""
    rng = np.random.default_rng(0)
    means = np.array([[2.0, 0.0], [0.0, 2.0], [-1.5, -1.5], [2.0, 0.0]])
    source, target = np.array([0.1, 0.3, 0.4, 0.2]), np.array([0.3, 0.2, 0.2, 0.3])
    y = rng.choice(4, 3000, p=target)
    x = means[y] + rng.standard_normal((3000, 2))
    logits = -0.5 * ((x[:, None] - means[None]) ** 2).sum(-1) + np.log(source)  # exact posteriors for source
    merged_logits = np.column_stack([np.logaddexp(logits[:, 0], logits[:, 3]), logits[:, 1:3]])
    merged = estimate_priors(torch.from_numpy(merged_logits), torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64))
    for seed in (None, 1):
        z = torch.from_numpy(logits).to(dtype)
        if seed is not None:
            z = z[torch.randperm(3000, generator=torch.Generator().manual_seed(seed))]
        estimate = estimate_priors(z, torch.from_numpy(source))
        assert estimate.record.converged
        assert estimate.stderr[[0, 3]].isinf().all() and estimate.stderr[[1, 2]].isfinite().all()
        torch.testing.assert_close(estimate.priors[0] + estimate.priors[3], merged.priors[0], rtol=0, atol=1e-7)
        torch.testing.assert_close(estimate.stderr[[1, 2]], merged.stderr[[1, 2]], rtol=1e-4, atol=0)


def test_a_weakly_informed_split_leaves_the_other_standard_errors_finite():
    """Classes 2 and 3 nearly alike (means 0.04 apart), 0 and 1 well apart: a rule that took the
    weak direction for a null one put inf on every class (a review of this change). The other
    classes keep the inverse observed information's values; the two alike ones, whose standard
    errors (1.06) exceed the simplex's width, are unidentified."""
    rng = np.random.default_rng(4)
    means = np.array([[3.0, 0.0], [0.0, 3.0], [-2.0, -2.0], [-2.04, -2.0]])
    source = np.full(4, 0.25)
    y = rng.choice(4, 300, p=[0.3, 0.3, 0.2, 0.2])
    x = means[y] + rng.standard_normal((300, 2))
    logits = -0.5 * ((x[:, None] - means[None]) ** 2).sum(-1) + np.log(source)
    estimate = estimate_priors(torch.from_numpy(logits), torch.from_numpy(source))
    a = np.exp(logits - logits.max(1, keepdims=True))
    a = a / a.sum(1, keepdims=True) / source
    b = a / (a @ estimate.priors.numpy())[:, None]
    jacobian = np.vstack([np.eye(3), -np.ones((1, 3))])
    expected = np.sqrt(np.diag(jacobian @ np.linalg.inv(jacobian.T @ (b.T @ b) @ jacobian) @ jacobian.T))
    assert (expected[2:] > 1).all() and (expected[:2] < 0.03).all()
    np.testing.assert_allclose(estimate.stderr[:2].numpy(), expected[:2], rtol=1e-8)
    assert estimate.stderr[2:].isinf().all()


def test_adapt_to_priors_is_bayes_rule():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, 4, generator=gen, dtype=torch.float64), 1)
    source = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    target = torch.tensor([0.4, 0.0, 0.5, 0.1], dtype=torch.float64)
    expected = probs.numpy() * (target / source).numpy()
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(adapt_to_priors(probs.log(), source, target).exp().numpy(), expected, rtol=0, atol=1e-15)
    assert adapt_to_priors(probs.float().log(), source, target).dtype == torch.float32


def test_estimate_is_the_same_in_float32_and_float64_and_for_permuted_rows(cifar10):
    adapter, z_test, y_test = cifar10
    z, _ = _shifted_sample(z_test, y_test, SHIFTED, 1000, seed=3)
    with torch.no_grad():
        calibrated = adapter.calibrator(z.double())
    source = adapter.source_priors
    reference = estimate_priors(calibrated, source, tol=1e-12).priors
    torch.testing.assert_close(estimate_priors(calibrated.float(), source, tol=1e-12).priors, reference, rtol=0, atol=1e-6)
    permuted = calibrated[torch.randperm(1000, generator=torch.Generator().manual_seed(4))]
    torch.testing.assert_close(estimate_priors(permuted, source, tol=1e-12).priors, reference, rtol=0, atol=1e-12)
    # the whole path from float32 raw logits: calibrator, then EM
    z_val, y_val = _validation_split()
    from32 = LabelShiftAdapter().fit(z_val.float(), y_val).adapt(z.float(), tol=1e-12).target_priors
    from64 = LabelShiftAdapter().fit(z_val.double(), y_val).adapt(z.double(), tol=1e-12).target_priors
    torch.testing.assert_close(from32, from64, rtol=0, atol=1e-6)
    # a calibrator's output straight from a graph: no graph through the EM steps
    with_graph = adapter.calibrator(z.double())
    assert with_graph.requires_grad
    estimate = estimate_priors(with_graph, source, tol=1e-12)
    assert not estimate.priors.requires_grad
    torch.testing.assert_close(estimate.priors, reference, rtol=0, atol=1e-12)


def test_adapter_with_known_source_priors_state_dict_and_export(cifar10):
    _, z_test, y_test = cifar10
    z, y = z_test[:3000], y_test[:3000]
    source = torch.full((K,), 1 / K, dtype=torch.float64)
    adapter = LabelShiftAdapter(AffineCalibration()).fit(z, y, priors=source)
    torch.testing.assert_close(adapter.source_priors, source)
    with torch.no_grad():
        torch.testing.assert_close(adapter(z), adapter.calibrator(z))  # target = source: no change
        adapter.adapt(z_test[3000:5000])
        fresh = LabelShiftAdapter(AffineCalibration())
        fresh.load_state_dict(adapter.state_dict())
        torch.testing.assert_close(fresh(z[:50]), adapter(z[:50]), rtol=0, atol=0)
        exported = torch.export.export(adapter, (z[:16],)).module()
        torch.testing.assert_close(exported(z[:16]), adapter(z[:16]), rtol=0, atol=0)


def _em_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    labels = torch.multinomial(torch.tensor([0.6, 0.3, 0.1, 0.0]), 1500, replacement=True, generator=gen)
    return torch.randn(1500, 4, generator=gen) + 2 * torch.eye(4)[labels], torch.full((4,), 1 / 4)  # class 3 at 0


def _em_worker(rank: int, out: str) -> None:
    logits, source = _em_data()
    shard = slice(0, 1000) if rank == 0 else slice(1000, None)  # uneven shards
    estimate = estimate_priors(logits[shard], source, process_group=dist.group.WORLD)
    torch.save((estimate.priors, estimate.stderr, estimate.record), Path(out) / f"rank{rank}.pt")


def test_two_processes_estimate_the_priors_of_the_union(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    spawn_gloo(_em_worker, 2, str(tmp_path))
    single = estimate_priors(*_em_data())
    for rank in range(2):
        priors, stderr, record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(priors, single.priors, rtol=0, atol=1e-12)
        torch.testing.assert_close(stderr, single.stderr, rtol=1e-9, atol=0, equal_nan=True)
        assert record.iterations == single.record.iterations and record.evaluations == single.record.evaluations
        assert priors[3] == 0 and stderr[:3].isfinite().all()
        assert record.loss == pytest.approx(single.record.loss, rel=1e-12)


def _adapter_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def sample(priors, n):
        labels = torch.multinomial(torch.tensor(priors), n, replacement=True, generator=gen)
        return torch.randn(n, 3, generator=gen) + 2.5 * torch.eye(3)[labels], labels

    source_logits, source_labels = sample([0.6, 0.3, 0.1], 3000)
    return source_logits, source_labels, sample([0.1, 0.2, 0.7], 3000)[0]


def _adapter_worker(rank: int, out: str) -> None:
    logits, labels, target = _adapter_data()
    group = dist.group.WORLD
    for layout in ("uneven", "sorted"):
        order = labels.argsort(stable=True) if layout == "sorted" else torch.arange(3000)
        mine = order[:1800] if rank == 0 else order[1800:]  # sorted: rank 1 has no sample of class 0
        adapter = LabelShiftAdapter().fit(logits[mine], labels[mine], process_group=group)
        adapter.adapt(target[:1000] if rank == 0 else target[1000:], process_group=group)
        torch.save(adapter.state_dict(), Path(out) / f"{layout}{rank}.pt")
    # a class absent from every shard is refused by every process (none waits for another)
    try:
        LabelShiftAdapter().fit(logits[:100], labels[:100] % 2, process_group=group)
    except ValueError as err:
        Path(out, f"refused{rank}").write_text(str(err))


def _assert_states_close(state: dict, expected: dict, **tolerances) -> None:
    """Tensors to the tolerances, everything else (the extra states' names and options) equal."""
    assert state.keys() == expected.keys()
    for key, value in state.items():
        if isinstance(value, dict):
            _assert_states_close(value, expected[key], **tolerances)
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, expected[key], **tolerances)
        else:
            assert value == expected[key], key


def test_two_processes_fit_the_adapter_of_the_union(tmp_path):
    """Every process gets the source priors of all the shards (and so the target priors of all
    the target shards), also with uneven shards and with a shard that lacks a class."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    spawn_gloo(_adapter_worker, 2, str(tmp_path))
    logits, labels, target = _adapter_data()
    single = LabelShiftAdapter().fit(logits, labels).adapt(target).state_dict()
    for layout in ("uneven", "sorted"):
        for rank in range(2):
            state = torch.load(tmp_path / f"{layout}{rank}.pt", weights_only=True)
            torch.testing.assert_close(state["source_priors"], class_frequencies(labels, 3), rtol=0, atol=1e-15)
            _assert_states_close(state, single, rtol=1e-6, atol=1e-7)
    assert all("must be positive" in (tmp_path / f"refused{rank}").read_text() for rank in range(2))


def test_a_fit_that_refuses_leaves_the_adapter_as_it_was():
    """The source priors are checked before the calibrator is refitted: a refitted calibrator with
    the old priors would mix two fits."""
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(60, 3, generator=gen), torch.arange(60) % 3
    adapter = LabelShiftAdapter().fit(logits, labels).adapt(logits)
    before, estimate = copy.deepcopy(adapter.state_dict()), adapter.estimate_
    with pytest.raises(ValueError, match="must be positive"):
        adapter.fit(2 * logits, labels % 2)  # no sample of class 2
    with pytest.raises(ValueError, match="must be positive"):
        adapter.fit(2 * logits, labels, priors=torch.tensor([0.5, 0.5, 0.0]))
    _assert_states_close(adapter.state_dict(), before, rtol=0, atol=0)
    assert adapter.estimate_ is estimate


def test_bad_input():
    logits = torch.randn(20, 3)
    labels = torch.arange(20) % 3
    with pytest.raises(ValueError, match="positive"):
        estimate_priors(logits, torch.tensor([0.5, 0.5, 0.0]))
    with pytest.raises(ValueError, match="sum to one"):
        adapt_to_priors(logits, torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.2, 0.3, 0.5]))
    with pytest.raises(ValueError, match="shape"):
        estimate_priors(logits, torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="max_iter"):
        estimate_priors(logits, torch.full((3,), 1 / 3), max_iter=0)
    with pytest.raises(RuntimeError, match="not fitted"):
        LabelShiftAdapter().adapt(logits)
    adapter = LabelShiftAdapter(IsotonicCalibration()).fit(logits, labels)
    with pytest.raises(ValueError, match="exactly one of"):
        adapter.adapt(logits, priors=torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="exactly one of"):
        adapter.adapt()
    with pytest.raises(ValueError, match="the class frequencies of labels must be positive, but class 2 has 0"):
        adapter.fit(logits, labels % 2)
    with pytest.raises(ValueError, match=r"^priors must be positive, but classes \[1, 2\] have 0"):
        adapter.fit(logits, labels, priors=torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(TypeError, match="calibrator"):
        LabelShiftAdapter(torch.nn.Identity())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_estimates_and_adapts_on_the_logits_device(cifar10):
    _, z_test, y_test = cifar10
    z, y = z_test[:3000], y_test[:3000]
    cpu = LabelShiftAdapter().fit(z, y).adapt(z_test[5000:7000])
    gpu = LabelShiftAdapter().fit(z.cuda(), y.cuda()).adapt(z_test[5000:7000].cuda())
    assert gpu.target_priors.device.type == "cuda" and gpu.estimate_.stderr.device.type == "cuda"
    torch.testing.assert_close(gpu.target_priors.cpu(), cpu.target_priors, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(gpu(z_test[:100].cuda()).cpu(), cpu(z_test[:100]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_target_prior_of_zero_keeps_the_log_posteriors_finite(dtype):
    """Bayes' rule to a prior of 0 gave its class log(0) = -inf, which every metric of torchcal
    refuses ("Scores must be finite"), also where no sample is of that class."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    labels = torch.randint(1, 3, (50,), generator=gen)
    target = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    out = adapt_to_priors(logits.to(dtype), torch.full((3,), 1 / 3, dtype=torch.float64), target)
    assert bool(torch.isfinite(out).all()) and float(out[:, 0].max()) < -700
    bayes = torch.softmax(logits[:, 1:], 1)  # (equal source priors: the other classes renormalised)
    torch.testing.assert_close(out[:, 1:].exp().double(), bayes, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-7)
    assert np.isfinite(float(cross_entropy(out, labels, priors=target)))


def test_priors_are_refused_for_a_calibrator_without_a_class_bias():
    """Temperature scaling fitted with priors P cannot move its posteriors to P, yet the adapter
    recorded P as their priors: on the CIFAR-10 ResNet-110 logits adapted to P reversed, a test
    log-loss of 0.1605 against 0.1288 without priors (BCTS: 0.1302)."""
    from torchcal import TemperatureScaling

    logits, labels = _validation_split()
    priors = torch.linspace(10, 1, 10, dtype=torch.float64)
    priors /= priors.sum()
    for calibrator in (TemperatureScaling(), AffineCalibration(bias=False)):
        with pytest.raises(ValueError, match="has no per-class bias.*AffineCalibration"):
            LabelShiftAdapter(calibrator).fit(logits, labels, priors=priors)
        LabelShiftAdapter(calibrator).fit(logits, labels)  # without priors: the class frequencies
    adapter = LabelShiftAdapter().fit(logits, labels, priors=priors)
    torch.testing.assert_close(adapter.source_priors, priors)


def test_a_calibrator_not_calibrated_to_the_class_frequencies_is_named(capsys, tmp_path):
    """Without priors the source priors are the class frequencies, which a calibrator without a
    per-class bias need not match: temperature scaling on the FVCAUS speaker-verification scores
    (1.8 % targets) averages 11.6 %, and on a target drawn from the source itself (no shift) the
    estimate was 36 % targets, 29 standard errors off, without a word (a label-shift review). The
    adapter and `calibrate --target` now warn, naming the class; BCTS (the default) is silent and
    recovers the frequencies."""
    import warnings

    from torchcal import TemperatureScaling
    from torchcal.cli import main

    data = load_real("fvcaus_xvector-plda_ferrer")
    logits, labels = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    order = torch.from_numpy(np.random.default_rng(7).permutation(len(labels)))
    source, target = order[:10000], order[10000:13000]
    with pytest.warns(UserWarning, match=r"TemperatureScaling's posteriors on its calibration data average 0.88\d+ for class 0 "
                                         r"against its frequency 0.98\d+ \(\d+.\d standard errors\).*not calibrated"):
        LabelShiftAdapter(TemperatureScaling()).fit(logits[source], labels[source])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter = LabelShiftAdapter().fit(logits[source], labels[source]).adapt(logits[target])
    truth = class_frequencies(labels[target], 2)
    assert torch.all((adapter.estimate_.priors - truth).abs() < 3 * adapter.estimate_.stderr)
    with warnings.catch_warnings():  # calibrated on balanced CIFAR-10 data, temperature scaling is not named
        warnings.simplefilter("error")
        LabelShiftAdapter(TemperatureScaling()).fit(*_validation_split())

    np.savez(tmp_path / "cal.npz", logits=data["logits"][source.numpy()], labels=data["labels"][source.numpy()])
    np.save(tmp_path / "target.npy", data["logits"][target.numpy()])
    assert main(["calibrate", str(tmp_path / "cal.npz"), "--method", "temperature", "--target", str(tmp_path / "target.npy")]) == 0
    assert "not calibrated to the class frequencies" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path / "cal.npz"), "--method", "affine", "--target", str(tmp_path / "target.npy")]) == 0
    assert "not calibrated" not in capsys.readouterr().err


def test_a_target_prior_of_zero_leaves_its_class_at_the_floor_whatever_its_logit():
    """A class of target prior 0 gets the log-posterior log(tiny), about -708, however far its logit
    lies above the others' (a label-shift review: a gap of 720 left it at probability 1, a gap of
    700 at 2.3e-4; exact Bayes gives 0); the other classes are renormalised among themselves."""
    floor = float(torch.finfo(torch.float64).tiny)
    for dtype in (torch.float64, torch.float32):
        for gap in (0.0, 100.0, 700.0, 720.0, 800.0, 1e30):
            logits = torch.tensor([[0.0, gap, -1.0]], dtype=dtype)
            adapted = adapt_to_priors(logits, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), torch.tensor([0.6, 0.0, 0.4], dtype=torch.float64))
            assert adapted.dtype == dtype and float(adapted[0, 1]) == pytest.approx(math.log(floor), rel=1e-6)
            expected = torch.log_softmax(torch.tensor([math.log(0.6 / 0.5), -1 + math.log(0.4 / 0.25)], dtype=torch.float64), 0)
            torch.testing.assert_close(adapted[0, [0, 2]].double(), expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-15)


def test_smoothed_priors_in_half_precision_and_from_no_sample():
    """float16 priors overflowed (N pi = inf at N = 100,000), bfloat16 ones summed to 0.994, and
    no sample with no pseudocount gave NaN."""
    from torchcal.label_shift import smoothed_priors

    expected = (100_000 * torch.tensor([0.9, 0.1], dtype=torch.float64) + 0.5) / (100_000 + 1.0)
    for dtype in (torch.float16, torch.bfloat16):
        got = smoothed_priors(torch.tensor([0.9, 0.1], dtype=dtype), 100_000)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-3)
        assert abs(float(got.double().sum()) - 1) < 1e-6
    torch.testing.assert_close(smoothed_priors(torch.tensor([0.9, 0.1], dtype=torch.float64), 0, 0.0),
                               torch.tensor([0.9, 0.1], dtype=torch.float64))


def test_a_class_without_source_samples_is_told_how_to_get_out():
    """The messages sent a user in a loop: "give it a small prior", then "give them prior 0 or add samples"."""
    logits, labels = torch.randn(300, 3), torch.arange(300) % 2
    with pytest.raises(ValueError, match="drop it from the scores or add samples of it"):
        LabelShiftAdapter().fit(logits, labels)
