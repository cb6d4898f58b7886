"""Benchmark: streaming cross-entropy + Brier + ECE over N x 100 logits in batches of 10,000.

The fused ``PosteriorQuality`` rows compute all three (and the error rate) in one pass per batch.

Usage:
    python benchmarks/bench_metrics.py                 # N = 1,000,000, 1 thread, median of 5
    python benchmarks/bench_metrics.py --n 100000      # a quick run
    python benchmarks/bench_metrics.py --bootstrap     # 1,000 bootstrap replicates over 10,000 x 100 instead

The seeded data are generated once (not timed): latent logits z ~ 3 N(0, 1), labels
y ~ Categorical(softmax(z)) (so z is calibrated), observed logits 2.5 (z @ A) + b, over-confident
and class-mixed, float32. Every row runs once as a warm-up, then the timed repetitions go
round-robin over the rows, so that load from other processes affects all rows alike; the median
is reported. Rows whose package is not installed, or fails to import, are skipped with a note.

Peak memory is measured in a separate process, with glibc told to return every allocation above
64 KiB to the system when it is freed (``MALLOC_MMAP_THRESHOLD_``), so that the resident set size
follows live memory: each row runs once while /proc/self/statm is sampled every millisecond, and
the peak above the level before the row is reported (Linux; "n/a" elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

NUM_CLASSES, N_BINS = 100, 15
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def make_batches(n: int, batch: int) -> Batches:
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


# --------------------------------------------------------------------------- rows: data -> run() -> result text


def row_log_softmax(batches: Batches) -> Callable[[], str]:
    def run() -> str:
        for z, _ in batches:
            torch.log_softmax(z, dim=1)
        return ""

    return run


def row_torchcal(batches: Batches) -> Callable[[], str]:
    from torchcal.metrics import BrierScore, CalibrationError, CrossEntropy

    def run() -> str:
        metrics = [CrossEntropy(NUM_CLASSES), BrierScore(NUM_CLASSES), CalibrationError(NUM_CLASSES, N_BINS)]
        for z, y in batches:
            for metric in metrics:
                metric.update(z, y)
        ce, brier, ece = (m.compute().item() for m in metrics)
        return f"NLL {ce:.5f}  Brier {brier:.5f}  ECE {ece:.5f}"

    return run


def row_torchcal_fused(precision: str, validate_args: bool = True) -> Callable[[Batches], Callable[[], str]]:
    def make(batches: Batches) -> Callable[[], str]:
        from torchcal.metrics import PosteriorQuality

        def run() -> str:
            metric = PosteriorQuality(NUM_CLASSES, N_BINS, precision=precision, validate_args=validate_args)
            for z, y in batches:
                metric.update(z, y)
            r = {name: value.item() for name, value in metric.compute().items()}
            return f"NLL {r['cross_entropy']:.5f}  Brier {r['brier']:.5f}  ECE {r['ece']:.5f}"

        return run

    return make


def row_torchcal_ece(batches: Batches) -> Callable[[], str]:
    from torchcal.metrics import CalibrationError

    def run() -> str:
        metric = CalibrationError(NUM_CLASSES, N_BINS)
        for z, y in batches:
            metric.update(z, y)
        return f"ECE {metric.compute().item():.5f}"

    return run


def row_torchmetrics(batches: Batches) -> Callable[[], str]:
    from torchmetrics.classification import MulticlassCalibrationError

    def run() -> str:
        metric = MulticlassCalibrationError(NUM_CLASSES, n_bins=N_BINS, norm="l1", validate_args=False)
        for z, y in batches:
            metric.update(z, y)  # logits: torchmetrics applies the softmax
        return f"ECE {metric.compute().item():.5f}"

    return run


def row_netcal(batches: Batches) -> Callable[[], str]:
    from netcal.metrics import ECE

    probs = torch.cat([torch.softmax(z, 1) for z, _ in batches]).numpy()  # prepared outside the timing
    labels = torch.cat([y for _, y in batches]).numpy()

    def run() -> str:
        return f"ECE {ECE(bins=N_BINS).measure(probs, labels):.5f}"

    return run


BASELINE = "log_softmax pass (float32, no metric)"
REFERENCE = "torchmetrics MulticlassCalibrationError (ECE only)"
ROWS = {
    BASELINE: row_log_softmax,
    "torchcal CrossEntropy + BrierScore + CalibrationError": row_torchcal,
    "torchcal PosteriorQuality (fused, float64)": row_torchcal_fused("float64"),
    "torchcal PosteriorQuality (fused, float32)": row_torchcal_fused("float32"),
    "torchcal PosteriorQuality (fused, float32, no checks)": row_torchcal_fused("float32", False),
    "torchcal CalibrationError (ECE only)": row_torchcal_ece,
    REFERENCE: row_torchmetrics,
    "netcal ECE(15).measure (one call on the full softmax array)": row_netcal,
}
NOT_ROWS = {  # alternatives of the reference benchmark without a row here: module to report on
    "torch_uncertainty BrierScore + CategoricalNLL": "torch_uncertainty.metrics",
    "probmetrics brier + logloss + ece-15": "probmetrics.metrics",
}


def bootstrap_table(repeat: int) -> None:
    """1,000 percentile-bootstrap replicates over 10,000 x 100: torchcal's ``bootstrap`` (its fast
    path: per-sample values and bins computed once, per-class or per-bin sums per replicate; its
    column path for the equal-mass and smooth ECE: confidences and correctness computed once, the
    metric recomputed from each replicate's rows of them) against torchmetrics' ``BootStrapper``
    (which keeps 1,000 copies of the metric and updates each with a resample)."""
    from functools import partial

    from torchcal.functional import (
        bootstrap,
        brier_score,
        cross_entropy,
        expected_calibration_error,
        smooth_calibration_error,
    )

    (z, y), = make_batches(10_000, 10_000)
    def interval(metric_fn: Callable) -> Callable[[], str]:
        def run() -> str:
            r = bootstrap(metric_fn, z, y, 1000)
            return f"{float(r.estimate):.4f} [{float(r.lower):.4f}, {float(r.upper):.4f}]"

        return run

    rows: dict[str, Callable[[], str]] = {
        "torchcal bootstrap(cross_entropy)": interval(cross_entropy),
        "torchcal bootstrap(brier_score)": interval(brier_score),
        "torchcal bootstrap(expected_calibration_error)": interval(expected_calibration_error),
        "torchcal bootstrap(expected_calibration_error quantile)": interval(partial(expected_calibration_error, strategy="quantile")),
        "torchcal bootstrap(smooth_calibration_error)": interval(smooth_calibration_error),
    }
    try:
        from torchmetrics.classification import MulticlassCalibrationError
        from torchmetrics.wrappers import BootStrapper

        def torchmetrics_bootstrap() -> str:
            metric = BootStrapper(MulticlassCalibrationError(NUM_CLASSES, n_bins=N_BINS), num_bootstraps=1000, quantile=torch.tensor([0.025, 0.975]))
            metric.update(z, y)
            r = metric.compute()
            return f"mean {float(r['mean']):.4f} [{float(r['quantile'][0]):.4f}, {float(r['quantile'][1]):.4f}]"

        rows["torchmetrics BootStrapper(MulticlassCalibrationError)"] = torchmetrics_bootstrap
    except ImportError as error:
        print(f"note: torchmetrics BootStrapper skipped ({error})")
    print(f"| {'1,000 replicates over 10,000 x 100':<55} | median s | result |\n|{'-' * 57}|---------:|--------|")
    for name, run in rows.items():
        result = run()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        print(f"| {name:<55} | {statistics.median(times):8.2f} | {result[:90]} |")


# --------------------------------------------------------------------------- measuring


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def peak_memory_mib(run: Callable[[], str]) -> tuple[str, float | None]:
    """Run once; return its result and the peak RSS growth in MiB (None without /proc)."""
    base = _rss_bytes()
    if base is None:
        return run(), None
    peak, stop = [base], threading.Event()

    def poll() -> None:
        while not stop.wait(0.001):
            peak[0] = max(peak[0], _rss_bytes() or 0)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        result = run()
    finally:
        stop.set()
        thread.join()
    return result, (max(peak[0], _rss_bytes() or 0) - base) / 2**20


def import_note(module: str) -> str:
    try:
        __import__(module)
    except Exception as error:  # a broken optional dependency is a skip, not a crash
        return f"skipped: import failed ({type(error).__name__}: {error})"
    return "installed, but no row for it here"


def measure_memory(args: argparse.Namespace) -> dict[str, float | None]:
    """Peak MiB of each row, from a child process whose allocator returns freed memory at once."""
    command = [sys.executable, __file__, "--memory-only", "--n", str(args.n), "--batch", str(args.batch),
               "--threads", str(args.threads)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def available_rows(batches: Batches, notes: list[str]) -> dict[str, Callable[[], str]]:
    runs = {}
    for name, make in ROWS.items():
        try:
            runs[name] = make(batches)
        except ImportError as error:
            notes.append(f"{name}: skipped: not installed ({error})")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="number of samples (default 1,000,000)")
    parser.add_argument("--batch", type=int, default=10_000, help="batch size (default 10,000)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per row; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--bootstrap", action="store_true", help="time 1,000 bootstrap replicates over 10,000 x 100 instead")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # the child of measure_memory
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.bootstrap:
        return bootstrap_table(args.repeat)

    start = time.perf_counter()
    batches = make_batches(args.n, args.batch)
    notes: list[str] = []
    runs = available_rows(batches, notes)
    if args.memory_only:
        print(json.dumps({name: peak_memory_mib(run)[1] for name, run in runs.items()}))
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), N = {args.n:,} x {NUM_CLASSES} in batches of "
          f"{args.batch:,} (generated in {time.perf_counter() - start:.1f} s), median of {args.repeat}")

    results = {name: run() for name, run in runs.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    memory = measure_memory(args)

    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"| {'row':<60} | time (s) | samples/s | peak MiB | x log_softmax | x torchmetrics | values |")
    print(f"|{'-' * 62}|---------:|----------:|---------:|--------------:|---------------:|--------|")
    for name, t in median.items():
        ratio = lambda ref: f"{t / median[ref]:.2f}" if ref in median else "-"
        mib = "n/a" if memory.get(name) is None else f"{memory[name]:.1f}"
        print(f"| {name:<60} | {t:8.3f} | {args.n / t:9.3g} | {mib:>8} | {ratio(BASELINE):>13} | "
              f"{ratio(REFERENCE):>14} | {results[name]} |")
    for name, module in NOT_ROWS.items():
        notes.append(f"{name}: {import_note(module)}")
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
