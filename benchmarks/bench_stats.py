"""Benchmark: the calibration statistics against the libraries they are checked against.

Rows, each on the same seeded data (``bench_common.make_data``: over-confident N x K logits):

- smooth ECE, top-label, automatic bandwidth: torchcal ``smooth_ece`` vs ``relplot.smECE``
  (the softmax and top-label reduction included for both);
- Kolmogorov-Smirnov and Kuiper tests: torchcal vs MAPIE's ``*_p_value`` (binary: class 1 of K);
- consistency-resampling test, top-label ECE with 15 bins, L label resamples: torchcal's
  vectorised path vs the loop of L ECE calls (what the survey's Algorithm 1 does).

Every row runs once as a warm-up, then the timed repetitions go round-robin over the rows (so load
from other processes affects all rows alike); the median is reported with its ratio to the first
row of its group, and each row's value, which must agree within a group.

Usage:
    python benchmarks/bench_stats.py                  # N = 100,000, K = 10, L = 999, 5 repeats
    python benchmarks/bench_stats.py --n 10000 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import make_data

from torchcal.functional import expected_calibration_error
from torchcal.functional.calibration_tests import kolmogorov_smirnov_test, kuiper_test
from torchcal.functional.consistency_resampling import consistency_resampling_test
from torchcal.functional.smooth_ece import smooth_ece


def rows(logits: torch.Tensor, labels: torch.Tensor, resamples: int) -> dict[str, dict[str, Callable[[], float]]]:
    binary = torch.stack([torch.zeros(len(labels)), logits[:, 1] - logits[:, 0]], 1)  # class 1 vs class 0 scores
    targets = (labels == 1).long()
    groups: dict[str, dict[str, Callable[[], float]]] = {
        "smooth ECE": {"torchcal": lambda: float(smooth_ece(logits, labels))},
        "KS + Kuiper p": {"torchcal": lambda: float(kolmogorov_smirnov_test(binary, targets, "binary").p_value
                                                    + kuiper_test(binary, targets, "binary").p_value)},
    }
    try:
        import numpy as np
        import relplot

        def relplot_row() -> float:
            f, y = relplot.multiclass_logits_to_confidences(logits.double().numpy(), labels.numpy())
            return float(relplot.smECE(f, y))

        groups["smooth ECE"]["relplot"] = relplot_row
    except ImportError as error:
        print(f"relplot rows skipped: {error}")
    try:
        from mapie.metrics import calibration as mapie

        def mapie_row() -> float:
            s = torch.softmax(binary.double(), 1)[:, 1].numpy()
            y = targets.numpy().astype(np.float64)
            return float(mapie.kolmogorov_smirnov_p_value(y, s) + mapie.kuiper_p_value(y, s))

        groups["KS + Kuiper p"]["MAPIE"] = mapie_row
    except ImportError as error:
        print(f"MAPIE rows skipped: {error}")
    ece = partial(expected_calibration_error, n_bins=15)
    groups[f"resampling test, L = {resamples}"] = {
        "torchcal (vectorised)": lambda: float(consistency_resampling_test(expected_calibration_error, logits, labels,
                                                                           resamples, n_bins=15).p_value),
        "loop of L ECE calls": lambda: float(consistency_resampling_test(lambda x, y: ece(x, y), logits, labels,
                                                                         resamples).p_value),
    }
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--resamples", type=int, default=999)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    logits, labels = make_data(args.n, args.k)
    groups = rows(logits, labels, args.resamples)
    times: dict[tuple[str, str], list[float]] = {}
    values = {(g, r): fn() for g, group in groups.items() for r, fn in group.items()}  # warm-up
    for _ in range(args.repeat):
        for g, group in groups.items():
            for r, fn in group.items():
                start = time.perf_counter()
                fn()
                times.setdefault((g, r), []).append(time.perf_counter() - start)
    print(f"N = {args.n}, K = {args.k}, {torch.get_num_threads()} threads, median of {args.repeat}")
    for g, group in groups.items():
        first = statistics.median(times[(g, next(iter(group)))])
        for r in group:
            median = statistics.median(times[(g, r)])
            print(f"{g:<28} {r:<24} {median * 1000:9.1f} ms  x{median / first:6.2f}  value {values[(g, r)]:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
