"""Venn-Abers predictors: the tables against their definition (two isotonic regressions per test
object, by torchcal's PAV), and the calibrator against the venn-abers package on real logits."""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import load_real
from torch import nn

from torchcal import CalibratedModel, TemperatureScaling, VennAbersCalibration
from torchcal.calibrators.venn_abers import venn_abers_table
from torchcal.functional.isotonic import pool_adjacent_violators
from torchcal.functional.scoring import cross_entropy
from torchcal.heads import CHECKPOINT_KEY, head_checkpoint
from torchcal.label_shift import adapt_to_priors

venn_abers = pytest.importorskip("venn_abers.venn_abers")


def _isotonic_at(x: np.ndarray, y: np.ndarray, s: float, label: float) -> float:
    """Isotonic fit at a test object with score ``s`` and ``label``, added to ``(x, y)``."""
    xs, ys = np.r_[x, s], np.r_[y, label]
    boundaries, values = pool_adjacent_violators(xs, ys, np.ones_like(xs))
    return float(values[np.searchsorted(boundaries, s, side="right") - 1])


def test_tables_are_two_isotonic_regressions_per_test_object():
    rs = np.random.RandomState(0)
    for _ in range(150):
        n = rs.randint(0, 30)
        x = rs.randint(0, rs.randint(1, 15), n).astype(np.float64)  # many ties
        y = (rs.rand(n) < rs.rand()).astype(np.float64)
        grid, p0, p1 = venn_abers_table(torch.from_numpy(x), torch.from_numpy(y))
        # test scores: every calibration score, every gap, and beyond both ends
        for s in np.r_[np.unique(x), np.arange(-1.5, 16, 1.0)]:
            lower = p0[torch.searchsorted(grid, torch.tensor(s, dtype=torch.float64), right=True)]
            upper = p1[torch.searchsorted(grid, torch.tensor(s, dtype=torch.float64), right=False)]
            assert lower.item() == pytest.approx(_isotonic_at(x, y, s, 0.0), abs=1e-12)
            assert upper.item() == pytest.approx(_isotonic_at(x, y, s, 1.0), abs=1e-12)


def _split(name: str, n: int | None = None, seed: int = 0):
    data = load_real(name)
    idx = np.random.RandomState(seed).permutation(len(data["labels"]))[:n]
    z, y = torch.from_numpy(data["logits"][idx].astype(np.float64)), torch.from_numpy(data["labels"][idx])
    half = len(y) // 2
    return z[:half], y[:half], z[half:], y[half:]


