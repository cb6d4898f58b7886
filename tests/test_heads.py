"""Calibration heads on networks: fitting from a loader, output kinds, state_dict, compile, export."""

from __future__ import annotations

import collections
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchcal
from torchcal.heads import CalibratedModel, attach, collect_scores, replace_logits

K = 4


def make_data(n: int, num_classes: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    labels = (x[:, :num_classes] + 0.8 * torch.randn(n, num_classes, generator=gen)).argmax(dim=1)
    return x, labels


def make_net(num_classes: int = K, final: nn.Module | None = None) -> nn.Module:
    """logits = 4 * x[:, :K] (+ small weights): informative but over-confident, with dropout."""
    torch.manual_seed(1)
    hidden, out = nn.Linear(6, 2 * num_classes), nn.Linear(2 * num_classes, num_classes)
    eye = torch.eye(num_classes, 6)
    with torch.no_grad():
        hidden.weight.copy_(torch.cat([eye, -eye]) + 0.01 * hidden.weight)
        hidden.bias.zero_()
        out.weight.copy_(4 * torch.cat([torch.eye(num_classes), -torch.eye(num_classes)], dim=1))
    layers = [hidden, nn.ReLU(), nn.Dropout(0.3), out]  # relu(x) - relu(-x) = x
    return nn.Sequential(*layers, *([final] if final is not None else []))


def loader(x: torch.Tensor, labels: torch.Tensor, batch_size: int = 64) -> DataLoader:
    return DataLoader(TensorDataset(x, labels), batch_size=batch_size)


def eval_outputs(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        out = net(x)
    net.train()
    return out


PARAMETRIC = {
    "temperature": lambda: torchcal.TemperatureScaling(),
    "affine": lambda: torchcal.AffineCalibration(),
    "vector": lambda: torchcal.VectorScaling(),
    "matrix": lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=0.1),
    "dirichlet": lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1),
    "svs": lambda: torchcal.StructuredVectorScaling(reg_lambda=1.0),
    "sms": lambda: torchcal.StructuredMatrixScaling(reg_lambda=1.0),
}
NONPARAMETRIC = {
    "histogram": lambda: torchcal.HistogramBinning(n_bins=10),
    "isotonic": lambda: torchcal.IsotonicCalibration(),
    "venn-abers": lambda: torchcal.VennAbersCalibration(),
    "venn-abers-pairwise": lambda: torchcal.VennAbersCalibration(folds=2, multiclass="pairwise"),
}
BINARY = {"platt": lambda: torchcal.PlattScaling(), "beta": lambda: torchcal.BetaCalibration()}


@pytest.fixture(scope="module")
def val():
    return make_data(600, seed=0)


@pytest.fixture(scope="module")
def fitted_heads(val):
    """Every multiclass calibrator fitted as a head on the same network, once per test module."""
    heads = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchcal.ConvergenceWarning)
        for name, make in {**PARAMETRIC, **NONPARAMETRIC}.items():
            heads[name] = CalibratedModel(make_net(), make()).fit(loader(*val)).eval()
    return heads


# ------------------------------------------------------------------------------------ fitting
@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC, *BINARY])
def test_head_equals_calibrator_fitted_on_eval_outputs(name):
    num_classes = 2 if name in BINARY else K
    make = {**PARAMETRIC, **NONPARAMETRIC, **BINARY}[name]
    (x_val, y_val), (x_test, _) = make_data(500, num_classes, seed=0), make_data(50, num_classes, seed=1)
    net = make_net(num_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchcal.ConvergenceWarning)
        head = CalibratedModel(net, make()).fit(loader(x_val, y_val))
        reference = make().fit(eval_outputs(net, x_val), y_val)
    assert head.calibrator.is_fitted and head.model is net
    head.eval()
    with torch.no_grad():
        torch.testing.assert_close(head(x_test), reference(eval_outputs(net, x_test)), rtol=1e-5, atol=1e-5)


