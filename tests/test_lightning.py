"""CalibrationCallback in real Lightning runs: metrics, cost controls, the attached head, structured
outputs, checkpoints (resume, a fresh process, export), DDP (fork, spawn), early stopping, recipe."""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import torchcal
from torchcal.functional import brier_score, cross_entropy, expected_calibration_error, refinement_loss
from torchcal.heads import CHECKPOINT_KEY, CalibratedModel, head_checkpoint
from torchcal.lightning import CalibrationCallback
from torchcal.metrics import CalibrationError, CrossEntropy

K = 3
TRAINER_DEFAULTS = dict(
    accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False
)


def make_data(n: int, seed: int) -> TensorDataset:
    """Three noisy, overlapping classes in 8 dimensions: a network that fits them grows over-confident."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, K, (n,), generator=gen)
    x = torch.randn(n, 8, generator=gen)
    x[:, :K] += 1.2 * F.one_hot(labels, K)
    return TensorDataset(x, labels)


def loader(n: int, seed: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(make_data(n, seed), batch_size=50, shuffle=shuffle)


class Classifier(LightningModule):
    """Returns logits; validates with torchcal metric objects logged by ``self.log(name, metric)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, K))
        self.val_nce = CrossEntropy(num_classes=K, normalize=True)
        self.val_ece = CalibrationError(num_classes=K)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_nce.update(logits, y)
        self.val_ece.update(logits, y)
        self.log("val_nce", self.val_nce)
        self.log("val_ece", self.val_ece)
        return {"logits": logits, "labels": y}

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_nll", F.nll_loss(self(x), y))  # the head returns log-posteriors

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def raw_outputs(model: LightningModule, data: TensorDataset, batch_size: int | None = None) -> Tensor:
    """The network's outputs, in batches of ``batch_size`` as a DataLoader feeds them (float32
    results depend on the batch size at round-off level; the same batches give the same bits)."""
    model.eval()
    x = data.tensors[0]
    with torch.no_grad():
        return torch.cat([model(part) for part in x.split(batch_size or len(x))])