@pytest.mark.parametrize(
    "name, n",
    [("sst2_gpt2-0shot_ferrer", None), ("sst2_gpt2-4shot_ferrer", None), ("adrenalmnist3d_resnet50_ferrer", None),
     ("fvcaus_xvector-plda_ferrer", 6000)],
)
def test_binary_ivap_matches_venn_abers_package(name, n):
    z_cal, y_cal, z_test, y_test = _split(name, n)
    reference = venn_abers.VennAbers().fit(torch.softmax(z_cal, 1).numpy(), y_cal.numpy())
    p_ref, interval_ref = reference.predict_proba(torch.softmax(z_test, 1).numpy())
    va = VennAbersCalibration().fit(z_cal, y_cal)
    p0, p1 = va.predict_interval(z_test)
    np.testing.assert_allclose(p0[:, 0, 0].numpy(), interval_ref[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(p1[:, 0, 0].numpy(), interval_ref[:, 1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(va.predict_proba(z_test).numpy(), p_ref, rtol=0, atol=1e-12)
    # the Brier merge, p1 + (p0^2 - p1^2) / 2 (the package's formula in VennAbersCV)
    brier = VennAbersCalibration().fit(z_cal, y_cal, loss="brier").predict_proba(z_test)[:, 1].numpy()
    lo, hi = interval_ref[:, 0], interval_ref[:, 1]
    np.testing.assert_allclose(brier, hi + 0.5 * lo**2 - 0.5 * hi**2, rtol=0, atol=1e-12)


def _assert_cross_vap_merges_the_fold_ivaps(z_cal, y_cal, z_test, folds):
    """The CVAP against the venn_abers package's IVAP on each fold of the documented split (in
    order of (label, score), dealt to the folds in turn), merged by geometric means."""
    llr_cal, llr_test = (z_cal[:, 1] - z_cal[:, 0]).numpy(), (z_test[:, 1] - z_test[:, 0]).numpy()
    y = y_cal.numpy()
    fold = np.empty(len(y), dtype=int)
    fold[np.lexsort((llr_cal, y))] = np.arange(len(y)) % folds
    assert set(fold.tolist()) == set(range(folds))
    intervals = []
    for f in range(folds):
        p_cal = np.c_[np.zeros(np.sum(fold == f)), llr_cal[fold == f]]  # any increasing score works
        ivap = venn_abers.VennAbers().fit(p_cal, y[fold == f])
        intervals.append(ivap.predict_proba(np.c_[np.zeros(len(llr_test)), llr_test])[1])
    p0 = np.stack([i[:, 0] for i in intervals], 1)
    p1 = np.stack([i[:, 1] for i in intervals], 1)
    expected = venn_abers.geo_mean(p1) / (venn_abers.geo_mean(1 - p0) + venn_abers.geo_mean(p1))
    cvap = VennAbersCalibration(folds=folds).fit(z_cal, y_cal)
    np.testing.assert_allclose(cvap.predict_proba(z_test)[:, 1].numpy(), expected, rtol=0, atol=1e-12)
    lower, upper = cvap.predict_interval(z_test)
    np.testing.assert_allclose(lower[:, 0].numpy(), p0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper[:, 0].numpy(), p1, rtol=0, atol=1e-12)


def test_cross_vap_merges_fold_ivaps_by_geometric_means():
    z_cal, y_cal, z_test, _ = _split("sst2_gpt2-0shot_ferrer")
    _assert_cross_vap_merges_the_fold_ivaps(z_cal, y_cal, z_test, folds=4)


def test_cross_vap_leaves_no_fold_empty():
    """Four samples of each label in five folds: each label dealt from fold 0 left fold 4 empty, whose
    uninformative interval (0, 1) entered the merge (P(1) 0.3648 for the first row, 0.3333 from
    the four filled folds)."""
    s = torch.tensor([-3.0, -2.0, -1.0, 0.5, -0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    z = torch.stack([torch.zeros_like(s), s], 1)
    _assert_cross_vap_merges_the_fold_ivaps(z, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), z, folds=5)


@pytest.fixture(scope="module")
def cifar10():
    data = load_real("cifar10_resnet110_kangsepp")
    return tuple(torch.from_numpy(data[k]) for k in ("logits_val", "labels_val", "logits", "labels"))


@pytest.mark.parametrize("multiclass, package_type", [("ovr", "one_vs_rest"), ("pairwise", "one_vs_one")])
def test_multiclass_matches_venn_abers_package_on_cifar10(cifar10, multiclass, package_type):
    z_val, y_val, z_test, y_test = cifar10
    p_val, p_test = torch.softmax(z_val.double(), 1).numpy(), torch.softmax(z_test.double(), 1).numpy()
    expected, _ = venn_abers.predict_proba_prefitted_va(p_val, y_val.numpy(), p_test, va_tpe=package_type)
    va = VennAbersCalibration(multiclass=multiclass).fit(z_val, y_val)
    got = va.predict_proba(z_test.double()).numpy()
    # The package scores a pair by p_j / (p_i + p_j) from the softmax: near 1 that keeps few digits,
    # so for rows whose logits spread over more than ~25 nats, distinct pairwise scores tie there
    # (we use z_j - z_i). Every other row agrees to round-off.
    rows = np.ones(len(y_test), dtype=bool)
    if multiclass == "pairwise":
        rows = (z_test.amax(1) - z_test.amin(1) < 24).numpy()
        assert rows.mean() > 0.5
    np.testing.assert_allclose(got[rows], expected[rows], rtol=0, atol=1e-9)
    # test log-loss: 0.3583 uncalibrated, 0.2093 temperature scaling (SOURCES.md); ours 0.2120 / 0.2444
    log_loss = cross_entropy(va(z_test), y_test).item()
    assert log_loss == pytest.approx(-np.log(expected[np.arange(len(y_test)), y_test.numpy()]).mean(), abs=1e-5)
    temperature = cross_entropy(TemperatureScaling().fit(z_val, y_val)(z_test).detach(), y_test).item()
    assert temperature < log_loss < 0.25 if multiclass == "pairwise" else temperature < log_loss < temperature + 0.005


@pytest.fixture(scope="module")
def toy():
    gen = torch.Generator().manual_seed(1)
    logits = 2.5 * torch.randn(600, 3, generator=gen, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 2).sample()
    return logits, labels


@pytest.mark.parametrize("options", [{}, {"folds": 3}, {"multiclass": "pairwise"}, {"folds": 2, "multiclass": "pairwise"}])
def test_contract(toy, options):
    logits, labels = toy
    va = VennAbersCalibration(**options).fit(logits[:400], labels[:400], loss="brier")
    out = va(logits[400:])
    torch.testing.assert_close(out.logsumexp(1), torch.zeros(200, dtype=torch.float64), rtol=0, atol=1e-12)
    # state_dict round trip into a fresh instance with the default options: the merge rule,
    # the folds and the multiclass scheme travel with the tables
    fresh = VennAbersCalibration()
    fresh.load_state_dict(va.state_dict())
    assert (fresh.folds, fresh.multiclass, fresh.loss) == (va.folds, va.multiclass, "brier")
    torch.testing.assert_close(fresh(logits[400:]), out, rtol=0, atol=0)
    # float32 input: the same map (scores are formed in float64), float32 output
    out32 = va(logits[400:].float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, out.float(), rtol=1e-6, atol=1e-6)
    # permuted calibration rows give the same tables, hence the same output
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(2))
    permuted = VennAbersCalibration(**options).fit(logits[:400][perm], labels[:400][perm], loss="brier")
    torch.testing.assert_close(permuted(logits[400:]), out, rtol=0, atol=1e-12)
    lower, upper = va.predict_interval(logits[400:])
    assert bool((lower <= upper).all()) and bool((lower >= 0).all()) and bool((upper <= 1).all())


@pytest.mark.parametrize("multiclass", ["ovr", "pairwise"])
def test_a_calibration_sample_gets_the_same_output_after_a_last_bit_change_of_its_score(toy, multiclass, tmp_path):
    """At a calibration score the tables step; with exact ties, a score one ulp away (another
    runtime's log-softmax: ONNX Runtime moved 64 of 2,000 AG News calibration rows) got the
    neighbouring step. Ties within 1e-12 pool, here and in an ONNX export."""
    logits, labels = toy
    x = logits[:400].float()  # what an exported head receives
    va = VennAbersCalibration(multiclass=multiclass).fit(x, labels[:400]).eval()
    scores = va._features(x)
    for direction in (-torch.inf, torch.inf):
        nudged = torch.nextafter(scores, torch.full_like(scores, direction))
        for exact, moved in zip(va._intervals(scores), va._intervals(nudged)):
            assert torch.equal(exact, moved)
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "va.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(va, (x[:8],), path, dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    session = ort.InferenceSession(str(path))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), va(x), rtol=0, atol=1e-6)


def test_deployment_priors_are_bayes_rule_from_the_class_frequencies(toy):
    logits, labels = toy
    priors = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    plain = VennAbersCalibration().fit(logits, labels)
    weighted = VennAbersCalibration().fit(logits, labels, priors=priors)
    frequencies = torch.bincount(labels, minlength=3).double() / len(labels)
    torch.testing.assert_close(weighted(logits), adapt_to_priors(plain(logits), frequencies, priors), rtol=0, atol=1e-12)
    torch.testing.assert_close(weighted.predict_interval(logits), plain.predict_interval(logits), rtol=0, atol=0)
    fresh = VennAbersCalibration()
    fresh.load_state_dict(weighted.state_dict())
    torch.testing.assert_close(fresh(logits), weighted(logits), rtol=0, atol=0)
    # a prior of 0 leaves its class at exp(-708), a finite log-posterior (log(0) = -inf was refused
    # by every metric, and by the command line with a message blaming the user's logits)
    absent = torch.tensor([0.0, 0.4, 0.6], dtype=torch.float64)
    out = VennAbersCalibration().fit(logits, labels, priors=absent)(logits)
    assert bool(torch.isfinite(out).all()) and float(out[:, 0].max()) < -700
    torch.testing.assert_close(out[:, 1:].exp(), adapt_to_priors(plain(logits), frequencies, absent)[:, 1:].exp(), rtol=0, atol=1e-12)
    assert math.isfinite(float(cross_entropy(out, labels, priors=absent)))


def test_binary_head(toy):
    logits, labels = toy
    binary = (labels == 2).long()
    net = nn.Linear(3, 2, dtype=torch.float64)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 1.0]]))
        net.bias.zero_()
    head = CalibratedModel(net, VennAbersCalibration()).fit([(logits, binary)])
    with torch.no_grad():
        direct = VennAbersCalibration().fit(net(logits), binary)(net(logits))
        torch.testing.assert_close(head(logits), direct, rtol=0, atol=0)
        exported = torch.export.export(head, (logits[:16],)).module()
        torch.testing.assert_close(exported(logits[:16]), direct[:16], rtol=0, atol=0)


