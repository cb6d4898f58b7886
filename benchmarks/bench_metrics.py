"""Benchmark: streaming cross-entropy + Brier + ECE over N x 100 logits in batches of 10,000.

Usage:
    python benchmarks/bench_metrics.py                 # N = 1,000,000, 1 thread, median of 3
    python benchmarks/bench_metrics.py --n 100000      # a quick run

Each row runs in its own Python process, which first generates the same seeded data (excluded
from the timings), then times the row ``--repeat`` times and reports the median. "Peak memory" is
the growth of the process's peak resident set size (``resource.getrusage``) while the row runs,
on top of the data already in memory. Rows whose package is not installed (or fails to import)
are skipped with a note. The data: latent logits z ~ 3 N(0, 1), labels y ~ Categorical(softmax(z))
(so z is calibrated), observed logits 2.5 (z @ A) + b, over-confident and class-mixed, float32.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

NUM_CLASSES, N_BINS = 100, 15


def make_batches(n: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    mixing = torch.eye(NUM_CLASSES) + 0.05 * torch.randn(NUM_CLASSES, NUM_CLASSES, generator=g)
    bias = 0.5 * torch.randn(NUM_CLASSES, generator=g)
    batches = []
    for i, start in enumerate(range(0, n, batch)):
        g = torch.Generator().manual_seed(100 + i)
        z = 3.0 * torch.randn(min(batch, n - start), NUM_CLASSES, generator=g)
        y = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        batches.append((2.5 * (z @ mixing) + bias, y))
    return batches


# --------------------------------------------------------------------------- rows


def row_log_softmax(batches) -> Callable[[], str]:
    def run() -> str:
        for z, _ in batches:
            torch.log_softmax(z, dim=1)
        return ""

    return run


def row_torchcal(batches) -> Callable[[], str]:
    from torchcal.metrics import BrierScore, CalibrationError, CrossEntropy

    def run() -> str:
        metrics = [CrossEntropy(NUM_CLASSES), BrierScore(NUM_CLASSES), CalibrationError(NUM_CLASSES, N_BINS)]
        for z, y in batches:
            for metric in metrics:
                metric.update(z, y)
        ce, brier, ece = (m.compute().item() for m in metrics)
        return f"NLL {ce:.5f}  Brier {brier:.5f}  ECE {ece:.5f}"

    return run


def row_torchcal_ece(batches) -> Callable[[], str]:
    from torchcal.metrics import CalibrationError

    def run() -> str:
        metric = CalibrationError(NUM_CLASSES, N_BINS)
        for z, y in batches:
            metric.update(z, y)
        return f"ECE {metric.compute().item():.5f}"

    return run


def row_torchmetrics(batches) -> Callable[[], str]:
    from torchmetrics.classification import MulticlassCalibrationError

    def run() -> str:
        metric = MulticlassCalibrationError(NUM_CLASSES, n_bins=N_BINS, norm="l1", validate_args=False)
        for z, y in batches:
            metric.update(z, y)  # logits: torchmetrics applies the softmax
        return f"ECE {metric.compute().item():.5f}"

    return run


def row_netcal(batches) -> Callable[[], str]:
    from netcal.metrics import ECE

    probs = torch.cat([torch.softmax(z, 1) for z, _ in batches]).numpy()
    labels = torch.cat([y for _, y in batches]).numpy()

    def run() -> str:
        return f"ECE {ECE(bins=N_BINS).measure(probs, labels):.5f}"

    return run


ROWS = {
    "log_softmax pass (float32, no metric)": row_log_softmax,
    "torchcal CrossEntropy + BrierScore + CalibrationError": row_torchcal,
    "torchcal CalibrationError (ECE only)": row_torchcal_ece,
    "torchmetrics MulticlassCalibrationError (ECE only)": row_torchmetrics,
    "netcal ECE(15).measure (one call on the full softmax array)": row_netcal,
}
SKIPPED_NOTES = {  # alternatives from the reference benchmark that are not rows here
    "torch_uncertainty BrierScore + CategoricalNLL": "torch_uncertainty",
    "probmetrics brier + logloss + ece-15": "probmetrics.metrics",
}


def run_row(name: str, n: int, batch: int, repeat: int) -> dict:
    batches = make_batches(n, batch)
    try:
        run = ROWS[name](batches)
    except ImportError as error:
        return {"skipped": f"not installed ({error})"}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, result = [], ""
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": statistics.median(times), "peak_mib": (peak_after - peak_before) / 1024, "result": result}


def import_note(module: str) -> str:
    try:
        __import__(module)
    except Exception as error:  # a broken optional dependency is a skip, not a crash
        return f"skipped: import failed ({type(error).__name__}: {error})"
    return "installed, not benchmarked here"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="number of samples (default 1,000,000)")
    parser.add_argument("--batch", type=int, default=10_000, help="batch size (default 10,000)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per row; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.row:
        print(json.dumps(run_row(args.row, args.n, args.batch, args.repeat)))
        return

    print(f"torch {torch.__version__}, {args.threads} thread(s), N = {args.n:,} x {NUM_CLASSES}, "
          f"batches of {args.batch:,}, median of {args.repeat}")
    results = {}
    for name in ROWS:
        command = [sys.executable, __file__, "--row", name, "--n", str(args.n), "--batch", str(args.batch),
                   "--repeat", str(args.repeat), "--threads", str(args.threads)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(output.strip().splitlines()[-1])

    baseline = results["log_softmax pass (float32, no metric)"].get("seconds")
    reference = results["torchmetrics MulticlassCalibrationError (ECE only)"].get("seconds")
    header = f"| {'row':<60} | time (s) | samples/s | peak MiB | x log_softmax | x torchmetrics | values |"
    print(header)
    print("|" + "|".join("-" * (len(cell) + 0) for cell in header.split("|")[1:-1]) + "|")
    for name, r in results.items():
        if "skipped" in r:
            print(f"| {name:<60} | {r['skipped']} |")
            continue
        t = r["seconds"]
        ratio_base = f"{t / baseline:.2f}" if baseline else "-"
        ratio_ref = f"{t / reference:.2f}" if reference else "-"
        print(f"| {name:<60} | {t:8.3f} | {args.n / t:9.3g} | {r['peak_mib']:8.1f} | {ratio_base:>13} | "
              f"{ratio_ref:>14} | {r['result']} |")
    for name, module in SKIPPED_NOTES.items():
        print(f"note: {name}: {import_note(module)}")


if __name__ == "__main__":
    main()