def head_state(callback: CalibrationCallback) -> dict[str, Tensor]:
    return {k: v for k, v in callback.calibrator.state_dict().items() if k != "_extra_state"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 4-epoch run with the callback, checkpoints and a CSV log."""
    root = tmp_path_factory.mktemp("run")
    model = Classifier()
    callback = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce", "nbs", "ece", "rcl", "refinement"))
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
    trainer = Trainer(
        **{**TRAINER_DEFAULTS, "logger": CSVLogger(root), "enable_checkpointing": True},
        max_epochs=4,
        callbacks=[callback, checkpoints],
        log_every_n_steps=5,
    )
    trainer.fit(model, loader(200, seed=0, shuffle=True), loader(300, seed=1))
    return trainer, model, callback, root


# ----------------------------------------------------------------------------------- fitting
def test_epoch_metrics_equal_independent_computations(trained):
    trainer, model, callback, root = trained
    val = make_data(300, seed=1)
    logits, labels = raw_outputs(model, val, batch_size=50), val.tensors[1]
    logged = trainer.callback_metrics
    nce = cross_entropy(logits, labels, normalize=True)
    assert float(logged["calibration/nce"]) == pytest.approx(float(nce), rel=1e-6)
    assert float(logged["calibration/nbs"]) == pytest.approx(float(brier_score(logits, labels, normalize=True)), rel=1e-6)
    assert float(logged["calibration/ece"]) == pytest.approx(float(expected_calibration_error(logits, labels)), rel=1e-5)
    out_of_fold = torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels)
    rcl = 100 * (1 - cross_entropy(out_of_fold, labels) / cross_entropy(logits, labels))
    assert float(logged["calibration/rcl"]) == pytest.approx(float(rcl), rel=1e-4)
    assert float(logged["calibration/rcl"]) > 3  # the network is over-confident: calibration helps
    refined = torchcal.TemperatureScaling().fit(logits, labels)
    assert float(logged["calibration/refinement"]) == pytest.approx(float(cross_entropy(refined(logits), labels)), rel=1e-6)
    # torchmetrics objects logged with self.log(name, metric): computed and reset every epoch.
    assert float(logged["val_nce"]) == pytest.approx(float(nce), rel=1e-5)
    assert float(logged["val_ece"]) == pytest.approx(float(logged["calibration/ece"]), rel=1e-5)


def test_metrics_are_logged_every_epoch(trained):
    *_, root = trained
    rows = list(csv.DictReader(open(next(root.glob("**/metrics.csv")))))
    per_epoch = [r for r in rows if r.get("calibration/nce")]
    assert [int(r["epoch"]) for r in per_epoch] == [0, 1, 2, 3]
    assert all(float(r["calibration/nce"]) > 0 for r in per_epoch)
    assert all(float(r["calibration/refinement"]) > 0 for r in per_epoch)
    final = [r for r in rows if r.get("calibration/after/nce")]
    assert len(final) == 1
    logged = {k for k, v in final[0].items() if v}
    assert logged >= {f"calibration/{w}/{m}" for w in ("before", "after") for m in ("nce", "nbs", "ece")} | {"calibration/before/rcl"}
    # no RCL or refinement "after": that would refit a calibrator on already calibrated scores
    assert not logged & {"calibration/after/rcl", "calibration/after/refinement", "calibration/before/refinement"}


def test_head_is_fitted_on_the_last_validation_logits(trained):
    _, model, callback, _ = trained
    val = make_data(300, seed=1)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, val, batch_size=50), val.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-9)
    assert callback.calibrator.temperature > 1.1


def test_report_before_after(trained):
    _, _, callback, _ = trained
    before, after = callback.report_["before"], callback.report_["after"]
    # "after" is the out-of-fold calibrated data that also defines the RCL.
    assert after["nce"] == pytest.approx(before["nce"] * (1 - before["rcl"] / 100), rel=1e-9)
    assert after["nce"] < before["nce"] and after["ece"] < before["ece"]
    assert "rcl" not in after
    table = callback.table().splitlines()
    assert table[1].split()[0] == "NCE" and table[-1].split() == ["RCL", f"{before['rcl']:.4f}", "-"]


def test_predict_and_test_use_the_calibrated_head(trained):
    trainer, model, callback, _ = trained
    test = make_data(200, seed=2)
    raw = raw_outputs(model, test)
    predictions = torch.cat(trainer.predict(model, DataLoader(test, batch_size=64)))
    with torch.no_grad():
        expected = callback.calibrator(raw)
    torch.testing.assert_close(predictions, expected, rtol=0, atol=1e-6)
    metrics = trainer.test(model, DataLoader(test, batch_size=64), verbose=False)[0]
    assert metrics["test_nll"] == pytest.approx(float(F.nll_loss(expected, test.tensors[1])), rel=1e-5)
    # Outside the trainer nothing stays attached; calibrated_model gives the same outputs.
    torch.testing.assert_close(raw_outputs(model, test), raw)
    with torch.no_grad():
        torch.testing.assert_close(callback.calibrated_model(model)(test.tensors[0]), expected)


def test_checkpoint_restores_the_head_on_resume_and_for_test(trained):
    _, _, callback, root = trained
    last = str(root / "ckpt" / "last.ckpt")
    checkpoint = torch.load(last, weights_only=True)
    # one stable top-level key, the head under the callback's state key; the callback state holds no copy
    assert checkpoint[CHECKPOINT_KEY][callback.state_key]["calibrator"] == "torchcal.calibrators.temperature.TemperatureScaling"
    assert not any("calibrator" in str(state) for state in checkpoint.get("callbacks", {}).values())
    # A run resumed from the checkpoint (already at max_epochs, so it trains no further), by a
    # callback with another prefix.
    resumed = CalibrationCallback(torchcal.TemperatureScaling(), prefix="other/")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(**TRAINER_DEFAULTS, max_epochs=4, callbacks=[resumed]).fit(
            Classifier(), loader(600, 0), loader(300, 1), ckpt_path=last
        )
    state = head_state(callback)
    assert state and all(torch.equal(v, head_state(resumed)[k]) for k, v in state.items())
    # trainer.test(ckpt_path=...) with a fresh callback and module restores both.
    fresh, model = CalibrationCallback(torchcal.TemperatureScaling()), Classifier()
    test = make_data(100, seed=3)
    trainer = Trainer(**TRAINER_DEFAULTS, callbacks=[fresh])
    metrics = trainer.test(model, DataLoader(test, batch_size=50), ckpt_path=last, verbose=False)[0]
    assert fresh.calibrator.temperature == callback.calibrator.temperature
    with torch.no_grad():
        expected = F.nll_loss(callback.calibrator(raw_outputs(model, test)), test.tensors[1])
    assert metrics["test_nll"] == pytest.approx(float(expected), rel=1e-5)
    # A checkpoint without a head (saved before any fit) leaves the callback's head, fitted on other
    # weights: trainer.test says so.
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, root / "ckpt" / "no_head.ckpt")
    with pytest.warns(UserWarning, match="the checkpoint holds no calibration head"):
        trainer.test(model, DataLoader(test, batch_size=50), ckpt_path=str(root / "ckpt" / "no_head.ckpt"), verbose=False)
    with pytest.raises(TypeError, match="holds a torchcal.calibrators.temperature.TemperatureScaling head"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(torchcal.VectorScaling())]).test(
            Classifier(), DataLoader(test, batch_size=50), ckpt_path=last, verbose=False
        )


class WithOwnCheckpointHooks(Classifier):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["own"] = "saved"

    def on_load_checkpoint(self, checkpoint):
        self.own = checkpoint["own"]


def test_weights_only_checkpoints_hold_the_head(tmp_path):
    """Lightning skips callbacks' checkpoint hooks for weights-only checkpoints but always calls the
    module's: the head goes in and comes out through them, after the module's own hooks."""
    callback = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce",))
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="best", monitor="calibration/nce", save_weights_only=True)
    trainer = Trainer(**{**TRAINER_DEFAULTS, "enable_checkpointing": True}, max_epochs=1, callbacks=[callback, checkpoints])
    trainer.fit(WithOwnCheckpointHooks(), loader(200, 0), loader(300, 1))
    trainer.save_checkpoint(tmp_path / "final.ckpt", weights_only=True)
    temperature = callback.calibrator.temperature
    for path in (checkpoints.best_model_path, tmp_path / "final.ckpt"):
        checkpoint = torch.load(path, weights_only=True)
        assert "callbacks" not in checkpoint and checkpoint["own"] == "saved"
        assert CalibratedModel.from_checkpoint(path, Classifier()).calibrator.temperature == temperature
    # the bare network instead of the LightningModule: the keys differ ("net.0.weight" / "0.weight")
    with pytest.raises(ValueError, match=r"do not fit the Sequential passed.*fresh instance of that LightningModule, or load_weights=False"):
        CalibratedModel.from_checkpoint(tmp_path / "final.ckpt", Classifier().net)
    bare = CalibratedModel.from_checkpoint(tmp_path / "final.ckpt", Classifier().net, load_weights=False)
    assert bare.calibrator.temperature == temperature
    fresh, model = CalibrationCallback(torchcal.TemperatureScaling()), WithOwnCheckpointHooks()
    Trainer(**TRAINER_DEFAULTS, callbacks=[fresh]).test(model, loader(100, 3), ckpt_path=checkpoints.best_model_path, verbose=False)
    assert fresh.calibrator.temperature == temperature and model.own == "saved"


def test_two_callbacks_keep_their_own_heads(tmp_path):
    """Two callbacks in one Trainer (they wrote one key, and the second head replaced the first in
    both on reload): each head comes back to its own callback, from_checkpoint chooses by prefix
    and says how when it must, and a checkpoint with one entry, as earlier versions wrote it, loads."""
    log = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce",), prefix="log/")
    brier = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce",), prefix="brier/", fit_options={"loss": "brier"},
                                attach=False)
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[log, brier])
    trainer.fit(Classifier(), loader(200, 0), loader(300, 1))
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    temperatures = [log.calibrator.temperature, brier.calibrator.temperature]
    assert temperatures[0] != temperatures[1]
    restored = [CalibrationCallback(torchcal.TemperatureScaling(), prefix=prefix, attach=prefix == "log/") for prefix in ("log/", "brier/")]
    Trainer(**TRAINER_DEFAULTS, callbacks=restored).test(Classifier(), loader(100, 3), ckpt_path=path, verbose=False)
    assert [callback.calibrator.temperature for callback in restored] == temperatures
    for prefix, temperature in zip(("log/", "brier/"), temperatures):
        assert CalibratedModel.from_checkpoint(path, Classifier(), prefix=prefix).calibrator.temperature == temperature
    with pytest.raises(ValueError, match=r"several CalibrationCallbacks: TemperatureScaling \(prefix='log/'\).*Choose one with prefix="):
        CalibratedModel.from_checkpoint(path, Classifier())
    with pytest.raises(ValueError, match="holds no head of a callback with prefix='other/'"):
        CalibratedModel.from_checkpoint(path, Classifier(), prefix="other/")
    with pytest.raises(ValueError, match="none of them this callback's"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(prefix="other/")]).test(
            Classifier(), loader(100, 3), ckpt_path=path, verbose=False
        )
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY] = checkpoint[CHECKPOINT_KEY][brier.state_key]
    torch.save(checkpoint, tmp_path / "one_entry.ckpt")
    assert CalibratedModel.from_checkpoint(tmp_path / "one_entry.ckpt", Classifier()).calibrator.temperature == temperatures[1]
    with pytest.raises(ValueError, match="give each its own prefix"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(), CalibrationCallback()]).test(
            Classifier(), loader(100, 3), ckpt_path=path, verbose=False
        )


def test_a_callback_that_has_not_fitted_takes_no_sibling_head(tmp_path):
    """A checkpoint saved while only one of two callbacks had fitted (the other fits at the end of
    fitting, every_n_epochs=0) holds one head: the other callback took it as its own, refusing the
    checkpoint where its class differed and silently keeping the wrong head where it matched
    (review finding)."""
    def callbacks():
        return [CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce",), prefix="ts/"),
                CalibrationCallback(torchcal.VectorScaling(), metrics=("nce",), prefix="late/", every_n_epochs=0, attach=False),
                CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce",), prefix="brier/", every_n_epochs=0,
                                    fit_options={"loss": "brier"}, attach=False)]

    saving = ModelCheckpoint(dirpath=tmp_path, filename="epoch{epoch}", save_top_k=-1)
    fitted = callbacks()
    trainer = Trainer(**{**TRAINER_DEFAULTS, "enable_checkpointing": True}, max_epochs=1, callbacks=[*fitted, saving])
    trainer.fit(Classifier(), loader(200, 0), loader(300, 1))
    checkpoint = torch.load(tmp_path / "epochepoch=0.ckpt", weights_only=True)
    assert sorted(checkpoint[CHECKPOINT_KEY]) == [fitted[0].state_key]
    restored = callbacks()
    Trainer(**TRAINER_DEFAULTS, callbacks=restored).test(Classifier(), loader(100, 3), ckpt_path=tmp_path / "epochepoch=0.ckpt", verbose=False)
    assert restored[0].calibrator.temperature == fitted[0].calibrator.temperature
    assert not restored[1].calibrator.is_fitted and not restored[2].calibrator.is_fitted


def test_only_one_callback_may_calibrate_the_outputs():
    """Two attached callbacks calibrated test and predict outputs twice, one head after the other
    (a temperature of T1 T2; review finding)."""
    both = [CalibrationCallback(torchcal.TemperatureScaling(), prefix="a/"), CalibrationCallback(torchcal.TemperatureScaling(), prefix="b/")]
    with pytest.raises(ValueError, match="several CalibrationCallbacks with attach=True"):
        Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=both).fit(Classifier(), loader(100, 0), loader(100, 1))


class SequenceOutputs(Classifier):
    """Returns the last step of (B, T, K) outputs: a view that keeps all T steps alive."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        steps = self(x).unsqueeze(1).expand(-1, 64, -1).contiguous()
        return {"logits": steps[:, -1], "labels": y}


class Keeping(CalibrationCallback):
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.kept = [(t.untyped_storage().nbytes(), t.numel() * t.element_size()) for batch in self._batches for t in batch]
        super().on_validation_epoch_end(trainer, pl_module)


def test_kept_validation_outputs_hold_no_more_than_themselves():
    """A view into a larger tensor was kept as it was: 64 times the logits' memory until the
    epoch's end (review finding). Also: calibrated_model() returns the network in eval mode (it
    came back in training mode after fit, its dropout making two calls differ), and a deep copy
    of the module (EMA / SWA weight averaging copies its forward hook, so the callback) leaves
    the Trainer out (it copied it with its datasets)."""
    import copy

    callback = Keeping(metrics=("nce",))
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[callback])
    model = SequenceOutputs()
    trainer.fit(model, loader(100, 0), loader(100, 1))
    assert callback.kept and all(held == own for held, own in callback.kept)
    assert model.training and not callback.calibrated_model(model).training and not model.training
    trainer.test(model, loader(50, 2), verbose=False)  # (the hook is there during test)
    callback.setup(trainer, model, "test")  # attached again, as in a run
    assert callback._latest is not None
    copied = copy.deepcopy(callback)  # (under DDP the last outputs hold the process group: not copied)
    assert copied._trainer is None and copied._batches == [] and copied._latest is None
    callback.teardown(trainer, model, "test")


