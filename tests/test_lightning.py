"""CalibrationCallback in real Lightning runs: metrics, the attached head, checkpoints, DDP, recipe."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import torchcal
from torchcal.functional import brier_score, cross_entropy, expected_calibration_error
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


def raw_outputs(model: LightningModule, data: TensorDataset) -> Tensor:
    model.eval()
    with torch.no_grad():
        return model(data.tensors[0])


def head_state(callback: CalibrationCallback) -> dict[str, Tensor]:
    return {k: v for k, v in callback.calibrator.state_dict().items() if k != "_extra_state"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 4-epoch run with the callback, checkpoints and a CSV log."""
    root = tmp_path_factory.mktemp("run")
    model, callback = Classifier(), CalibrationCallback(torchcal.TemperatureScaling())
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
    logits, labels = raw_outputs(model, val), val.tensors[1]
    logged = trainer.callback_metrics
    nce = cross_entropy(logits, labels, normalize=True)
    assert float(logged["calibration/nce"]) == pytest.approx(float(nce), rel=1e-6)
    assert float(logged["calibration/nbs"]) == pytest.approx(float(brier_score(logits, labels, normalize=True)), rel=1e-6)
    assert float(logged["calibration/ece"]) == pytest.approx(float(expected_calibration_error(logits, labels)), rel=1e-5)
    out_of_fold = torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels)
    rcl = 100 * (1 - cross_entropy(out_of_fold, labels) / cross_entropy(logits, labels))
    assert float(logged["calibration/rcl"]) == pytest.approx(float(rcl), rel=1e-4)
    assert float(logged["calibration/rcl"]) > 3  # the network is over-confident: calibration helps
    # torchmetrics objects logged with self.log(name, metric): computed and reset every epoch.
    assert float(logged["val_nce"]) == pytest.approx(float(nce), rel=1e-5)
    assert float(logged["val_ece"]) == pytest.approx(float(logged["calibration/ece"]), rel=1e-5)


def test_metrics_are_logged_every_epoch(trained):
    *_, root = trained
    rows = list(csv.DictReader(open(next(root.glob("**/metrics.csv")))))
    per_epoch = [r for r in rows if r.get("calibration/nce")]
    assert [int(r["epoch"]) for r in per_epoch] == [0, 1, 2, 3]
    assert all(float(r["calibration/nce"]) > 0 for r in per_epoch)
    final = [r for r in rows if r.get("calibration/after/nce")]
    assert len(final) == 1 and set(final[0]) >= {f"calibration/{w}/{m}" for w in ("before", "after") for m in ("nce", "nbs", "ece", "rcl")}


def test_head_is_fitted_on_the_last_validation_logits(trained):
    _, model, callback, _ = trained
    val = make_data(300, seed=1)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, val), val.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-9)
    assert callback.calibrator.temperature > 1.1


def test_report_before_after(trained):
    _, _, callback, _ = trained
    before, after = callback.report_["before"], callback.report_["after"]
    # "after" is the out-of-fold calibrated data that also defines the RCL.
    assert after["nce"] == pytest.approx(before["nce"] * (1 - before["rcl"] / 100), rel=1e-9)
    assert after["nce"] < before["nce"] and after["ece"] < before["ece"]
    assert callback.table().splitlines()[1].split()[0] == "NCE"


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
    # A run resumed from the checkpoint (already at max_epochs, so it trains no further).
    resumed = CalibrationCallback(torchcal.TemperatureScaling())
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


def test_fast_dev_run_fits_a_head_in_one_short_epoch():
    callback = CalibrationCallback(torchcal.VectorScaling(), metrics=("nce", "error"))
    trainer = Trainer(**TRAINER_DEFAULTS, fast_dev_run=2, callbacks=[callback])
    trainer.fit(Classifier(), loader(600, 0, shuffle=True), loader(300, 1))
    assert callback.calibrator.is_fitted and callback.calibrator.num_classes == K
    assert set(callback.report_["before"]) == {"nce", "error"}
    assert "calibration/error" in trainer.callback_metrics


class InferenceModeProbe(CalibrationCallback):
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.inference_mode = torch.is_inference_mode_enabled()
        super().on_validation_epoch_end(trainer, pl_module)


def test_validate_on_request_calibrates_a_trained_model_under_inference_mode(trained):
    """trainer.validate fits the head on the given data, without training, inside the
    torch.inference_mode() of the default Trainer (fit's validation uses no_grad instead)."""
    _, model, _, _ = trained
    callback = InferenceModeProbe(torchcal.AffineCalibration(), metrics=("nce", "rcl"))
    data = make_data(200, seed=4)
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(model, DataLoader(data, batch_size=64), verbose=False)
    assert callback.inference_mode
    expected = torchcal.AffineCalibration().fit(raw_outputs(model, data), data.tensors[1])
    torch.testing.assert_close(callback.calibrator.beta, expected.beta, rtol=0, atol=1e-8)
    assert not callback.calibrator.beta.is_inference()