def test_fit_runs_the_network_once_in_eval_mode_and_leaves_it_unchanged(val):
    net = make_net()
    net[2].train(False)  # a submodule in its own mode must keep it
    before = {k: v.clone() for k, v in net.state_dict().items()}
    calls = []
    net.register_forward_hook(lambda module, args, out: calls.append(module.training))
    head = CalibratedModel(net, torchcal.TemperatureScaling()).fit(loader(*val, batch_size=100))
    assert calls == [False] * 6  # one pass over 6 batches, in eval mode (dropout off)
    assert net.training and not net[2].training and net[0].training
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.requires_grad for p in net.parameters())
    x_val, y_val = val
    assert head.calibrator.temperature == pytest.approx(
        torchcal.TemperatureScaling().fit(eval_outputs(net, x_val), y_val).temperature, rel=1e-9
    )
    assert head.calibrator.temperature > 1.5  # the network was made over-confident


def test_attach_returns_a_frozen_head_in_eval_mode(val):
    """attach() is the deployment form: eval mode (dropout off) and no parameter that trains,
    the network's (shared with the caller's module) and the fitted head's alike."""
    net = make_net()
    head = attach(net, torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1), loader(*val))
    assert not head.training and not any(m.training for m in head.modules())
    assert head.calibrator.is_fitted and list(head.calibrator.parameters())
    assert not any(p.requires_grad for p in head.parameters())
    assert not any(p.requires_grad for p in net.parameters())
    x = make_data(16, seed=2)[0]
    assert not head(x).requires_grad and torch.equal(head(x), head(x))  # deterministic: no dropout
    for warm_start in (False, True):  # a refit keeps the head frozen (a cold one made fresh parameters that trained)
        head.fit(loader(*val), warm_start=warm_start)
        assert not any(p.requires_grad for p in head.parameters())
    reference = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.1).fit(eval_outputs(make_net(), val[0]), val[1])
    with torch.no_grad():
        torch.testing.assert_close(head(x), reference(eval_outputs(make_net(), x)), rtol=1e-5, atol=1e-5)


class _WithFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"features": x.square(), "logits": self.net(x)}


def test_structured_outputs_calibrate_the_logits_and_pass_the_rest(val):
    model = _WithFeatures()
    head = attach(model, torchcal.TemperatureScaling(), loader(*val), logits_key="logits")
    reference = attach(model.net, torchcal.TemperatureScaling(), loader(*val))
    x = make_data(20, seed=3)[0]
    out = head(x)
    assert set(out) == {"features", "logits"} and torch.equal(out["features"], x.square())
    torch.testing.assert_close(out["logits"], reference(x), rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="logits_key=0 for"):
        CalibratedModel(model, head.calibrator, logits_key=0)(x)