FRESH_PROCESS = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_lightning import Classifier
from torchcal.heads import CalibratedModel
x, expected = torch.load({inputs!r})
head = CalibratedModel.from_checkpoint({checkpoint!r}, Classifier())
assert not head.training
with torch.no_grad():
    got = head(x)
program = torch.export.export(head, (x,), dynamic_shapes=({{0: torch.export.Dim("batch")}},))
with torch.no_grad():
    exported = program.module()(x[:7])
print(float((got - expected).abs().max()), float((exported - got[:7]).abs().max()))
"""


def test_head_loads_from_the_checkpoint_in_a_fresh_process_and_exports(trained, tmp_path):
    """CalibratedModel.from_checkpoint in a new interpreter (no Trainer, no callback) gives the
    calibrated outputs of the trained run, and the loaded model exports with torch.export."""
    _, model, callback, root = trained
    x = make_data(40, seed=6).tensors[0]
    with torch.no_grad():
        expected = callback.calibrated_model(model).eval()(x)
    torch.save((x, expected), tmp_path / "inputs.pt")
    code = FRESH_PROCESS.format(
        tests=str(Path(__file__).parent), inputs=str(tmp_path / "inputs.pt"), checkpoint=str(root / "ckpt" / "last.ckpt")
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded_error, export_error = map(float, done.stdout.split()[-2:])
    assert loaded_error == 0.0 and export_error < 1e-6


def test_from_checkpoint_errors(trained, tmp_path):
    _, model, _, root = trained
    with pytest.raises(TypeError, match="holds a torchcal.calibrators.temperature.TemperatureScaling head"):
        CalibratedModel.from_checkpoint(root / "ckpt" / "last.ckpt", Classifier(), torchcal.VectorScaling())
    torch.save({"state_dict": model.state_dict()}, tmp_path / "plain.ckpt")
    with pytest.raises(KeyError, match="holds no calibration head"):
        CalibratedModel.from_checkpoint(tmp_path / "plain.ckpt", Classifier())


def test_a_head_of_other_options_loads_into_the_calibrator_built_with_defaults(trained, tmp_path):
    """A head without biases, loaded into the stored class built with its defaults (or a callback's
    calibrator with biases), raised a bare "Missing key(s) in state_dict", then a message saying
    to build the calibrator alike; its state now records ``bias``, as the histogram's records its
    bins, and it loads."""
    _, model, _, root = trained
    data = make_data(300, seed=1)
    checkpoint = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)
    no_bias = torchcal.AffineCalibration(bias=False).fit(raw_outputs(model, data), data.tensors[1])
    checkpoint[CHECKPOINT_KEY] = head_checkpoint(no_bias)
    torch.save(checkpoint, tmp_path / "no_bias.ckpt")
    fitted_with_bias = torchcal.AffineCalibration().fit(raw_outputs(model, data), data.tensors[1])  # (its beta stayed: review finding)
    for calibrator in (None, torchcal.AffineCalibration(bias=False), torchcal.AffineCalibration(), fitted_with_bias):
        loaded = CalibratedModel.from_checkpoint(tmp_path / "no_bias.ckpt", Classifier(), calibrator)
        assert loaded.calibrator.bias is False and "beta" not in loaded.calibrator.state_dict()
        torch.testing.assert_close(loaded.calibrator.log_alpha, no_bias.log_alpha)
        torch.testing.assert_close(loaded.calibrator(raw_outputs(model, data)), no_bias(raw_outputs(model, data)), rtol=0, atol=0)
    # a checkpoint that pickles more than tensors (hyperparameters holding a Path) loads where trusted
    checkpoint["hyper_parameters"] = {"data_dir": Path("/data")}
    torch.save(checkpoint, tmp_path / "pickled.ckpt")
    with pytest.raises(Exception, match="Weights only load failed"):
        CalibratedModel.from_checkpoint(tmp_path / "pickled.ckpt", Classifier())
    assert CalibratedModel.from_checkpoint(tmp_path / "pickled.ckpt", Classifier(), weights_only=False).calibrator.bias is False
    callback = CalibrationCallback(torchcal.AffineCalibration())
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).test(Classifier(), loader(100, 3), ckpt_path=tmp_path / "no_bias.ckpt", verbose=False)
    assert callback.calibrator.bias is False


def digits_loaders() -> dict[str, DataLoader]:
    """scikit-learn's digits (8x8 images, 10 classes): train 600, validation 500, test 697."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x / 16, dtype=torch.float32)[perm], torch.tensor(y)[perm]
    parts = {"train": slice(0, 600), "val": slice(600, 1100), "test": slice(1100, None)}
    return {k: DataLoader(TensorDataset(x[p], y[p]), batch_size=100, shuffle=k == "train") for k, p in parts.items()}


