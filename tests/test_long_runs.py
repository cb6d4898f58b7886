"""Long runs: a metric updated 10,000 times keeps constant memory and the value of one update;
metrics survive pickle, clone and state_dict after such a run; a calibrator's saved head loads in a
fresh process and gives bit-identical outputs; results are deterministic for a fixed seed and do
not depend on torch's global random state.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch

import torchcal
import torchcal.functional as F
from torchcal import metrics

UPDATES = 10_000
REPO = Path(__file__).resolve().parents[1]
K = 4


def stream(n_updates=UPDATES, seed=0):
    """Small batches of 1 to 3 rows: logits (float32), labels, and the batch boundaries."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 4, (n_updates,), generator=gen)
    n = int(sizes.sum())
    latent = torch.randn(n, K, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(latent, dim=1), 1, generator=gen).squeeze(1)
    logits = (3 * latent).float()
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).tolist()
    return logits, labels, bounds


def state_numel(metric) -> int:
    """Elements held in the metric's data states (tensors or lists of tensors), less the constant
    bookkeeping: the digest of its options and the sample count."""
    total = 0
    for name in set(metric._defaults) - {"options_digest", "sample_count"}:
        value = getattr(metric, name)
        total += sum(v.numel() for v in value) if isinstance(value, list) else value.numel()
    return total


def fitted_temperature():
    gen = torch.Generator().manual_seed(9)
    logits = 3 * torch.randn(500, K, generator=gen)
    labels = torch.multinomial(torch.softmax(logits / 3, dim=1), 1, generator=gen).squeeze(1)
    return torchcal.TemperatureScaling().fit(logits, labels)