class ModelOutput(collections.OrderedDict):
    """The essence of Hugging Face's ``ModelOutput``: an ordered dict with attribute access, whose
    ``update``, ``pop`` and ``setdefault`` raise (replace_logits called update: every real
    ModelOutput raised, review finding)."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def update(self, *args, **kwargs) -> None:
        raise Exception(f"You cannot use ``update`` on a {type(self).__name__} instance.")

    def pop(self, *args, **kwargs) -> None:
        raise Exception(f"You cannot use ``pop`` on a {type(self).__name__} instance.")

    def setdefault(self, *args, **kwargs) -> None:
        raise Exception(f"You cannot use ``setdefault`` on a {type(self).__name__} instance.")


class NeedsArguments(collections.OrderedDict):
    def __init__(self, tag: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


def test_replace_logits_keeps_the_type_of_dict_outputs():
    """A ModelOutput-style output came back as a plain dict, without its attribute access."""
    logits, features, new = torch.zeros(2, 3), torch.ones(2, 4), torch.full((2, 3), 2.0)
    for output in (ModelOutput(logits=logits, features=features), collections.OrderedDict(features=features, logits=logits)):
        replaced = replace_logits(output, "logits", new)
        assert type(replaced) is type(output) and list(replaced) == list(output)
        assert replaced["logits"] is new and replaced["features"] is features and output["logits"] is logits
    assert replace_logits(ModelOutput(logits=logits), "logits", new).logits is new
    # a plain dict where the type cannot be kept: immutable, or not copyable without arguments
    for output in (types.MappingProxyType({"logits": logits}), NeedsArguments("tag", logits=logits)):
        replaced = replace_logits(output, "logits", new)
        assert type(replaced) is dict and replaced["logits"] is new


def test_output_kinds_give_the_same_calibrated_posteriors(val):
    x_val, y_val = val
    x = make_data(20, seed=3)[0]
    heads = {
        kind: attach(make_net(final=final), torchcal.TemperatureScaling(), loader(x_val, y_val), output=kind).eval()
        for kind, final in [("logits", None), ("log_probs", nn.LogSoftmax(dim=1)), ("probs", nn.Softmax(dim=1))]
    }
    with torch.no_grad():
        log_posteriors = heads["logits"](x)
        torch.testing.assert_close(heads["log_probs"](x), log_posteriors, rtol=0, atol=1e-6)
        probs = heads["probs"](x)
    torch.testing.assert_close(probs, log_posteriors.exp(), rtol=0, atol=1e-6)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(20))
    assert heads["probs"].calibrator.temperature == pytest.approx(heads["logits"].calibrator.temperature, rel=1e-6)
    # what the fit refuses, the head refuses too (it had floored -0.2 to 1e-20 and made a zero row uniform)
    assert heads["probs"](x[:0]).shape == (0, K)  # (an empty batch still gives an empty batch: the diff review)
    heads["probs"].model = make_net(final=nn.Tanh())
    with pytest.raises(ValueError, match="network outputs must lie in"):
        heads["probs"](x)


def test_collect_scores_on_dict_batches_with_split_batch(val):
    x_val, y_val = val
    batches = [{"x": x_val[i : i + 100], "y": y_val[i : i + 100]} for i in range(0, 600, 100)]
    net = make_net()
    scores, labels = collect_scores(net, batches, split_batch=lambda b: ((b["x"],), b["y"]))
    torch.testing.assert_close(scores, eval_outputs(net, x_val))
    assert torch.equal(labels, y_val)


def test_collect_scores_names_the_batch_whose_number_of_classes_differs(val):
    """A head swapped after the first batch: K + 1 classes in batch 1 (torch.cat raised its own error)."""

    class Swapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nets, self.calls = nn.ModuleList([make_net(), make_net(K + 1)]), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.nets[min(self.calls, 2) - 1](x)

    with pytest.raises(ValueError, match=r"batch 1: the model returned outputs of shape \(64, 5\) but those of batch 0 had shape \(64, 4\)"):
        collect_scores(Swapped(), loader(*val))


def test_gradients_flow_through_a_fitted_head(fitted_heads):
    head = fitted_heads["dirichlet"]
    x = make_data(8, seed=4)[0].requires_grad_()
    head(x)[:, 0].sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC])
def test_heads_under_vmap(name, fitted_heads):
    """vmap (alone, in jacfwd, in per-sample gradients) cannot read values into Python: the input
    checks, which did, are left out there, and rows with a NaN score come out NaN."""
    head = fitted_heads[name]
    x = make_data(6, seed=8)[0]
    one_row = torch.func.vmap(lambda row: head(row.unsqueeze(0)).squeeze(0))
    with torch.no_grad():
        torch.testing.assert_close(one_row(x), head(x), rtol=0, atol=1e-12)
        x[0, 0] = float("nan")
        assert one_row(x)[0].isnan().all()


def test_per_sample_gradients_of_a_head_being_fine_tuned():
    """torch.func's per-sample-gradient recipe, vmap(grad(loss)), through a head: each sample's
    gradients (the network's and the temperature's) equal grad(loss) of that sample alone."""
    x, labels = make_data(5, seed=9)
    head = CalibratedModel(make_net(), torchcal.TemperatureScaling()).fit(loader(*make_data(300))).eval().requires_grad_(True)
    params = {name: p.detach() for name, p in head.named_parameters()}

    def loss(params, x, label):
        return nn.functional.nll_loss(torch.func.functional_call(head, params, (x.unsqueeze(0),)), label.unsqueeze(0))

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, labels)
    for i in range(5):
        one = torch.func.grad(loss)(params, x[i], labels[i])
        for name in params:
            torch.testing.assert_close(per_sample[name][i], one[name])


# -------------------------------------------------------------------------------------- misuse
def test_unfitted_head_says_to_fit_it():
    with pytest.raises(RuntimeError, match=r"not fitted yet: call \.fit\(heldout_loader\)"):
        CalibratedModel(make_net(), torchcal.TemperatureScaling())(torch.randn(2, 6))


def test_misuse_errors(val):
    net = make_net()
    with pytest.raises(TypeError, match="torchcal calibrator"):
        CalibratedModel(net, nn.Identity())
    with pytest.raises(ValueError, match="output must be one of"):
        CalibratedModel(net, torchcal.TemperatureScaling(), output="prob")
    with pytest.raises(TypeError, match="split_batch="):
        attach(net, torchcal.TemperatureScaling(), [{"x": val[0], "y": val[1]}])
    with pytest.raises(ValueError, match="no batches"):
        attach(net, torchcal.TemperatureScaling(), [])
    with pytest.raises(ValueError, match="network outputs must lie in"):
        attach(net, torchcal.TemperatureScaling(), loader(*val), output="probs")
    with pytest.warns(UserWarning, match="look like probabilities"):
        attach(make_net(final=nn.Softmax(dim=1)), torchcal.TemperatureScaling(), loader(*val))


# ------------------------------------------------------------------- state_dict, compile, export
@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC])
def test_state_dict_round_trip_into_a_fresh_head(name, fitted_heads, tmp_path):
    head = fitted_heads[name]
    torch.save(head.state_dict(), tmp_path / "head.pt")
    fresh = CalibratedModel(make_net(), {**PARAMETRIC, **NONPARAMETRIC}[name]()).eval()
    fresh.model[0].weight.data.zero_()  # the network's weights must come from the file too
    fresh.load_state_dict(torch.load(tmp_path / "head.pt"))
    x = make_data(30, seed=5)[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), head(x))


def test_numpy_strengths_fit_and_their_states_load_weights_only(tmp_path):
    """Strengths given as NumPy numbers (``np.logspace(...)[i]``, which is a float) were stored in
    the state as they came: ``torch.load(weights_only=True)`` refused the file (from_checkpoint
    with it), and a float32 one crashed the fit. They are Python floats now."""
    logits, labels = make_data(300, seed=6)
    for calibrator in (
        torchcal.StructuredVectorScaling(reg_lambda=np.logspace(-2, 0, 3)[1]),
        torchcal.DirichletCalibration(reg="l2", reg_lambda=np.float32(0.1)),
        torchcal.MatrixScaling(reg="odir", reg_lambda=np.float64(0.1), reg_mu=np.float32(0.5)),
        torchcal.DirichletCalibration(reg="odir", reg_grid=[(np.float32(1.0), np.float64(2.0)), (np.float64(10.0), 10)]),
        torchcal.StructuredMatrixScaling(reg_grid=np.array([0.25, 1.0])),
        torchcal.IsotonicCalibration(eps=np.float64(1e-6)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (classes without a sample in these few rows)
            calibrator.fit(logits, labels)
        torch.save(calibrator.state_dict(), tmp_path / "state.pt")
        fresh = type(calibrator)()
        fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        with torch.no_grad():
            assert torch.equal(fresh(logits), calibrator(logits))
    with pytest.raises(ValueError, match="reg_lambda must be a number, got 'big'"):
        torchcal.MatrixScaling(reg="l2", reg_lambda="big")


@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC])
def test_an_empty_batch_gives_an_empty_batch(name, fitted_heads):
    """A batch of no rows through a fitted head: (0, K), as the network, a traced, compiled or
    exported head give (the eager head raised "logits is empty", which only a fit must say)."""
    head = fitted_heads[name]
    with torch.no_grad():
        assert head(torch.empty(0, 6)).shape == (0, K)
        for dtype in (torch.float32, torch.float64):
            assert head.calibrator(torch.empty(0, K, dtype=dtype)).shape == (0, K)
    with pytest.raises(ValueError, match=f"K = {K + 1} classes but {K} were expected"):  # (the columns are still checked)
        head.calibrator(torch.empty(0, K + 1))


@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC])
def test_a_state_loads_on_the_device_the_head_was_moved_to(name, fitted_heads):
    """A head moved to a device before its state is loaded (the meta device stands in for a GPU):
    the network's parameters stay there, and so must the calibrator's, which it creates at the
    load (they were made on the CPU: forward then mixed devices)."""
    fresh = CalibratedModel(make_net(), {**PARAMETRIC, **NONPARAMETRIC}[name]()).to("meta").half()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "for .*: copying from a non-meta parameter")  # (the meta device's no-op copies)
        fresh.load_state_dict(fitted_heads[name].state_dict())
    devices = {t.device.type for t in fresh.calibrator.state_dict().values() if isinstance(t, torch.Tensor)}
    assert devices == {"meta"} and fresh.model[0].weight.device.type == "meta"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without the GPU the module was pickled on")
def test_a_calibrator_pickled_on_a_gpu_moves_on_a_machine_without_one():
    """A calibrator pickled on a GPU records that device (where its state would load); loaded on a
    CPU-only machine, .to("cpu") and .float() probed the missing GPU and raised."""
    calibrator = torchcal.TemperatureScaling().fit(*make_data(200, seed=7))
    unfitted = torchcal.TemperatureScaling()
    for module in (calibrator, unfitted):
        module._device = torch.device("cuda", 0)  # (what .cuda() leaves)
        module.to("cpu").float()
        assert module._device == torch.device("cpu")


@pytest.mark.parametrize("name", ["temperature", "dirichlet"])
def test_compiled_head_matches_eager(name, fitted_heads):
    head = fitted_heads[name]
    compiled = torch.compile(head, fullgraph=True)
    for n in (16, 37):
        x = make_data(n, seed=n)[0]
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), head(x), rtol=1e-6, atol=1e-6)


def _batch_dim() -> tuple[dict[int, torch.export.Dim]]:
    return ({0: torch.export.Dim("batch")},)


@pytest.mark.parametrize("name", [*PARAMETRIC, *NONPARAMETRIC])
def test_torch_export_round_trip(name, fitted_heads, tmp_path):
    head = fitted_heads[name]
    x = make_data(16, seed=6)[0]
    program = torch.export.export(head, (x,), dynamic_shapes=_batch_dim())
    torch.export.save(program, tmp_path / "head.pt2")
    loaded = torch.export.load(tmp_path / "head.pt2").module()
    for n in (16, 5):
        x = make_data(n, seed=n)[0]
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), head(x), rtol=0, atol=1e-6)
    # the program has no input checks: a NaN row stays NaN (the step maps had given it a confident step)
    x[0, 0] = float("nan")
    with torch.no_grad():
        out = loaded(x)
        torch.testing.assert_close(out[1:], head(x[1:]), rtol=0, atol=1e-6)
    assert out[0].isnan().all()


class _Heads(nn.Module):
    """Several heads as one module, so one ONNX conversion (seconds of fixed cost) checks them all."""

    def __init__(self, heads: list[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(head(x) for head in self.heads)


def _onnx_session(module: nn.Module, path, x: torch.Tensor):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    torch.onnx.export(module, (x,), path, dynamo=True, dynamic_shapes=_batch_dim(), verbose=False)
    return ort.InferenceSession(str(path))


def test_onnx_round_trip_of_the_parametric_heads(fitted_heads, tmp_path):
    heads = [fitted_heads[name] for name in PARAMETRIC]
    session = _onnx_session(_Heads(heads).eval(), tmp_path / "heads.onnx", make_data(16, seed=6)[0])
    for n in (16, 3):
        x = make_data(n, seed=n)[0]
        outputs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert len(outputs) == len(heads)
        for name, head, got in zip(PARAMETRIC, heads, outputs):
            with torch.no_grad():
                torch.testing.assert_close(torch.from_numpy(got), head(x), rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", NONPARAMETRIC)
def test_onnx_round_trip_of_the_step_heads(fitted_heads, tmp_path, name):
    head = fitted_heads[name]
    session = _onnx_session(head.eval(), tmp_path / "head.onnx", make_data(16, seed=6)[0])
    for n in (16, 3):
        x = make_data(n, seed=n)[0]
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), head(x), rtol=0, atol=1e-5)


def test_legacy_onnx_exporter_and_jit_trace(fitted_heads, tmp_path):
    """The TorchScript-based exporters work on every head (the calibrators' extra state, a dict,
    is left out of the state the legacy ONNX exporter traces)."""
    ort = pytest.importorskip("onnxruntime")
    x = make_data(16, seed=6)[0]
    for name, head in fitted_heads.items():
        torch.onnx.export(head.eval(), (x,), tmp_path / f"{name}.onnx", dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
        session = ort.InferenceSession(str(tmp_path / f"{name}.onnx"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # jit.trace is deprecated; the value checks warn that they are not traced
            traced = torch.jit.trace(head, (x,))
        for n in (16, 5):
            x_n = make_data(n, seed=n)[0]
            with torch.no_grad():
                expected = head(x_n)
                torch.testing.assert_close(traced(x_n), expected, rtol=0, atol=1e-6, msg=name)
            (got,) = session.run(None, {"x": x_n.numpy()})
            torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-5, msg=name)
        assert "calibrator._extra_state" in head.state_dict()  # outside the export the state is whole


def test_legacy_onnx_export_of_calibrators_outside_a_head(fitted_heads, tmp_path):
    """A calibrator in an nn.Sequential, or alone, failed the legacy exporter ("'dict' object has no
    attribute 'detach'"): only CalibratedModel left the calibrator's extra state out."""
    ort = pytest.importorskip("onnxruntime")
    x = make_data(16, seed=6)[0]
    for name, head in fitted_heads.items():
        sequential = nn.Sequential(head.model, head.calibrator).eval()
        with torch.no_grad():
            scores = head.model(x)
        for what, module, example in (("sequential", sequential, x), ("bare", head.calibrator, scores)):
            path = tmp_path / f"{name}-{what}.onnx"
            torch.onnx.export(module, (example,), path, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
            (got,) = ort.InferenceSession(str(path)).run(None, {"x": example[:5].numpy()})
            with torch.no_grad():
                torch.testing.assert_close(torch.from_numpy(got), module(example[:5]), rtol=0, atol=1e-5, msg=f"{name} {what}")
        assert "1._extra_state" in sequential.state_dict()  # outside the export the state is whole


def test_docstring_examples():
    import doctest

    import torchcal.heads

    result = doctest.testmod(torchcal.heads)
    assert result.attempted > 0 and result.failed == 0


def test_outputs_that_look_like_probabilities_as_the_metrics_define_it():
    """scores_from_outputs warns exactly when torchcal._validation.looks_like_probs says so: half
    precision probabilities (rows within 1e-3 of one, as check_probs accepts them) warn, log-domain
    outputs and an empty batch do not."""
    from torchcal._validation import looks_like_probs
    from torchcal.heads import scores_from_outputs

    logits = 3 * torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    half = logits.softmax(1).half()
    assert (half.double().sum(1) - 1).abs().max() > 1e-4 and looks_like_probs(half)  # beyond float32's tolerance
    for probs in (logits.softmax(1), logits.double().softmax(1), half):
        with pytest.warns(UserWarning, match="look like probabilities"):
            scores_from_outputs(probs, "logits")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for outputs in (logits, logits.log_softmax(1), logits[:0]):
            assert scores_from_outputs(outputs, "log_probs") is outputs


@pytest.mark.parametrize("make", [lambda: torchcal.StructuredVectorScaling(reg_lambda=1.0), lambda: torchcal.StructuredMatrixScaling(reg_lambda=1.0)])
def test_the_network_is_fine_tuned_through_a_structured_head(make):
    """The ts-mix step computed in place on softmax's output, which its backward reads: a backward
    pass through an SVS or SMS head raised."""
    x, y = make_data(600)
    net = make_net()
    with torch.no_grad():
        head = make().fit(net(x), y)
    model = CalibratedModel(net, head)
    torch.nn.functional.nll_loss(model(x), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in net.parameters())


def test_a_state_loads_into_its_own_class_only():
    """Dirichlet calibration and matrix scaling share their tensors' names: a state of one loaded
    silently into the other, another map; a 4-class affine state loaded into Platt scaling."""
    x, y = make_data(600)
    x = x[:, :K]
    dirichlet = torchcal.DirichletCalibration(reg="odir", reg_lambda=0.01).fit(x, y)
    with pytest.raises(ValueError, match=r"holds a fitted DirichletCalibration; load it into DirichletCalibration\(\), not into MatrixScaling\(\)"):
        torchcal.MatrixScaling().load_state_dict(dirichlet.state_dict())
    with pytest.raises(ValueError, match="at 'calibrator' holds a fitted DirichletCalibration"):
        CalibratedModel(make_net(), torchcal.MatrixScaling()).load_state_dict(CalibratedModel(make_net(), dirichlet).state_dict())
    with pytest.raises(ValueError, match="holds a fitted AffineCalibration"):
        torchcal.PlattScaling().load_state_dict(torchcal.AffineCalibration().fit(x, y).state_dict())
    state = torchcal.AffineCalibration(bias=False).fit(x, y).state_dict()
    fresh = torchcal.AffineCalibration()
    fresh.load_state_dict(state)  # (bias=False is in the state, as a histogram's bins are)
    assert fresh.bias is False and torch.equal(fresh(x), torchcal.AffineCalibration(bias=False).fit(x, y)(x))


def test_loading_a_state_copies_into_the_parameters_that_are_there():
    """Loading replaced the parameters: a head frozen by attach came back trainable, and an
    optimizer built before the load (the usual resume) held tensors the model no longer used."""
    x, y = make_data(600)
    x = x[:, :K]
    saved = torchcal.TemperatureScaling().fit(x, y).state_dict()
    head = torchcal.TemperatureScaling().fit(x[:300], y[:300])
    head.requires_grad_(False)
    parameter = head.log_temperature
    head.load_state_dict(saved)
    assert head.log_temperature is parameter and not parameter.requires_grad
    assert torch.equal(parameter.detach(), saved["log_temperature"])
    trainable = torchcal.TemperatureScaling().fit(x[:300], y[:300])
    optimizer = torch.optim.SGD(trainable.parameters(), lr=0.1)
    trainable.load_state_dict(saved)
    torch.nn.functional.nll_loss(trainable(x), y).backward()
    optimizer.step()
    assert not torch.equal(trainable.log_temperature.detach(), saved["log_temperature"])


@pytest.mark.parametrize("make", [torchcal.TemperatureScaling, lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2)])
def test_a_refit_keeps_the_parameters_an_optimizer_holds(make):
    """A refit (the same K, no warm start) replaced the parameters: an optimizer built before it,
    fine-tuning a head re-calibrated every epoch, stepped tensors the model no longer used (review
    finding: the temperature did not move under SGD). The refit still equals a fresh fit."""
    x, y = make_data(600)
    x = x[:, :K]
    head = make().fit(x[:300], y[:300])
    kept = dict(head.named_parameters())
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    head.fit(x, y)
    assert all(p is kept[name] for name, p in head.named_parameters())
    fresh = make().fit(x, y)
    torch.testing.assert_close(head(x), fresh(x), rtol=0, atol=0)
    fitted = {name: p.detach().clone() for name, p in head.named_parameters()}
    torch.nn.functional.nll_loss(head(x[:100]), y[:100]).backward()
    optimizer.step()
    assert any(not torch.equal(p.detach(), fitted[name]) for name, p in head.named_parameters())
    frozen = make().fit(x[:300], y[:300]).requires_grad_(False)
    frozen.fit(x, y)
    assert not any(p.requires_grad for p in frozen.parameters())


# --------------------------------------------------- review findings: half precision in Lightning
@pytest.mark.parametrize("make", [lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2),
                                  lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=1e-2)])