class DigitsClassifier(Classifier):
    """An MLP on the digits whose validation_step returns the bare logits (labels from the batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def validation_step(self, batch, batch_idx):
        return self(batch[0])


class CountingTemperatureScaling(torchcal.TemperatureScaling):
    """Counts its fits and those of its copies (the cross-validation folds)."""

    fits = 0

    def fit(self, *args, **kwargs):
        type(self).fits += 1
        return super().fit(*args, **kwargs)


def test_fast_dev_run_fits_a_head_in_one_short_epoch():
    callback = CalibrationCallback(torchcal.VectorScaling(), metrics=("nce", "error"))
    trainer = Trainer(**TRAINER_DEFAULTS, fast_dev_run=2, callbacks=[callback])
    digits = digits_loaders()
    trainer.fit(DigitsClassifier(), digits["train"], digits["val"])
    assert callback.calibrator.is_fitted and callback.calibrator.num_classes == 10
    assert set(callback.report_["before"]) == {"nce", "error", "rcl"} and set(callback.report_["after"]) == {"nce", "error"}
    assert "calibration/error" in trainer.callback_metrics


def test_a_validation_set_smaller_than_the_folds_skips_the_rcl_and_the_report(recwarn):
    """4 validation samples, 5 folds: the report's cross-validation raised at the end of
    trainer.fit, after training, and the RCL's at the first validation epoch. Both are left out
    now, said once; the head is fitted and the other metrics logged."""
    data = make_data(4, seed=1)
    val = DataLoader(data, batch_size=4)
    callback = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce", "rcl"))
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=2, callbacks=[callback])
    trainer.fit(Classifier(), loader(100, seed=0, shuffle=True), val)
    assert callback.calibrator.is_fitted and callback.report_ is None
    assert math.isnan(float(trainer.callback_metrics["calibration/rcl"]))
    assert math.isfinite(float(trainer.callback_metrics["calibration/nce"]))
    said = [str(w.message) for w in recwarn if "validation samples" in str(w.message)]
    assert len(said) == 1 and "at least 5 validation samples (the fewest: 4)" in said[0]


@pytest.mark.parametrize(("every_n_epochs", "epochs", "head_fits"), [(2, 4, 2), (0, 2, 1)])
def test_every_n_epochs_fits_and_logs_only_then(every_n_epochs, epochs, head_fits, tmp_path):
    """Digits, a few epochs: the head and the metrics every n-th epoch (0: once, at the end), the
    refinement loss every epoch; the report costs `folds` fits and none on calibrated scores."""
    CountingTemperatureScaling.fits = 0
    callback = CalibrationCallback(CountingTemperatureScaling(), metrics=("nce", "refinement"), every_n_epochs=every_n_epochs)
    model, digits = DigitsClassifier(), digits_loaders()
    trainer = Trainer(**{**TRAINER_DEFAULTS, "logger": CSVLogger(tmp_path)}, max_epochs=epochs, callbacks=[callback])
    trainer.fit(model, digits["train"], digits["val"])
    assert CountingTemperatureScaling.fits == head_fits + callback.folds
    rows = [r for r in csv.DictReader(open(next(tmp_path.glob("**/metrics.csv")))) if r.get("calibration/refinement")]
    assert [int(r["epoch"]) for r in rows] == list(range(epochs))
    assert [int(r["epoch"]) for r in rows if r.get("calibration/nce")] == [e for e in range(epochs) if every_n_epochs and (e + 1) % every_n_epochs == 0]
    # the head matches the final weights (refitted at the end when the last epoch was not a fit epoch)
    val_x, val_y = digits["val"].dataset.tensors
    logits = raw_outputs(model, digits["val"].dataset, batch_size=100)
    assert callback.calibrator.temperature == pytest.approx(torchcal.TemperatureScaling().fit(logits, val_y).temperature, rel=1e-9)


def test_the_fits_warnings_come_once_named_as_the_callbacks(recwarn):
    """A validation set without one class: the head's fit every epoch, and its folds' fits, warned
    of the missing class every time (23 lines in 3 epochs, at a line in Lightning). Once now, as
    the callback's."""
    data = make_data(300, seed=1)
    kept = data.tensors[1] != 2
    val = DataLoader(TensorDataset(data.tensors[0][kept], data.tensors[1][kept]), batch_size=50)
    callback = CalibrationCallback(torchcal.VectorScaling(), metrics=("nce", "rcl"))
    Trainer(**TRAINER_DEFAULTS, max_epochs=3, callbacks=[callback]).fit(Classifier(), loader(200, seed=0, shuffle=True), val)
    missing = [str(w.message) for w in recwarn if "have no sample in the calibration data" in str(w.message)]
    assert len(missing) == 1 and missing[0].startswith("CalibrationCallback: classes [2] have no sample")


def test_early_stopping_and_checkpointing_monitor_the_refinement_loss(tmp_path):
    """EarlyStopping and ModelCheckpoint monitor calibration/refinement, logged every epoch (also
    between fits); the monitored values are the refinement losses of the epochs' outputs."""
    digits = digits_loaders()
    callback = CalibrationCallback(metrics=("refinement",), every_n_epochs=3, report=False)
    stopping = EarlyStopping(monitor="calibration/refinement", patience=1, min_delta=0.01)
    best = ModelCheckpoint(dirpath=tmp_path, monitor="calibration/refinement", filename="best")
    model = DigitsClassifier()
    trainer = Trainer(**{**TRAINER_DEFAULTS, "enable_checkpointing": True}, max_epochs=30, callbacks=[callback, stopping, best])
    trainer.fit(model, digits["train"], digits["val"])
    assert 0 < stopping.stopped_epoch < 29  # stopped early on the refinement loss
    val_y = digits["val"].dataset.tensors[1]
    final = refinement_loss(raw_outputs(model, digits["val"].dataset, batch_size=100), val_y)
    assert float(trainer.callback_metrics["calibration/refinement"]) == pytest.approx(float(final), rel=1e-6)
    assert float(best.best_model_score) == pytest.approx(float(stopping.best_score), rel=1e-12)
    restored = DigitsClassifier()
    restored.load_state_dict(torch.load(best.best_model_path, weights_only=True)["state_dict"])
    assert float(refinement_loss(raw_outputs(restored, digits["val"].dataset, batch_size=100), val_y)) == pytest.approx(
        float(best.best_model_score), rel=1e-6
    )


class DivergingDigitsClassifier(DigitsClassifier):
    """Its validation outputs turn NaN from epoch 2 (a diverged network), in one row or in all."""

    def __init__(self, rows: int | None = None) -> None:
        super().__init__()
        self.rows = rows

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0])
        if self.current_epoch >= 2 and (batch_idx == 0 or self.rows is None):
            logits = logits.clone()
            logits[: self.rows] = math.nan
        return logits


@pytest.mark.parametrize(("rows", "every_n_epochs", "output"), [(None, 1, "logits"), (1, 0, "logits"), (1, 1, "probs")])
def test_outputs_that_turn_nan_end_the_run_through_early_stopping(rows, every_n_epochs, output, recwarn):
    """A network whose validation outputs turn NaN: the callback raised from the head's fit (or the
    refinement loss's, or the probabilities' check), killing trainer.fit, where EarlyStopping
    (check_finite=True) would have ended the run (a review). Now the metrics are NaN, with one
    warning, EarlyStopping stops the run, and the head keeps the last finite epoch's fit."""

    class Model(DivergingDigitsClassifier):
        def validation_step(self, batch, batch_idx):
            logits = super().validation_step(batch, batch_idx)
            return logits.softmax(1) if output == "probs" else logits

    digits = digits_loaders()
    callback = CalibrationCallback(metrics=("nce", "refinement"), every_n_epochs=every_n_epochs, output=output)
    stopping = EarlyStopping(monitor="calibration/refinement", patience=5)
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=6, callbacks=[callback, stopping])
    model = Model(rows)
    trainer.fit(model, digits["train"], digits["val"])
    assert stopping.stopped_epoch == 2 and trainer.current_epoch == 3
    assert math.isnan(float(trainer.callback_metrics["calibration/refinement"]))
    warned = [str(w.message) for w in recwarn if "NaN or infinite outputs" in str(w.message)]
    assert len(warned) == 1 and warned[0].startswith(f"CalibrationCallback: {rows or 500} validation rows hold NaN")
    assert not any("no validation epoch ran" in str(w.message) for w in recwarn)
    assert callback.report_ is None  # (the end of fitting fitted nothing on NaN outputs)
    assert callback.calibrator.is_fitted == (every_n_epochs > 0)  # (epoch 1's head, fitted on finite outputs)


class SeveralValidationLoaders(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))  # Lightning suffixes it with the loader's index
        return logits


def test_several_validation_loaders_log_the_first_loaders_metrics_under_its_name(trained):
    """With two validation loaders the metrics are the first loader's and are named for it
    (``/dataloader_idx_0``): the second loader's results hold no plain calibration keys that
    would pass loader 0's numbers off as its own; fit's validation logs them alike."""
    _, model, _, _ = trained
    net = SeveralValidationLoaders()
    net.load_state_dict(model.state_dict())
    val, test = make_data(300, seed=1), make_data(200, seed=7)
    callback = CalibrationCallback(metrics=("nce", "refinement"))
    results = Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(
        net, [DataLoader(val, batch_size=50), DataLoader(test, batch_size=50)], verbose=False
    )
    logits = raw_outputs(net, val, batch_size=50)
    expected = {
        "calibration/nce/dataloader_idx_0": float(cross_entropy(logits, val.tensors[1], normalize=True)),
        "calibration/refinement/dataloader_idx_0": float(refinement_loss(logits, val.tensors[1])),
    }
    test_nce = float(cross_entropy(raw_outputs(net, test, batch_size=50), test.tensors[1], normalize=True))
    assert abs(test_nce - expected["calibration/nce/dataloader_idx_0"]) > 1e-3  # the loaders differ
    for index, result in enumerate(results):
        assert not any(key.startswith("calibration/") and "/dataloader_idx_" not in key for key in result)
        assert "calibration/nce/dataloader_idx_1" not in result
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, rel=1e-6)
        assert f"val_loss/dataloader_idx_{index}" in result
    # trainer.fit with two validation loaders: EarlyStopping monitors the first loader's key
    stopping = EarlyStopping(monitor="calibration/refinement/dataloader_idx_0", patience=5)
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=2, callbacks=[CalibrationCallback(report=False), stopping])
    trainer.fit(SeveralValidationLoaders(), loader(200, seed=0, shuffle=True), [loader(300, seed=1), loader(200, seed=7)])
    assert stopping.best_score.isfinite() and "calibration/refinement" not in trainer.callback_metrics