# ------------------------------------------------------------------------------------ misuse
class LossOnlyValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class ForwardBypassedInTest(Classifier):
    def test_step(self, batch, batch_idx):
        self.log("test_nll", F.cross_entropy(self.net(batch[0]), batch[1]))


def test_no_validation_logits_says_how_to_provide_them():
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=1, callbacks=[CalibrationCallback()])
    with pytest.raises(RuntimeError, match=r"found no validation logits.*override extract\(\)"):
        trainer.fit(LossOnlyValidation(), loader(100, 0), loader(100, 1))


class TupleValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return self(x), y


def test_extract_override_collects_from_elsewhere(trained):
    class FromTuple(CalibrationCallback):
        def extract(self, outputs, batch):
            return outputs

    _, model, _, _ = trained
    network = TupleValidation()
    network.load_state_dict(model.state_dict())
    callback = FromTuple(metrics=("nce",))
    data = make_data(200, seed=4)
    Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).validate(network, DataLoader(data, batch_size=64), verbose=False)
    expected = torchcal.TemperatureScaling().fit(raw_outputs(model, data), data.tensors[1])
    assert callback.calibrator.temperature == pytest.approx(expected.temperature, rel=1e-9)


class ProbsClassifier(Classifier):
    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(self.net(x), dim=1)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_nll", F.nll_loss(torch.log(self(x)), y))


def test_probability_outputs_are_calibrated_as_probabilities(trained):
    _, model, _, _ = trained
    network = ProbsClassifier()
    network.load_state_dict(model.state_dict())
    callback = CalibrationCallback(output="probs", metrics=("nce",))
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


def test_warnings_when_test_outputs_are_not_calibrated(trained):
    _, model, callback, _ = trained
    test = DataLoader(make_data(100, seed=3), batch_size=50)
    with pytest.warns(UserWarning, match="no fitted head"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[CalibrationCallback()]).test(model, test, verbose=False)
    bypass = ForwardBypassedInTest()
    bypass.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="forward was never called during test"):
        Trainer(**TRAINER_DEFAULTS, callbacks=[callback]).test(bypass, test, verbose=False)


def test_argument_errors():
    with pytest.raises(TypeError, match="torchcal calibrator"):
        CalibrationCallback(nn.Identity())
    with pytest.raises(ValueError, match="unknown metrics"):
        CalibrationCallback(metrics=("nce", "accuracy"))
    with pytest.raises(ValueError, match="output must be one of"):
        CalibrationCallback(output="softmax")
    with pytest.raises(RuntimeError, match="no report yet"):
        CalibrationCallback().table()


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
    """Saves every process's head and logged metrics, which a forked process cannot return."""

    def __init__(self, out: Path) -> None:
        super().__init__(torchcal.VectorScaling(), metrics=("nce", "rcl"))
        self.out = out

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)}
        torch.save({"head": self.calibrator.state_dict(), "metrics": metrics}, self.out / f"rank{trainer.global_rank}.pt")


def test_ddp_two_processes_fit_the_same_head_as_one(tmp_path):
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    # ddp_fork: two CPU processes with gloo, forked from this one (no re-import, so fast).
    Trainer(**TRAINER_DEFAULTS, strategy="ddp_fork", devices=2, use_distributed_sampler=False,
            callbacks=[SavingCallback(tmp_path / "ddp")]).validate(RankSplitClassifier(), verbose=False)
    Trainer(**TRAINER_DEFAULTS, callbacks=[SavingCallback(tmp_path / "one")]).validate(RankSplitClassifier(), verbose=False)
    one = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in (0, 1)]
    reference = torchcal.VectorScaling()
    reference.load_state_dict(one["head"])
    for r in ranks:
        head = torchcal.VectorScaling()
        head.load_state_dict(r["head"])
        torch.testing.assert_close(head.weight, reference.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(head.bias, reference.bias, rtol=0, atol=1e-6)
        assert r["metrics"] == pytest.approx(one["metrics"], rel=1e-6) and len(r["metrics"]) == 2
    assert all(torch.equal(v, ranks[1]["head"][k]) for k, v in ranks[0]["head"].items() if k != "_extra_state")


# ------------------------------------------------------------------------------------ recipe
def test_lightning_digits_recipe_fast(capsys):
    pytest.importorskip("sklearn")
    path = Path(__file__).resolve().parents[1] / "recipes" / "lightning_digits.py"
    spec = importlib.util.spec_from_file_location("lightning_digits", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--fast"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()[-4:]}
    assert set(rows) == {"NCE", "NBS", "ECE", "RCL"}
    (_, _, test_before, test_after) = zip(*rows.values())
    assert test_after[0] < test_before[0] and test_after[3] < test_before[3]  # NCE and RCL fall on test


def test_docstring_examples():
    import doctest

    import torchcal.lightning.callback

    result = doctest.testmod(torchcal.lightning.callback)
    assert result.attempted > 0 and result.failed == 0