COSTS = torch.tensor([[0.0, 1.0, 2.0, 0.3], [1.0, 0.0, 1.0, 0.3], [4.0, 1.0, 0.0, 0.3], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
PRIORS = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)

# name -> (metric factory, the functional value of the whole stream, whether the state is O(1))
CASES = {
    "CrossEntropy": (lambda: metrics.CrossEntropy(K, priors=PRIORS, normalize=True), partial(F.cross_entropy, priors=PRIORS, normalize=True), True),
    "BrierScore": (lambda: metrics.BrierScore(K), F.brier_score, True),
    "BayesRisk": (lambda: metrics.BayesRisk(COSTS, normalize=True), partial(F.bayes_risk, costs=COSTS, normalize=True), True),
    "ExpectedCost": (lambda: metrics.ExpectedCost(COSTS, priors=PRIORS), None, True),
    "CalibrationError": (lambda: metrics.CalibrationError(K, 15), F.expected_calibration_error, True),
    "CalibrationError(classwise, l2)": (
        lambda: metrics.CalibrationError(K, 10, kind="classwise", norm="l2"),
        partial(F.expected_calibration_error, n_bins=10, kind="classwise", norm="l2"),
        True,
    ),
    "ECD": (metrics.ECD, F.entropic_calibration_difference, True),
    "CalibrationLoss(fitted)": (lambda: metrics.CalibrationLoss(fitted_temperature(), K), None, True),
    # Documented O(N) states: equal-mass bins need every score, an unfitted calibrator all the data.
    "CalibrationError(quantile)": (lambda: metrics.CalibrationError(K, 10, strategy="quantile"), partial(F.expected_calibration_error, n_bins=10, strategy="quantile"), False),
    "CalibrationLoss(unfitted)": (lambda: metrics.CalibrationLoss(torchcal.TemperatureScaling(), K, folds=3), None, False),
}


def _inputs(name, logits):
    """ExpectedCost takes decisions instead of scores."""
    return F.bayes_decisions(logits, COSTS) if name == "ExpectedCost" else logits


def _expected(name, fn, logits, labels):
    if name == "ExpectedCost":
        return F.expected_cost(F.bayes_decisions(logits, COSTS), labels, COSTS, priors=PRIORS)
    if name == "CalibrationLoss(fitted)":
        cal = fitted_temperature()
        with torch.no_grad():
            return F.calibration_loss(logits, cal(logits), labels).relative
    if name == "CalibrationLoss(unfitted)":  # (the metric keeps the logits in float64)
        return F.cross_validated_calibration_loss(logits.double(), labels, torchcal.TemperatureScaling(), folds=3).relative
    return fn(logits, labels)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric")  # the loaded copy: update_count is not saved
@pytest.mark.parametrize("name", list(CASES))
def test_ten_thousand_updates_keep_constant_memory_and_the_value_of_one_update(name):
    make, fn, constant = CASES[name]
    # The O(N) metrics keep every batch: 1,000 updates show the growth is exactly the data.
    updates = UPDATES if constant else UPDATES // 10
    logits, labels, bounds = stream(updates)
    inputs = _inputs(name, logits)
    metric, single = make(), make()
    numel_after_first = None
    for i in range(updates):
        metric.update(inputs[bounds[i] : bounds[i + 1]], labels[bounds[i] : bounds[i + 1]])
        if i == 0:
            numel_after_first = state_numel(metric)
    n = bounds[-1]
    if constant:
        assert state_numel(metric) == numel_after_first  # no state grows with the number of updates
    else:
        per_row = numel_after_first // (bounds[1] - bounds[0])
        assert state_numel(metric) == per_row * n  # exactly the data, nothing more
    assert metric.update_count == updates
    single.update(inputs, labels)
    got, once = metric.compute(), single.compute()
    expected = _expected(name, fn, logits, labels)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, once, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, expected.to(torch.float64), rtol=1e-12, atol=1e-14)

    # The long-lived metric round-trips through clone, pickle and state_dict and keeps going.
    clone = metric.clone()
    restored = pickle.loads(pickle.dumps(metric))
    metric.persistent(True)
    buffer = io.BytesIO()
    torch.save(metric.state_dict(), buffer)
    loaded = make()
    loaded.persistent(True)
    loaded.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    for copy_ in (clone, restored, loaded):
        assert torch.equal(copy_.compute(), got)
    extra_logits, extra_labels, _ = stream(50, seed=1)
    for m in (metric, clone, restored, loaded):
        m.update(_inputs(name, extra_logits), extra_labels)
    values = [m.compute() for m in (metric, clone, restored, loaded)]
    assert all(torch.equal(v, values[0]) for v in values)
    all_logits, all_labels = torch.cat([logits, extra_logits]), torch.cat([labels, extra_labels])
    torch.testing.assert_close(values[0], _expected(name, fn, all_logits, all_labels).double(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "make, fn", [(lambda: metrics.CrossEntropy(K), F.cross_entropy), CASES["BrierScore"][:2], CASES["ECD"][:2]], ids=["ce", "brier", "ecd"]
)
def test_forward_with_gradients_does_not_keep_the_graph(make, fn):
    """In a training loop the logits require grad and ``forward`` returns a differentiable batch
    value; the accumulated states must not hold the autograd graph of every step."""
    logits, labels, bounds = stream(2000, seed=2)
    metric = make()
    for i in range(2000):
        batch = logits[bounds[i] : bounds[i + 1]].double().requires_grad_()
        value = metric(batch, labels[bounds[i] : bounds[i + 1]])
        assert value.requires_grad
    for state in metric._defaults:
        assert getattr(metric, state).grad_fn is None and not getattr(metric, state).requires_grad
    torch.testing.assert_close(metric.compute(), fn(logits, labels), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- a saved head in a fresh process
# Constructor calls, evaluated with ``from torchcal import *`` here and in the fresh process.
CALIBRATORS = [
    "TemperatureScaling()",
    "AffineCalibration()",
    "AffineCalibration(bias=False)",
    "VectorScaling()",
    "MatrixScaling(reg='odir', reg_lambda=0.5)",
    "DirichletCalibration(reg='odir', reg_grid=(0.01, 1.0), cv_folds=3)",
    "HistogramBinning(n_bins=8, strategy='quantile')",
    "IsotonicCalibration()",
]


def construct(source):
    # the package's names are lazy attributes (PEP 562): ask for each, not for its globals
    return eval(source, {name: getattr(torchcal, name) for name in torchcal.__all__})


FRESH_PROCESS = textwrap.dedent(
    """
    import sys, torch, torchcal
    from torchcal import *
    from torchcal.functional import bootstrap, cross_entropy
    saved = torch.load(sys.argv[1], weights_only=True)
    out = {}
    for source, state in saved["heads"].items():
        head = eval(source)
        head.load_state_dict(state)
        with torch.no_grad():
            out[source] = {str(x.dtype): head(x) for x in saved["inputs"]}
    logits, labels = saved["data"]
    out["bootstrap"] = bootstrap(cross_entropy, logits, labels, num_replicates=50, seed=7).replicates
    out["cross_validate"] = torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, folds=4, seed=3)
    torch.save(out, sys.argv[2])
    """
)


def test_saved_heads_load_in_a_fresh_process_with_bit_identical_outputs(tmp_path):
    gen = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(300, K, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 4, dim=1), 1, generator=gen).squeeze(1)
    unseen = 4 * torch.randn(50, K, generator=gen, dtype=torch.float64)
    inputs = [unseen, unseen.float(), unseen.half(), unseen.bfloat16()]
    heads, expected = {}, {}
    for source in CALIBRATORS:
        cal = construct(source).fit(logits, labels)
        heads[source] = cal.state_dict()
        with torch.no_grad():
            expected[source] = {str(x.dtype): cal(x) for x in inputs}
    saved, result = tmp_path / "heads.pt", tmp_path / "out.pt"
    torch.save({"heads": heads, "inputs": inputs, "data": (logits, labels)}, saved)
    completed = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(saved), str(result)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert completed.returncode == 0, completed.stderr
    out = torch.load(result, weights_only=True)
    for source in CALIBRATORS:
        for dtype, tensor in expected[source].items():
            assert tensor.dtype == out[source][dtype].dtype
            assert torch.equal(out[source][dtype], tensor), (source, dtype)
    # Seeded results agree across processes too.
    assert torch.equal(out["bootstrap"], F.bootstrap(F.cross_entropy, logits, labels, num_replicates=50, seed=7).replicates)
    assert torch.equal(out["cross_validate"], torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, folds=4, seed=3))