class InferenceModeProbe(CalibrationCallback):
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.inference_mode = torch.is_inference_mode_enabled()
        super().on_validation_epoch_end(trainer, pl_module)


def test_validate_on_request_calibrates_a_trained_model_under_inference_mode(trained):
    """trainer.validate fits the head on the given data when asked, without training, inside the
    torch.inference_mode() of the default Trainer (fit's validation uses no_grad instead)."""
    _, model, _, _ = trained
    callback = InferenceModeProbe(torchcal.AffineCalibration(), metrics=("nce", "rcl"), fit_on_validate=True)
    data = make_data(200, seed=4)
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(model, DataLoader(data, batch_size=64), verbose=False)
    assert callback.inference_mode
    expected = torchcal.AffineCalibration().fit(raw_outputs(model, data, batch_size=64), data.tensors[1])
    torch.testing.assert_close(callback.calibrator.beta, expected.beta, rtol=0, atol=1e-8)
    assert not callback.calibrator.beta.is_inference()


def test_validate_does_not_refit_the_head_unless_asked(trained):
    """trainer.validate(model, test_loader) evaluates (logs the metrics of that loader) but never
    refits the head on it."""
    trainer, model, callback, _ = trained
    fitted = head_state(callback)
    test = make_data(200, seed=7)
    validator = Trainer(**TRAINER_DEFAULTS, callbacks=[callback])
    validator.validate(model, DataLoader(test, batch_size=50), verbose=False)
    assert all(torch.equal(v, head_state(callback)[k]) for k, v in fitted.items())
    logits = raw_outputs(model, test, batch_size=50)
    assert float(validator.callback_metrics["calibration/nce"]) == pytest.approx(
        float(cross_entropy(logits, test.tensors[1], normalize=True)), rel=1e-6
    )


# ------------------------------------------------------------------------------------ misuse
class LossOnlyValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class ForwardBypassedInTest(Classifier):
    def test_step(self, batch, batch_idx):
        self.log("test_nll", F.cross_entropy(self.net(batch[0]), batch[1]))


def test_no_validation_logits_says_how_to_provide_them():
    """Said in the sanity check, before the first training epoch (it came after one: review finding)."""
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[CalibrationCallback()])
    model = LossOnlyValidation()
    with pytest.raises(RuntimeError, match=r"found no validation logits.*override extract\(\)"):
        trainer.fit(model, loader(100, 0), loader(100, 1))
    assert trainer.global_step == 0  # (no training step ran)


class DictBatches(Classifier):
    def validation_step(self, batch, batch_idx):
        return self(batch["x"])


class OneScoreColumn(Classifier):
    def validation_step(self, batch, batch_idx):
        return self(batch[0])[:, 1]


def test_logits_without_labels_or_of_the_wrong_shape_say_so():
    """Both read "found no validation logits: validation_step returned Tensor", though the logits
    were there: the labels were under another key of a dict batch, or the logits had no class axis."""
    data = make_data(100, seed=1)
    dict_batches = DataLoader([{"x": x, "target": y} for x, y in zip(*data.tensors)], batch_size=50)
    validate = Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(fit_on_validate=True)]).validate
    with pytest.raises(RuntimeError, match=r"found the validation logits but no labels: labels_key='labels' .*\['target', 'x'\]"):
        validate(DictBatches(), dict_batches, verbose=False)
    callback = CalibrationCallback(fit_on_validate=True, labels_key="target")
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(DictBatches(), dict_batches, verbose=False)
    assert callback.calibrator.is_fitted
    with pytest.raises(RuntimeError, match=r"needs validation logits of shape \(B, K\).*got \(50,\)"):
        validate(OneScoreColumn(), DataLoader(data, batch_size=50), verbose=False)


class TupleValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return self(x), y


def test_extract_override_collects_from_elsewhere(trained):
    """The reference logits come from the same batches of 64 as the validation loop's: float32
    matrix products of different batch shapes may differ in the last bit (6e-8 here, issue 15),
    which moves the fitted temperature by more than rel=1e-9; the same batches give the same bits."""

    class FromTuple(CalibrationCallback):
        def extract(self, outputs, batch):
            return outputs

    _, model, _, _ = trained
    network = TupleValidation()
    network.load_state_dict(model.state_dict())
    callback = FromTuple(metrics=("nce",), fit_on_validate=True)
    data = make_data(200, seed=4)
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(network, DataLoader(data, batch_size=64), verbose=False)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, data, batch_size=64), data.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-9)


