"""Calibrate a network inside a Lightning training run: an MLP on scikit-learn's bundled digits.

The MLP is trained without regularisation, so it grows over-confident as it fits the training
set. ``CalibrationCallback`` logs the validation refinement loss (the cross-entropy left after
temperature scaling, Berta et al. 2025) every epoch, which ``EarlyStopping`` monitors, and every
fifth epoch the NCE, NBS, ECE and relative calibration loss (RCL) with a temperature-scaling fit on
the validation outputs (``every_n_epochs=5``); the head is refitted on the last epoch at the end and
``trainer.predict`` returns calibrated outputs. The script prints the epoch-by-epoch metrics and a
before/after table on the validation set (out-of-fold, by cross-validation) and on the untouched
test set.

The digits ship with scikit-learn (``pip install "torchcal[examples]"``); nothing is downloaded.

    python recipes/lightning_digits.py            # 40 epochs, a few seconds
    python recipes/lightning_digits.py --fast     # 15 epochs, for CI
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import torchcal
from torchcal.lightning import CalibrationCallback, calibration_metrics

METRICS = ("nce", "nbs", "ece", "rcl")
EVERY_N_EPOCHS = 5


def digits_splits(seed: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """The 1797 digits (8x8 images as 64 features in [0, 1], 10 classes), split stratified into
    train (600), validation (500) and test (697)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, train_size=600, stratify=y, random_state=seed)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, train_size=500, stratify=y_rest, random_state=seed)
    as_tensors = lambda x, y: (torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
    return {"train": as_tensors(x_train, y_train), "val": as_tensors(x_val, y_val), "test": as_tensors(x_test, y_test)}


class DigitsMLP(LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 3e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])  # CalibrationCallback collects the logits, and the labels from the batch

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])  # calibrated log-posteriors while the callback's head is attached

    def on_train_epoch_end(self) -> None:  # runs after the epoch's validation
        m = self.trainer.callback_metrics
        line = f"epoch {self.current_epoch + 1:3d}   refinement {float(m['calibration/refinement']):7.4f}"
        if (self.current_epoch + 1) % EVERY_N_EPOCHS == 0:
            line += "   " + "   ".join(f"{name.upper()} {float(m['calibration/' + name]):7.4f}" for name in METRICS)
        self.print(line)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def table(columns: dict[str, dict[str, float]]) -> str:
    lines = ["metric" + "".join(f"{name:>16}" for name in columns)]
    lines += [f"{m.upper():<6}" + "".join(f"{col[m]:>16.4f}" if m in col else f"{'-':>16}" for col in columns.values()) for m in METRICS]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="15 epochs instead of 40 (CI)")
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args(argv)
    epochs = args.epochs or (15 if args.fast else 40)

    seed_everything(0, verbose=False)
    data = digits_splits()
    loaders = {
        split: DataLoader(TensorDataset(*data[split]), batch_size=50, shuffle=split == "train")
        for split in data
    }
    model = DigitsMLP()
    callback = CalibrationCallback(
        torchcal.TemperatureScaling(), metrics=(*METRICS, "refinement"), every_n_epochs=EVERY_N_EPOCHS
    )
    stopping = EarlyStopping(monitor="calibration/refinement", patience=5)
    trainer = Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[callback, stopping],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    print(f"validation calibration metrics while training ({epochs} epochs):")
    trainer.fit(model, loaders["train"], loaders["val"])

    x_test, y_test = data["test"]
    model.eval()
    with torch.no_grad():
        raw_test = model(x_test)  # outside the trainer: the raw network
    calibrated_test = torch.cat(trainer.predict(model, loaders["test"]))  # the head is attached
    head = callback.calibrator
    stopped = f"early-stopped at epoch {stopping.stopped_epoch + 1}" if stopping.stopped_epoch else "no early stop"
    print(f"\n{stopped}; fitted temperature T = {head.temperature:.3f} on {len(data['val'][1])} validation samples")
    print("validation 'after' is out-of-fold (5-fold cross-validation); RCL is the relative calibration loss in %")
    print("(on the test set, the RCL after calibration is what a 5-fold refit on the calibrated scores still removes)\n")
    print(table({
        "val before": callback.report_["before"],
        "val after (CV)": callback.report_["after"],  # no RCL: never refitted on calibrated scores
        "test before": calibration_metrics(raw_test, y_test, head, METRICS),
        "test after": calibration_metrics(calibrated_test, y_test, head, METRICS),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