@pytest.mark.parametrize("num_classes", [3, 4])
def test_head_checkpoint_restores_the_options(num_classes, tmp_path):
    """``from_checkpoint`` builds the stored class with its defaults: the pairwise 3-fold head
    must come back as itself. At K = 3 its tables have the one-vs-rest shapes; at K = 4 (6 pairs)
    the defaults' shapes refused the state as "inconsistent" before its options were read."""
    gen = torch.Generator().manual_seed(1)
    logits = 2.5 * torch.randn(800, num_classes, generator=gen, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits / 2).sample()
    fresh = VennAbersCalibration()
    fresh.load_state_dict(VennAbersCalibration(multiclass="pairwise").fit(logits, labels).state_dict())
    assert fresh.multiclass == "pairwise" and fresh.grid.shape[0] == num_classes * (num_classes - 1) // 2
    head = CalibratedModel(nn.Identity(), VennAbersCalibration(folds=3, multiclass="pairwise")).fit([(logits, labels)])
    torch.save({"state_dict": {}, CHECKPOINT_KEY: head_checkpoint(head.calibrator)}, tmp_path / "head.ckpt")
    loaded = CalibratedModel.from_checkpoint(tmp_path / "head.ckpt", nn.Identity(), load_weights=False)
    assert (loaded.calibrator.folds, loaded.calibrator.multiclass) == (3, "pairwise")
    with torch.no_grad():
        torch.testing.assert_close(loaded(logits), head(logits), rtol=0, atol=0)