class WithFeatures(Classifier):
    """forward returns (logits, features), as networks with an embedding head do."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.net[1](self.net[0](x))
        return self.net[2](features), features

    def validation_step(self, batch, batch_idx):
        return self(batch[0])  # (logits, features); labels from the batch

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_nll", F.nll_loss(self(x)[0], y))


def test_tuple_outputs_in_validation_test_and_predict(trained):
    """logits_key=0: the logits of (logits, features) are collected in validation, calibrated in
    test and predict, and the features pass through unchanged."""
    _, model, _, _ = trained
    network = WithFeatures()
    network.load_state_dict(model.state_dict())
    callback = CalibrationCallback(metrics=("nce",), logits_key=0, fit_on_validate=True)
    trainer = Trainer(**TRAINER_DEFAULTS, callbacks=[callback])
    val, test = make_data(200, seed=4), make_data(100, seed=5)
    trainer.validate(network, DataLoader(val, batch_size=50), verbose=False)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, val, batch_size=50), val.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-9)
    predictions = trainer.predict(network, DataLoader(test, batch_size=50))
    logits, features = (torch.cat(parts) for parts in zip(*predictions))
    network.eval()
    with torch.no_grad():
        raw_logits, raw_features = network(test.tensors[0])
        torch.testing.assert_close(logits, expected(raw_logits), rtol=0, atol=1e-6)
    torch.testing.assert_close(features, raw_features)
    nll = trainer.test(network, DataLoader(test, batch_size=50), verbose=False)[0]["test_nll"]
    assert nll == pytest.approx(float(F.nll_loss(expected(raw_logits), test.tensors[1])), rel=1e-5)
    with torch.no_grad():  # the same structure from the exportable module
        head_logits, head_features = callback.calibrated_model(network).eval()(test.tensors[0])
    torch.testing.assert_close(head_logits, logits, rtol=0, atol=1e-6)


class ProbsClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.val_nce = CrossEntropy(num_classes=K, normalize=True, input="probs")
        self.val_ece = CalibrationError(num_classes=K, input="probs")

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(self.net(x), dim=1)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_nll", F.nll_loss(torch.log(self(x)), y))


def test_probability_outputs_are_calibrated_as_probabilities(trained):
    _, model, _, _ = trained
    network = ProbsClassifier()
    network.load_state_dict(model.state_dict())
    callback = CalibrationCallback(output="probs", metrics=("nce",), fit_on_validate=True)
    trainer = Trainer(**TRAINER_DEFAULTS, callbacks=[callback])
    data = make_data(200, seed=4)
    trainer.validate(network, DataLoader(data, batch_size=64), verbose=False)
    logits = raw_outputs(model, data)
    expected = torchcal.TemperatureScaling().fit(logits, data.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-6)
    assert float(trainer.callback_metrics["calibration/nce"]) == pytest.approx(
        float(cross_entropy(logits, data.tensors[1], normalize=True)), rel=1e-5
    )
    probs = torch.cat(trainer.predict(network, DataLoader(data, batch_size=64)))
    with torch.no_grad():
        torch.testing.assert_close(probs, expected(logits).exp(), rtol=0, atol=1e-6)
    # Logits declared as probabilities fail with a clear message.
    with pytest.raises(ValueError, match="network outputs must lie in"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(output="probs")]).validate(
            model, DataLoader(data, batch_size=64), verbose=False
        )


def test_probabilities_declared_as_logits_are_named_once(trained, recwarn):
    """The outputs' check, the head's fit and the metrics each warned that the scores look like
    probabilities (three lines saying one thing); now only the first, which names output=."""
    _, model, _, _ = trained
    network = ProbsClassifier()
    network.load_state_dict(model.state_dict())
    callback = CalibrationCallback(torchcal.VectorScaling(), metrics=("nce", "ece", "rcl"), fit_on_validate=True)
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(network, DataLoader(make_data(200, seed=4), batch_size=64), verbose=False)
    said = [str(w.message) for w in recwarn if "look like probabilities" in str(w.message)]
    assert said == ["CalibrationCallback: the network outputs look like probabilities (rows in [0, 1] summing to one) "
                    "but output='logits'; pass output='probs' if they are."]


def test_a_head_restores_only_into_a_callback_of_its_output_kind(trained, tmp_path):
    """A head fitted on probabilities, restored into a callback with output="logits", was fed
    probabilities as logits without a word; "logits" and "log_probs" are the same domain."""
    _, model, callback, root = trained
    network = ProbsClassifier()
    network.load_state_dict(model.state_dict())
    data = DataLoader(make_data(100, seed=4), batch_size=50)
    trainer = Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback(output="probs", metrics=("nce",), fit_on_validate=True)])
    trainer.validate(network, data, verbose=False)
    trainer.save_checkpoint(tmp_path / "probs.ckpt")
    with pytest.raises(ValueError, match="fitted on outputs of kind 'probs' but this callback has output='logits'"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback()]).predict(network, data, ckpt_path=tmp_path / "probs.ckpt")
    log_probs = CalibrationCallback(output="log_probs")
    Trainer(**TRAINER_DEFAULTS, callbacks=[log_probs]).test(model, data, ckpt_path=root / "ckpt" / "last.ckpt", verbose=False)
    assert log_probs.calibrator.temperature == callback.calibrator.temperature


def test_warnings_when_test_outputs_are_not_calibrated(trained):
    _, model, callback, _ = trained
    test = DataLoader(make_data(100, seed=3), batch_size=50)
    with pytest.warns(UserWarning, match="no fitted head"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback()]).test(model, test, verbose=False)
    bypass = ForwardBypassedInTest()
    bypass.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="forward was never called during test"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).test(bypass, test, verbose=False)


def test_a_fit_without_validation_says_it_fitted_no_head():
    """It ended silently with no head; the first word came only from trainer.test."""
    callback = CalibrationCallback()
    with pytest.warns(UserWarning, match="no validation epoch ran in trainer.fit"):
        Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[callback]).fit(Classifier(), loader(100, 0))
    assert not callback.calibrator.is_fitted



def test_a_second_fit_without_validation_keeps_no_report_of_the_first(tmp_path):
    """The first fit's report stayed ``report_``, and a second fit without validation logged it
    again as its own (review finding)."""
    callback = CalibrationCallback(metrics=("nce",))
    model = Classifier()
    Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[callback]).fit(model, loader(100, 0), loader(100, 1))
    assert callback.report_ is not None
    logger = CSVLogger(tmp_path)
    Trainer(**{**TRAINER_DEFAULTS, "logger": logger}, max_epochs=1, callbacks=[callback]).fit(model, loader(100, 2))
    assert callback.report_ is None and callback.calibrator.is_fitted  # (the first fit's head stays)
    logged = Path(logger.log_dir) / "metrics.csv"
    assert not logged.exists() or "calibration/before" not in logged.read_text()

def test_argument_errors():
    with pytest.raises(TypeError, match="torchcal calibrator"):
        CalibrationCallback(nn.Identity())
    with pytest.raises(ValueError, match="unknown metrics"):
        CalibrationCallback(metrics=("nce", "accuracy"))
    with pytest.raises(ValueError, match="output must be one of"):
        CalibrationCallback(output="softmax")
    with pytest.raises(RuntimeError, match="no report yet"):
        CalibrationCallback().table()
    with pytest.raises(ValueError, match="every_n_epochs must be an integer >= 0"):
        CalibrationCallback(every_n_epochs=-1)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"folds": 1}, ValueError, r"folds .* must be an integer >= 2, got 1"),
        ({"n_bins": 0}, ValueError, "n_bins must be an integer >= 1, got 0"),
        ({"prefix": None}, TypeError, "prefix must be a string"),
        ({"logits_key": 1.5}, TypeError, "logits_key must be a dict key"),
        ({"labels_key": 1}, TypeError, "labels_key must be a string"),
        ({"fit_options": {"max_iters": 10}}, ValueError, r"unknown fit_options \['max_iters'\]: TemperatureScaling.fit takes \[.*'max_iter'"),
        ({"fit_options": {"process_group": None}}, ValueError, r"unknown fit_options \['process_group'\]"),
        ({"fit_options": {"loss": "hinge"}}, ValueError, r"fit_options\['loss'\] must be one of \['brier', 'log'\]"),
        ({"fit_options": {"max_iter": 0}}, ValueError, r"fit_options\['max_iter'\] must be an integer >= 1"),
    ],
)
def test_configuration_errors_are_raised_at_construction(arguments, error, message):
    """Settings that the callback accepted and that failed only after training (folds=1 in the
    end-of-fit report) or at the first validation epoch."""
    with pytest.raises(error, match=message):
        CalibrationCallback(**arguments)
    CalibrationCallback(fit_options={"loss": "brier", "max_iter": 50, "priors": None, "warm_start": True}, folds=2, prefix="")


def test_importing_torchcal_does_not_import_lightning():
    code = "import sys, torchcal; sys.exit('lightning' in sys.modules or 'torchcal.lightning' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -------------------------------------------------------------------------------------- DDP
DDP_DATA = make_data(300, seed=5)


class RankSplitClassifier(Classifier):
    """With 2 processes, process 0 validates the first 170 samples and process 1 the other 130
    (no sampler), so the union in rank order is exactly the 1-process data; batches of 10 make the
    network's outputs bitwise those of a 1-process run."""

    def val_dataloader(self) -> DataLoader:
        part = [slice(0, 300)] if self.trainer.world_size == 1 else [slice(0, 170), slice(170, 300)]
        part = part[self.global_rank]
        return DataLoader(TensorDataset(*(t[part] for t in DDP_DATA.tensors)), batch_size=10)


class SavingCallback(CalibrationCallback):
    """Saves every process's head, logged metrics, number of local validation outputs and
    warnings, which a child process cannot return."""

    def __init__(self, out: Path, calibrator: torchcal.Calibrator | None = None, **kwargs) -> None:
        super().__init__(calibrator or torchcal.VectorScaling(), metrics=("nce", "rcl", "refinement"), fit_on_validate=True, **kwargs)
        self.out = out

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.local_count = sum(len(y) for _, y in self._batches)
        super().on_validation_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)}
        torch.save(
            {"head": self._calibrator.state_dict(), "metrics": metrics, "count": self.local_count, "warned": sorted(self._warned)},
            self.out / f"rank{trainer.global_rank}.pt",
        )


