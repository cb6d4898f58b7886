"""Benchmark: the CalibrationCallback's cost per validation epoch, as a fraction of the epoch itself.

A validation epoch here is ``trainer.validate`` of a 3072-256-100 MLP (a flattened 32x32x3 image
in, 100 classes out, about equally frequent; 0.8 MFLOP per sample, some 300 times cheaper than a ResNet-110 on CIFAR) over
N = 20,000 seeded inputs in batches of 500, so the fractions below are upper bounds for real
networks. The labels are drawn from ``softmax(logits / 2.5)``: the network is 2.5 times
over-confident and temperature scaling has something to fit.

Rows: no callback (the epoch), then the callback with

- ``refinement`` only: what an epoch between fits costs (``every_n_epochs`` > 1), one
  temperature-scaling fit (a few Newton passes over the logits) whose minimised objective is the
  refinement loss that EarlyStopping monitors;
- the default metrics (NCE, NBS, ECE, refinement) and the temperature-scaling head fit: that fit,
  which is also the refinement loss's, and one fused softmax pass for NCE, NBS and ECE
  (before this was fused, each metric and the refinement loss made their own passes: five);
- the same with the 5-fold cross-validated RCL (five more fits and one more fused pass);
- the default metrics and a Dirichlet-ODIR head (K (K+1) parameters), at lambda = 1 and with
  lambda cross-validated (the default ``DirichletCalibration(reg="odir")``).

Every row runs once as a warm-up, then the timed repetitions go round-robin over the rows so load
from other processes affects all alike. The minimum and the median over the repetitions are
reported, and the callback's overhead as ``(row - epoch) / epoch`` for each: on a loaded machine
other processes only ever add time (the epoch itself, memory-bound, varies most), so the minimum
is the least disturbed run.

Usage:
    python benchmarks/bench_callback.py              # N = 20,000, K = 100, 5 repetitions
    python benchmarks/bench_callback.py --n 5000 --repeat 3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import torchcal
from torchcal.lightning import CalibrationCallback


class MLP(LightningModule):
    def __init__(self, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3072, 256), nn.ReLU(), nn.Linear(256, k))
        with torch.no_grad():
            self.net[2].weight.mul_(40)  # logits spread over several nats
            # Centre every class's mean logit, so that the classes are about equally frequent, as
            # on a real validation set (without this, 3 of 100 classes never occur in 10,000 samples
            # and the map of a Dirichlet head diverges along their columns).
            probe = torch.randn(2000, 3072, generator=torch.Generator().manual_seed(2))
            self.net[2].bias.sub_(self.net(probe).mean(0))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])


def make_loader(model: MLP, n: int) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3072, generator=gen)
    with torch.no_grad():
        logits = torch.cat([model(part) for part in x.split(1000)])
    labels = torch.distributions.Categorical(logits=logits / 2.5).sample()
    return DataLoader(TensorDataset(x, labels), batch_size=500)


def validate(model: MLP, loader: DataLoader, callback: CalibrationCallback | None) -> float:
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback] if callback else [],
    )
    start = time.perf_counter()
    trainer.validate(model, loader, verbose=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    model = MLP(args.k)
    loader = make_loader(model, args.n)
    rows: dict[str, Callable[[], CalibrationCallback | None]] = {
        "validation epoch (no callback)": lambda: None,
        "refinement only (an epoch between fits)": lambda: CalibrationCallback(metrics=("refinement",)),
        "default metrics + TS head fit": lambda: CalibrationCallback(torchcal.TemperatureScaling(), fit_on_validate=True),
        "default metrics + RCL (5 folds) + fit": lambda: CalibrationCallback(
            torchcal.TemperatureScaling(), metrics=("nce", "nbs", "ece", "refinement", "rcl"), fit_on_validate=True
        ),
        "default metrics + Dir-ODIR fit, lambda = 1": lambda: CalibrationCallback(
            torchcal.DirichletCalibration(reg="odir", reg_lambda=1.0), fit_on_validate=True
        ),
        "default metrics + Dir-ODIR fit, CV lambda": lambda: CalibrationCallback(
            torchcal.DirichletCalibration(reg="odir"), fit_on_validate=True
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for make in rows.values():  # warm-up
        validate(model, loader, make())
    for _ in range(args.repeat):
        for name, make in rows.items():
            times[name].append(validate(model, loader, make()))
    print(f"CalibrationCallback overhead per validation epoch: N = {args.n:,} x K = {args.k}, "
          f"{args.threads} thread(s), {args.repeat} repetitions")
    print(f"{'row':<46}{'min s':>8}{'median s':>10}{'overhead: min':>15}{'median':>9}")
    summaries = {"min": {name: min(t) for name, t in times.items()}, "median": {name: statistics.median(t) for name, t in times.items()}}
    overheads = {
        statistic: {name: (seconds - values["validation epoch (no callback)"]) / values["validation epoch (no callback)"] for name, seconds in values.items()}
        for statistic, values in summaries.items()
    }
    for name in rows:
        columns = "" if name.startswith("validation") else f"{overheads['min'][name]:>15.3f}{overheads['median'][name]:>9.3f}"
        print(f"{name:<46}{summaries['min'][name]:>8.3f}{summaries['median'][name]:>10.3f}{columns}")
    mean = {s: (4 * o["refinement only (an epoch between fits)"] + o["default metrics + TS head fit"]) / 5 for s, o in overheads.items()}
    print(f"{'every_n_epochs=5, mean per epoch':<46}{'':>18}{mean['min']:>15.3f}{mean['median']:>9.3f}")

if __name__ == "__main__":
    main()