# --------------------------------------------------------------------------- determinism
def _data(seed=11, n=240):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, K, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 3, dim=1), 1, generator=gen).squeeze(1)
    return logits, labels


def test_results_are_deterministic_for_a_fixed_seed_whatever_the_global_random_state():
    logits, labels = _data()
    runs = []
    for global_seed in (0, 12345):
        torch.manual_seed(global_seed)
        run = {
            "bootstrap": F.bootstrap(F.brier_score, logits, labels, num_replicates=100, seed=3).replicates,
            "bootstrap-loop": F.bootstrap(F.expected_calibration_error, logits, labels, num_replicates=20, seed=3).replicates,
            "cross_validate": torchcal.cross_validate(torchcal.VectorScaling(), logits, labels, folds=5, seed=1),
            "cv-loss": torch.stack(list(F.cross_validated_calibration_loss(logits, labels, torchcal.AffineCalibration(), folds=3, seed=2))),
            "folds": torch.cat(torchcal.fit.fold_indices(labels, 4, seed=8)),
        }
        for source in CALIBRATORS:
            cal = construct(source).fit(logits, labels)
            run[source] = torch.cat([t.flatten().double() for t in cal.state_dict().values() if torch.is_tensor(t)])
        runs.append(run)
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name
    # ... and the seed is what decides.
    other = F.bootstrap(F.brier_score, logits, labels, num_replicates=100, seed=4).replicates
    assert not torch.equal(other, runs[0]["bootstrap"])
    assert not torch.equal(torchcal.cross_validate(torchcal.VectorScaling(), logits, labels, folds=5, seed=2), runs[0]["cross_validate"])