def test_ddp_two_processes_fit_the_same_head_as_one(tmp_path):
    """Two gloo processes, each with its own part of the validation set: the head (fitted
    data-parallel with process_group, no outputs gathered) and the metrics equal one process's.
    The RCL's folds are the unions of per-process folds, so it is compared with its own
    reference: a single-process cross-validation over the same folds."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    # ddp_fork: DDPStrategy with two CPU processes forked from this one (no re-import, so fast).
    Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, use_distributed_sampler=False,
            callbacks=[SavingCallback(tmp_path / "ddp")]).validate(RankSplitClassifier(), verbose=False)
    Trainer(**TRAINER_DEFAULTS, callbacks=[SavingCallback(tmp_path / "one")]).validate(RankSplitClassifier(), verbose=False)
    one = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in (0, 1)]
    assert [r["count"] for r in ranks] == [170, 130] and one["count"] == 300  # nothing gathered
    reference = torchcal.VectorScaling()
    reference.load_state_dict(one["head"])
    for r in ranks:
        head = torchcal.VectorScaling()
        head.load_state_dict(r["head"])
        torch.testing.assert_close(head.weight, reference.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(head.bias, reference.bias, rtol=0, atol=1e-6)
        for name in ("nce", "refinement"):
            assert r["metrics"]["calibration/" + name] == pytest.approx(one["metrics"]["calibration/" + name], rel=1e-6)
        assert r["warned"] == []
    assert all(torch.equal(v, ranks[1]["head"][k]) for k, v in ranks[0]["head"].items() if k != "_extra_state")
    # the RCL over folds that are unions of the two processes' stratified folds
    model = RankSplitClassifier()
    logits, labels = raw_outputs(model, DDP_DATA, batch_size=10), DDP_DATA.tensors[1]
    parts = [slice(0, 170), slice(170, 300)]
    folds = [torch.cat([torchcal.fit.fold_indices(labels[p], 5, scores=logits[p])[f] + p.start for p in parts]) for f in range(5)]
    out_of_fold = torch.empty_like(logits)
    for test in folds:
        train = torch.ones(300, dtype=torch.bool)
        train[test] = False
        out_of_fold[test] = torchcal.VectorScaling().fit(logits[train], labels[train])(logits[test]).detach()
    rcl = 100 * (1 - cross_entropy(out_of_fold, labels) / cross_entropy(logits, labels))
    assert ranks[0]["metrics"]["calibration/rcl"] == pytest.approx(float(rcl), rel=1e-5)



class NaNOnRankOne(RankSplitClassifier):
    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        return {**out, "logits": torch.full_like(out["logits"], math.nan)} if self.global_rank == 1 else out


class BadProbabilitiesOnRankOne(RankSplitClassifier):
    def validation_step(self, batch, batch_idx):
        probs = super().validation_step(batch, batch_idx)["logits"].softmax(dim=1)
        return {"logits": 1.3 * probs if self.global_rank == 1 else probs}


class RecordingErrors(CalibrationCallback):
    def __init__(self, out: Path, output: str = "logits") -> None:
        super().__init__(metrics=("nce",), output=output)
        self.out = out

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            super().on_validation_epoch_end(trainer, pl_module)
        except ValueError as err:
            (self.out / f"rank{trainer.global_rank}.txt").write_text(str(err))
            raise


def test_ddp_bad_outputs_on_one_process_are_named_on_every_process(tmp_path):
    """The metrics-only path (trainer.validate without fit_on_validate) checked each process's
    outputs alone: the process with probabilities that sum to 1.3 said so, the other waited in the
    metric's sync and got gloo's "Connection closed by peer" (review findings)."""
    trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, use_distributed_sampler=False,
                      callbacks=[RecordingErrors(tmp_path, "probs")])
    with pytest.raises(Exception, match="must sum to one|refused its shard"):  # (the first process to fail: either)
        trainer.validate(BadProbabilitiesOnRankOne(), verbose=False)
    assert "must sum to one" in (tmp_path / "rank1.txt").read_text()
    assert "another process of the group refused its shard" in (tmp_path / "rank0.txt").read_text()


@pytest.mark.parametrize("fit_on_validate", [False, True])
def test_ddp_nan_outputs_on_one_process_give_nan_metrics_on_every_process(fit_on_validate):
    """NaN logits on one process: both processes log NaN metrics and fit nothing, together (one
    that skipped the fit's sums alone would leave the other waiting in them)."""
    callback = CalibrationCallback(metrics=("nce", "refinement"), fit_on_validate=fit_on_validate)
    trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, use_distributed_sampler=False, callbacks=[callback])
    results = trainer.validate(NaNOnRankOne(), verbose=False)  # (the processes' warnings stay in them)
    assert math.isnan(results[0]["calibration/nce"]) and math.isnan(results[0]["calibration/refinement"])


class RecordingTestHead(CalibrationCallback):
    def __init__(self, out: Path) -> None:
        super().__init__(metrics=("nce",))
        self.out = out

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save(self._calibrator.state_dict() if self._calibrator.is_fitted else None, self.out / f"test{trainer.global_rank}.pt")
        super().on_test_epoch_start(trainer, pl_module)


def test_ddp_fork_test_after_fit_goes_through_the_fitted_head(tmp_path):
    """ddp_fork forks trainer.test's workers from the main process, whose callback had not read
    the head the fit's worker left: the test ran uncalibrated (review finding)."""
    callback = RecordingTestHead(tmp_path)
    trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, max_epochs=1, callbacks=[callback])
    trainer.fit(Classifier(), loader(200, 0), loader(300, 1))
    trainer.test(trainer.lightning_module, DataLoader(make_data(100, seed=3), batch_size=50), verbose=False)
    for rank in (0, 1):
        head = torch.load(tmp_path / f"test{rank}.pt", weights_only=True)
        assert head is not None
        assert all(torch.equal(v, head[k]) for k, v in callback.calibrator.state_dict().items() if k != "_extra_state")



def test_ddp_fork_a_second_fit_keeps_its_own_head(tmp_path):
    """Two fits under ddp_fork, the main process reading nothing between them: the second fit's
    workers, reading the callback's head for their checkpoints, reloaded the first fit's hand-off
    over their own, and it came back (the diff review)."""
    callback = CalibrationCallback(metrics=("nce",))
    Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, max_epochs=1, callbacks=[callback]).fit(Classifier(), loader(200, 0), loader(300, 1))
    model = Classifier()
    Trainer(**{**TRAINER_DEFAULTS, "enable_checkpointing": True}, default_root_dir=tmp_path, strategy="ddp_fork", devices=2,
            max_epochs=2, callbacks=[callback]).fit(model, loader(200, 5), loader(300, 7))
    validation = make_data(300, seed=7)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, validation), validation.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-6)

def test_ddp_spawn_returns_the_head_to_the_main_process(tmp_path):
    """ddp_spawn trains in two spawned processes: the main process ends with their head and report
    (not an unfitted one), so trainer.test there is calibrated. Histogram binning cannot fit
    data-parallel: it falls back to gathering, with a warning; the sampler pads 301 validation
    samples to 302, with a warning."""
    callback = SavingCallback(tmp_path, torchcal.HistogramBinning(n_bins=5))
    trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp_spawn", devices=2, max_epochs=1, callbacks=[callback])
    trainer.fit(Classifier(), loader(200, 0), loader(301, 1))
    trainer.save_checkpoint(tmp_path / "final.ckpt")  # before anything reads the head: it must be in it
    assert CHECKPOINT_KEY in torch.load(tmp_path / "final.ckpt", weights_only=True)
    worker = torch.load(tmp_path / "rank0.pt")
    assert set(worker["warned"]) == {"gather", "padding"}
    assert worker["count"] == 151  # per process: 301 padded to 302
    assert callback.calibrator.is_fitted and callback.report_ is not None
    assert all(torch.equal(v, worker["head"][k]) for k, v in callback.calibrator.state_dict().items() if k != "_extra_state")
    # trainer.test(ckpt_path=...) runs in the workers too: neither that checkpoint's weights nor its
    # head come back (its head used to, leaving the main process with it on the final weights)
    other = torch.load(tmp_path / "final.ckpt", weights_only=False)
    for entry in other[CHECKPOINT_KEY].values():
        entry["state_dict"]["values"] = 1 - entry["state_dict"]["values"]
    torch.save(other, tmp_path / "other.ckpt")
    head = {k: v.clone() for k, v in callback.calibrator.state_dict().items() if k != "_extra_state"}
    trainer.test(trainer.lightning_module, DataLoader(make_data(100, seed=3), batch_size=50), ckpt_path=tmp_path / "other.ckpt", verbose=False)
    assert all(torch.equal(v, head[k]) for k, v in callback.calibrator.state_dict().items() if k != "_extra_state")
    model = trainer.lightning_module  # the trained weights come back too
    test = make_data(100, seed=3)
    tester = Trainer(**TRAINER_DEFAULTS, callbacks=[callback])
    nll = tester.test(model, DataLoader(test, batch_size=50), verbose=False)[0]["test_nll"]
    with torch.no_grad():
        expected = F.nll_loss(callback.calibrator(raw_outputs(model, test, batch_size=50)), test.tensors[1])
    assert nll == pytest.approx(float(expected), rel=1e-5)
    # trainer.validate refits the head (fit_on_validate) on the main process's weights: it comes back
    trainer.validate(model, DataLoader(make_data(151, seed=4), batch_size=50), verbose=False)
    worker = torch.load(tmp_path / "rank0.pt")
    assert not all(torch.equal(v, head[k]) for k, v in worker["head"].items() if k != "_extra_state")
    assert all(torch.equal(v, worker["head"][k]) for k, v in callback.calibrator.state_dict().items() if k != "_extra_state")