def test_table_input_is_checked():
    scores = torch.tensor([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="binary labels"):
        venn_abers_table(scores, torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="binary labels"):
        venn_abers_table(scores, torch.tensor([0.3, 0.9, 0.5]))  # not truncated to 0
    with pytest.raises(ValueError, match="finite"):
        venn_abers_table(torch.tensor([0.0, float("nan"), 2.0]), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="same length"):
        venn_abers_table(scores, torch.tensor([0, 1]))
    grid, _, p1 = venn_abers_table(scores, torch.tensor([True, False, True]))
    assert grid.tolist() == [0.0, 1.0, 2.0] and bool((p1 <= 1).all())


def test_bad_input(toy):
    logits, labels = toy
    with pytest.raises(ValueError, match="folds"):
        VennAbersCalibration(folds=0)
    with pytest.raises(ValueError, match="multiclass"):
        VennAbersCalibration(multiclass="ovo")
    with pytest.raises(NotImplementedError, match="process_group"):
        VennAbersCalibration().fit(logits, labels, process_group=object())
    with pytest.raises(ValueError, match="fewer folds"):
        VennAbersCalibration(folds=5).fit(logits[:3], labels[:3])
    with pytest.raises(ValueError, match=r"3 calibration samples for class 0 against the rest cannot fill 5 folds"):
        VennAbersCalibration(folds=5, multiclass="ovr").fit(logits[:3], labels[:3])  # (it said "classes (-1, 0)")
    with pytest.raises(RuntimeError, match="not fitted"):
        VennAbersCalibration().predict_interval(logits)
    # K = 1,000 pairwise asked for 40 GB at once (499,500 problems); refused before any allocation
    wide = torch.randn(300, 1000, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="499,500 binary problems.*use multiclass='ovr'"):
        VennAbersCalibration(multiclass="pairwise").fit(wide, torch.arange(300) % 1000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fits_and_predicts_on_the_logits_device(toy):
    logits, labels = toy
    cpu = VennAbersCalibration(folds=2).fit(logits, labels)
    gpu = VennAbersCalibration(folds=2).fit(logits.cuda(), labels.cuda())
    assert {t.device.type for t in gpu.buffers()} == {"cuda"}
    out = gpu(logits.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), cpu(logits), rtol=0, atol=1e-12)
    torch.testing.assert_close(tuple(t.cpu() for t in gpu.predict_interval(logits.cuda())), cpu.predict_interval(logits))


def test_scores_closer_than_the_tie_tolerance_are_one_group():
    """Calibration scores 4 ulp apart, each within the look-up's tolerance of a test score between
    them: p0 was read beside one and p1 beside the other, giving p0 = 0.5 > p1 = 0.25. As one tied
    group they give sklearn's isotonic answer (which merges x within 1e-15): p0 = 0.2, p1 = 0.4."""
    a = 1.0
    b = float(np.nextafter(np.nextafter(np.nextafter(np.nextafter(a, 2), 2), 2), 2))
    mid = float(np.nextafter(np.nextafter(a, 2), 2))
    logits = torch.tensor([[0.0, a], [0.0, a], [0.0, a], [0.0, b]], dtype=torch.float64)
    va = VennAbersCalibration().fit(logits, torch.tensor([0, 0, 0, 1]))
    p0, p1 = va.predict_interval(torch.tensor([[0.0, a], [0.0, mid], [0.0, b]], dtype=torch.float64))
    torch.testing.assert_close(p0.flatten(), torch.full((3,), 0.2, dtype=torch.float64))
    torch.testing.assert_close(p1.flatten(), torch.full((3,), 0.4, dtype=torch.float64))


def test_scores_equal_up_to_round_off_are_one_group():
    """Log-probabilities of one class-0 probability from rows whose other columns differ (0.95 and
    up: log-probabilities near 0, which the relative tolerance did not reach), and log-odds of rows
    of logits offset by 30 randn, came out several ways, which the tables took apart: intervals up
    to 0.057 from the venn_abers package's on the exact probabilities (a review's reproducers)."""
    rs = np.random.default_rng(1)
    levels = np.array([0.5, 0.7, 0.9, 0.95, 0.99, 0.998])
    n = 400
    q = levels[rs.integers(len(levels), size=n)]
    share = rs.choice([0.25, 0.5, 0.75], size=n)
    p = np.stack([q, (1 - q) * share, (1 - q) * (1 - share)], 1)
    y = np.where(rs.random(n) < 0.8 * q, 0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (class 2 has no sample)
        logits = torch.from_numpy(np.log(p))
        lower, upper = VennAbersCalibration().fit(logits, torch.from_numpy(y)).predict_interval(logits)
        binary = np.stack([1 - q, q], 1)
        p0, p1, c = venn_abers.calc_p0p1(binary, (y == 0).astype(float))
        _, reference = venn_abers.calc_probs(p0, p1, c, binary)
    np.testing.assert_allclose(lower[:, 0, 0].numpy(), reference[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper[:, 0, 0].numpy(), reference[:, 1], rtol=0, atol=1e-12)

    rs = np.random.default_rng(0)
    n = 2000
    llr = rs.integers(-5, 6, size=n) * 0.1
    y = (rs.random(n) < 1 / (1 + np.exp(-llr))).astype(int)
    logits = torch.from_numpy(np.stack([np.zeros(n), llr], 1) + 30 * rs.normal(size=(n, 1)))
    binary = np.stack([1 / (1 + np.exp(llr)), 1 / (1 + np.exp(-llr))], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the package's all-NaN slices)
        p0, p1, c = venn_abers.calc_p0p1(binary, y.astype(float))
        _, reference = venn_abers.calc_probs(p0, p1, c, binary)
    lower, upper = VennAbersCalibration().fit(logits, torch.from_numpy(y)).predict_interval(logits)
    np.testing.assert_allclose(lower[:, 0, 0].numpy(), reference[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper[:, 0, 0].numpy(), reference[:, 1], rtol=0, atol=1e-12)


def test_a_test_score_near_0_within_the_tolerance_of_a_calibration_score_pools_with_it():
    """The look-up's tolerance was relative to the calibration score: 16 ulps of a log-odds of
    -0.002 is 7e-18, so the same score with the round-off of terms of order 1 (10 ulps of 1) read
    the neighbouring place. Now the tolerance has a floor of 16 ulps of 1, on both sides."""
    eps = float(np.finfo(np.float64).eps)
    scores = np.array([-1.0, -0.002, -0.002, -0.002, 0.5, 1.0])
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    va = VennAbersCalibration().fit(torch.from_numpy(np.stack([np.zeros(6), scores], 1)), labels)
    for shift in (-10 * eps, 10 * eps):
        at, moved = (va.predict_interval(torch.tensor([[0.0, -0.002 + s]], dtype=torch.float64)) for s in (0.0, shift))
        for exact, nudged in zip(at, moved):
            assert torch.equal(exact, nudged)
    # beyond the tolerance (20 ulps of 1 below) the score reads its own place, below the group, as before
    at, below = (va.predict_interval(torch.tensor([[0.0, -0.002 + s]], dtype=torch.float64)) for s in (0.0, -20 * eps))
    assert float(at[0]) == 0.4 and float(below[0]) == 0.0


def test_intervals_of_a_nan_row_are_nan_where_the_input_is_not_checked():
    """Under vmap (or exported) the input checks are left out: the interval of a row with a NaN
    score was a confident step's, p0 = 0.987 and p1 = 1 on SST-2 (the diff review)."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (400,), generator=gen)
    logits = torch.randn(400, 2, generator=gen, dtype=torch.float64) + 2 * torch.nn.functional.one_hot(labels, 2)
    va = VennAbersCalibration().fit(logits, labels)
    rows = logits[:5].clone()
    rows[0, 1] = float("nan")
    lower, upper = torch.func.vmap(lambda row: tuple(p.squeeze(0) for p in va.predict_interval(row.unsqueeze(0))))(rows)
    assert lower[0].isnan().all() and upper[0].isnan().all()
    expected = va.predict_interval(rows[1:])
    torch.testing.assert_close((lower[1:], upper[1:]), expected, rtol=0, atol=0)