def test_a_head_under_autocast_computes_in_float32(make):
    """Lightning runs test and predict steps under ``torch.autocast`` (bf16-mixed), which sent the
    head's float32 matrix products back to bfloat16: probabilities off by 2e-3 to 8e-3 (a review
    helper's reproducer). Fitting under autocast is protected too."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 10, generator=gen)
    labels = torch.multinomial(torch.softmax(logits / 2, 1), 1, generator=gen).squeeze(1)
    cal = make().fit(logits, labels)
    inputs = logits[:500].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cal(inputs)
        refit = make().fit(logits, labels)
    torch.testing.assert_close(inside, cal(inputs), rtol=0, atol=0)
    torch.testing.assert_close(refit(inputs), cal(inputs), rtol=0, atol=1e-6)


def test_half_precision_probabilities_are_logged_in_float32():
    """``floored_log`` rounded log(p) back to bfloat16 (0.03 nats), which every probability output
    (the heads, the metrics' ``input="probs"``) passed on."""
    from torchcal._validation import floored_log

    probs = torch.softmax(torch.randn(1000, 5, generator=torch.Generator().manual_seed(0)), 1).bfloat16()
    logged = floored_log(probs)
    assert logged.dtype == torch.float32
    torch.testing.assert_close(logged.double(), probs.double().log(), rtol=0, atol=1e-6)


# ------------------------------------------------------------- review findings: shapes only
def _calibrator_classes() -> list[type]:
    base = torchcal.calibrators.base.Calibrator
    return [c for c in map(lambda n: getattr(torchcal, n), torchcal.__all__)
            if isinstance(c, type) and issubclass(c, base) and c is not base]


@pytest.mark.parametrize("cls", _calibrator_classes(), ids=lambda c: c.__name__)
def test_a_fitted_head_runs_on_meta_and_fake_tensors(cls):
    """Shape-only dry runs: a head moved to the meta device, and a calibrator under
    ``FakeTensorMode``, raised from the input checks (``Tensor.item()`` on meta) and from
    ``torch.autocast('meta')``; the network alone ran (review finding)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    k = cls.supported_num_classes or K
    x, y = make_data(600, k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head = CalibratedModel(make_net(k), cls().fit(make_net(k)(x).detach(), y)).eval()
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert head.calibrator(torch.empty(5, k)).shape == (5, k)
    with pytest.raises(ValueError, match="logits on the meta device, but the"):  # (step maps made up values: the diff review)
        head.calibrator(torch.empty(5, k, device="meta"))
    out = head.to("meta")(torch.empty(5, 6, device="meta"))
    assert out.shape == (5, k) and out.is_meta


# ------------------------------------------------------- review findings: containers of batches
def test_namedtuple_and_userdict_batches_and_tuple_outputs_keep_their_types():
    """Review findings: a namedtuple argument was rebuilt from a generator (a TypeError, or a
    generator handed to the network), a UserDict (Hugging Face's BatchEncoding) was not moved to
    the network's device, and tuple subclasses other than namedtuples (torch.return_types)
    failed in replace_logits."""
    from collections import UserDict, namedtuple

    from torchcal.heads import _to_device

    pair = namedtuple("Pair", ["a", "b"])
    x, y = make_data(200)

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def forward(self, inputs):
            return self.net(inputs.a + inputs.b)

    model = TwoInputs()
    batches = [(pair(x[i : i + 50] / 2, x[i : i + 50] / 2), y[i : i + 50]) for i in range(0, 200, 50)]
    logits, labels = collect_scores(model, batches)
    torch.testing.assert_close(logits.double(), model.net.eval()(x).detach().double(), rtol=0, atol=1e-6)
    assert labels.equal(y)
    moved = _to_device(UserDict(x=x), torch.device("meta"))
    assert isinstance(moved, UserDict) and moved["x"].is_meta
    top = torch.topk(torch.randn(5, K), 2)
    replaced = replace_logits(top, 0, torch.zeros(5, 2))
    assert type(replaced) is type(top) and torch.equal(replaced.values, torch.zeros(5, 2)) and replaced.indices is top.indices


def test_split_batch_returning_a_bare_tensor_is_named():
    """`lambda b: (b["x"], b["y"])` split the tensor into its rows as the network's arguments: a
    TypeError about forward's arguments, or at batch size 1 a wrong row count (review finding)."""
    x, y = make_data(40)
    loader = [{"x": x[i : i + 8], "y": y[i : i + 8]} for i in range(0, 40, 8)]
    with pytest.raises(TypeError, match=r"split_batch must return \(arguments, labels\) .* e.g. \(\(x,\), y\)"):
        collect_scores(make_net(), loader, split_batch=lambda b: (b["x"], b["y"]))


def test_float32_inputs_of_a_float64_map_stay_finite():
    """Quadratic scaling computes in float64: a log-posterior below float32's range came out -inf
    for float32 inputs (review finding); it is float32's lowest, as for every other calibrator."""
    gen = torch.Generator().manual_seed(0)
    llr = 3 * torch.randn(4000, generator=gen, dtype=torch.float64)
    labels = torch.bernoulli(torch.sigmoid(llr / 3 + 0.5 + 0.02 * llr**2), generator=gen).long()
    model = torchcal.QuadraticScaling().fit(torch.stack([torch.zeros_like(llr), llr], 1), labels)
    test = torch.tensor([[0.0, 1e21], [0.0, -1e21], [0.0, 5.0]])
    wide, narrow = model(test.double()).detach(), model(test).detach()
    assert float(wide.min()) < -1e39 and bool(torch.isfinite(narrow).all())
    expected = wide.clamp_min(torch.finfo(torch.float32).min).float()
    torch.testing.assert_close(narrow, expected, rtol=1e-6, atol=0)