def test_ddp_padding_of_a_dict_of_validation_loaders_is_named(tmp_path):
    """A dict of validation loaders (which Lightning accepts) skipped the padding check: 301
    samples padded to 302, with no warning (review finding)."""
    trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, callbacks=[SavingCallback(tmp_path)])
    trainer.validate(Classifier(), {"val": loader(301, 1)}, verbose=False)
    worker = torch.load(tmp_path / "rank0.pt")
    assert "padding" in worker["warned"] and worker["count"] == 151


def test_weights_changed_after_the_last_validation_are_named():
    """StochasticWeightAveraging puts its average into the module at the end of training, after
    the last validation: the head belonged to the weights before, silently (review finding: a
    test NLL of 0.633 through the head against 0.610 uncalibrated). The callback says so, and
    trainer.validate with fit_on_validate refits the head on the final weights."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callback = CalibrationCallback(metrics=("nce",))
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=3, callbacks=[callback, StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
    with pytest.warns(UserWarning, match="weights changed after the last validation epoch"):
        trainer.fit(Classifier(), loader(200, 0, shuffle=True), loader(300, 1))
    # and again for the next fit (it was said once per callback: the diff review)
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=3, callbacks=[callback, StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
    model = Classifier()
    with pytest.warns(UserWarning, match="weights changed after the last validation epoch"):
        trainer.fit(model, loader(200, 2, shuffle=True), loader(300, 1))
    stale = callback.calibrator.temperature
    callback.fit_on_validate = True
    trainer.validate(model, loader(300, 1), verbose=False)
    validation = make_data(300, seed=1)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, validation, batch_size=50), validation.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-6) != stale


@pytest.mark.parametrize("averaging_first", [True, False])
def test_no_stale_head_warning_when_the_last_validation_saw_the_final_weights(averaging_first):
    """Lightning's WeightAveraging validates on the averaged weights and puts them in at the end:
    the head is theirs. Listed before the callback, its epoch-end hook had swapped the averaged
    weights out before the callback read them, which then warned falsely (the diff review)."""
    from lightning.pytorch.callbacks import WeightAveraging

    callback = CalibrationCallback(metrics=("nce",))
    model = Classifier()
    callbacks = [WeightAveraging(), callback] if averaging_first else [callback]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|num_workers|log_every_n_steps).*")
        Trainer(**TRAINER_DEFAULTS, max_epochs=2, callbacks=callbacks).fit(model, loader(200, 0, shuffle=True), loader(300, 1))
    assert "stale" not in callback._warned
    validation = make_data(300, seed=1)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, validation, batch_size=50), validation.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-6)


DDP_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from lightning.pytorch import Trainer
import torchcal
from torchcal.lightning import CalibrationCallback
from test_lightning import TRAINER_DEFAULTS, Classifier, loader, make_data

callback = CalibrationCallback(torchcal.TemperatureScaling(), metrics=("nce", "refinement"))
trainer = Trainer(**TRAINER_DEFAULTS, strategy="ddp", devices=2, max_epochs=2, callbacks=[callback])
model = Classifier()
trainer.fit(model, loader(200, 0), loader(300, 1))
logged = {{k: float(v) for k, v in trainer.callback_metrics.items()}}
torch.save({{"temperature": callback.calibrator.temperature, "logged": logged, "weights": model.state_dict(),
            "warned": sorted(callback._warned)}}, {out!r}.format(trainer.global_rank))
# Leave together and tear the group down: a process exiting while its peer's gloo threads still
# run aborts that peer ("terminate called without an active exception", seen once in CI).
trainer.strategy.barrier()
torch.distributed.destroy_process_group()
"""


def test_ddp_script_launcher_fits_data_parallel(tmp_path):
    """strategy="ddp" as a user runs it: the script re-launched by Lightning in a second process,
    a DistributedSampler splitting 300 validation samples 150/150 (no padding, no warning). Both
    processes end with the head of one fit on all 300 outputs of the trained network."""
    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "rank{}.pt")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["temperature"] == ranks[1]["temperature"] and ranks[0]["warned"] == []
    model = Classifier()
    model.load_state_dict(ranks[0]["weights"])
    val = make_data(300, seed=1)
    logits, labels = raw_outputs(model, val, batch_size=50), val.tensors[1]
    assert ranks[0]["temperature"] == pytest.approx(torchcal.TemperatureScaling().fit(logits, labels).temperature, rel=1e-5)
    logged = ranks[0]["logged"]
    assert logged["calibration/nce"] == pytest.approx(float(cross_entropy(logits, labels, normalize=True)), rel=1e-5)
    assert logged["calibration/refinement"] == pytest.approx(float(refinement_loss(logits, labels)), rel=1e-5)


# ------------------------------------------------------------------------------------ recipe
def test_lightning_digits_recipe_fast(capsys):
    pytest.importorskip("sklearn")
    path = Path(__file__).resolve().parents[1] / "recipes" / "lightning_digits.py"
    spec = importlib.util.spec_from_file_location("lightning_digits", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--fast"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[-4:]}
    assert set(rows) == {"NCE", "NBS", "ECE", "RCL"} and rows["RCL"][1] == "-"  # val after: not refitted
    (val_before, val_after, test_before, test_after) = ([float(v) for v in column] for column in zip(*(rows[m] for m in ("NCE", "ECE"))))
    assert val_after[0] < val_before[0] and test_after[0] < test_before[0]  # NCE falls
    assert float(rows["RCL"][3]) < float(rows["RCL"][2])  # little is left to calibrate on test
    epochs = [line for line in out.splitlines() if line.startswith("epoch")]
    assert all("refinement" in line for line in epochs) and ["NCE" in line for line in epochs[:5]] == [False] * 4 + [True]


def test_docstring_examples():
    import doctest

    import torchcal.lightning.callback

    result = doctest.testmod(torchcal.lightning.callback)
    assert result.attempted > 0 and result.failed == 0


def test_a_fit_epoch_costs_one_fused_pass_and_one_temperature_fit(trained, monkeypatch):
    """trainer.validate with a refit: NCE, NBS and ECE from one softmax pass, and the refinement
    loss from the head's own temperature fit (no second fit, no pass after it); values as the
    functional forms."""
    import torchcal.calibrators.temperature as temperature
    import torchcal.metrics.fused as fused

    _, model, _, _ = trained
    calls = {"passes": 0, "fits": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(fused, "softmax_rows", counted("passes", fused.softmax_rows))
    monkeypatch.setattr(temperature, "fit_inverse_temperature", counted("fits", temperature.fit_inverse_temperature))
    callback = CalibrationCallback(torchcal.TemperatureScaling(), fit_on_validate=True)
    trainer = Trainer(**TRAINER_DEFAULTS, callbacks=[callback])
    data = make_data(300, seed=5)
    trainer.validate(model, DataLoader(data, batch_size=64), verbose=False)
    assert calls == {"passes": 1, "fits": 1}
    logits, labels = raw_outputs(model, data), data.tensors[1]
    logged = trainer.callback_metrics
    assert float(logged["calibration/nce"]) == pytest.approx(float(cross_entropy(logits, labels, normalize=True)), rel=1e-6)
    assert float(logged["calibration/nbs"]) == pytest.approx(float(brier_score(logits, labels, normalize=True)), rel=1e-6)
    assert float(logged["calibration/ece"]) == pytest.approx(float(expected_calibration_error(logits, labels)), rel=1e-5)
    assert float(logged["calibration/refinement"]) == pytest.approx(float(refinement_loss(logits, labels)), rel=1e-6)
