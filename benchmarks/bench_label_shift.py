"""Benchmark: ``estimate_priors`` (label shift) on real and synthetic target scores, against an
independent NumPy SQUAREM-accelerated EM run to an EM step of 1e-15 and, with ``--old``, against
another version's ``estimate_priors`` in the same run. One thread.

Usage:
    python benchmarks/bench_label_shift.py                          # the four problems
    mkdir -p /tmp/old && git archive dfc9827 torchcal | tar -x -C /tmp/old
    python benchmarks/bench_label_shift.py --old /tmp/old/torchcal/label_shift.py

The problems: ``cifar10_resnet110_kangsepp`` (BCTS fitted on its validation split; the test split
resampled to priors 0.3 ... 0.02), ``cifar100_resnet20_ferrer`` (BCTS on 5,000 samples; the target
is the others of classes 0-19: 20 of 100 present), ``cifar100_lenet5_netcal`` (BCTS on 5,000; the
other 5,000 resampled to Dirichlet(0.5) priors), and synthetic K = 1,000 scores (N = 20,000,
calibrated for uniform priors; Dirichlet(0.3) target priors, some classes absent).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.label_shift_reference import numpy_squarem
from torchcal.label_shift import LabelShiftAdapter, estimate_priors

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real"


def _calibrated(logits: np.ndarray, labels: np.ndarray, target: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """BCTS (the adapter's default calibrator) fitted on ``logits, labels``: its log-posteriors of
    the ``target`` logits and its source priors."""
    adapter = LabelShiftAdapter().fit(torch.from_numpy(logits).double(), torch.from_numpy(labels).long())
    with torch.no_grad():
        return adapter.calibrator(torch.from_numpy(target).double()), adapter.source_priors


def problems(real: Path) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, calibrated target log-posteriors (N, K), source priors (K,)) of each problem."""
    with np.load(real / "cifar10_resnet110_kangsepp.npz") as d:
        rng = np.random.default_rng(0)
        target = np.array([0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.03, 0.02])
        test = np.concatenate([rng.choice(np.flatnonzero(d["labels"] == k), round(t * 5000)) for k, t in enumerate(target)])
        yield "ResNet-110, shifted", *_calibrated(d["logits_val"], d["labels_val"], d["logits"][test])
    with np.load(real / "cifar100_resnet20_ferrer.npz") as d:
        x, y = d["logits"], d["labels"]
        order = np.random.default_rng(1).permutation(len(y))
        rest = order[5000:]
        yield "CIFAR-100, 20 of 100 present", *_calibrated(x[order[:5000]], y[order[:5000]], x[rest[y[rest] < 20]])
    with np.load(real / "cifar100_lenet5_netcal.npz") as d:
        x, y = d["logits"], d["labels"]
        rng = np.random.default_rng(0)
        order = rng.permutation(len(y))
        weights = rng.dirichlet(np.full(100, 0.5))[y[order[5000:]]]
        test = rng.choice(order[5000:], 5000, p=weights / weights.sum())
        yield "LeNet-5, Dirichlet(0.5) priors", *_calibrated(x[order[:5000]], y[order[:5000]], x[test])
    generator = torch.Generator().manual_seed(0)
    k, n = 1000, 20000
    torch.manual_seed(0)  # the Dirichlet draw takes no generator
    priors = torch.distributions.Dirichlet(torch.full((k,), 0.3)).sample()
    labels = torch.multinomial(priors, n, replacement=True, generator=generator)
    logits = 3 * (torch.randn(n, k, generator=generator) + 3 * torch.nn.functional.one_hot(labels, k))
    yield "synthetic K = 1,000", torch.log_softmax(logits.double(), 1), torch.full((k,), 1 / k, dtype=torch.float64)


def timed(solve: Callable[[], object], repeat: int) -> tuple[object, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = solve()
        times.append(time.perf_counter() - start)
    return result, float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", type=Path, default=REAL, help="the folder of the real .npz files")
    parser.add_argument("--old", type=Path, help="another version's torchcal/label_shift.py, timed beside this one")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    solvers: dict[str, Callable[..., object]] = {"this checkout": estimate_priors}
    if args.old is not None:
        spec = importlib.util.spec_from_file_location("old_label_shift", args.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        solvers["--old"] = old.estimate_priors
    print("| problem | N x K | solver | iterations | passes | time (s) | converged | max abs error |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for name, log_posteriors, source in problems(args.real):
        reference = numpy_squarem(np.exp(log_posteriors.numpy()), source.numpy())
        shape = f"{log_posteriors.shape[0]:,} x {log_posteriors.shape[1]:,}"
        for label, solve in solvers.items():
            estimate, seconds = timed(lambda solve=solve: solve(log_posteriors, source), args.repeat)
            record = estimate.record  # type: ignore[attr-defined]
            error = np.abs(estimate.priors.numpy() - reference).max()  # type: ignore[attr-defined]
            print(f"| {name} | {shape} | {label} | {record.iterations:,} | {record.evaluations:,} | {seconds:.3f} | "
                  f"{'yes' if record.converged else 'no'} | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
