"""Benchmark: metrics at ImageNet size (50,000 x 1,000 float32 logits ``3 * randn``, labels drawn
from ``softmax(logits / 3)``), this checkout against another version of torchcal, one thread, every
row in its own process. The rows are the paths a scale review found slow (see README.md, "ImageNet-size
metrics").

Usage:
    mkdir -p /tmp/old && git archive d557156 torchcal | tar -x -C /tmp/old
    python benchmarks/bench_scale.py --old /tmp/old                       # every row
    python benchmarks/bench_scale.py --old /tmp/old --rows error_rate,refine_brier

An old version whose bootstrap recomputes these metrics on every replicate takes about 0.8 s per
replicate: it is timed on ``--reps`` replicates and scaled to 1,000.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROW = r'''
import json, sys, time
sys.path.insert(0, {path!r})
import torch
torch.set_num_threads(1)
import torchcal, torchcal.functional as F
from torchcal.metrics import RefinementLoss, ErrorRate
assert torchcal.__file__.startswith({path!r}), torchcal.__file__
gen = torch.Generator().manual_seed(0)
n, k = 50000, 1000
x = 3 * torch.randn(n, k, generator=gen)
y = torch.cat([torch.multinomial(torch.softmax(p / 3, 1), 1, generator=gen).squeeze(1) for p in x.split(1000)])
row, old, reps = {row!r}, {old!r}, {reps}
def boot(fn, **kw):
    # the old code took the general path for these; at 1,000 replicates it ran for minutes, so it
    # is timed on `reps` replicates and scaled to 1,000
    r = F.bootstrap(fn, x, y, num_replicates=reps if old else 1000, **kw)
    return float(r.estimate)
def metric():
    m = RefinementLoss()
    for i in range(0, n, 1000):
        m.update(x[i:i+1000], y[i:i+1000])
    return float(m.compute())
rows = dict(
    boot_smooth=lambda: boot(F.smooth_calibration_error),
    boot_debiased=lambda: boot(F.debiased_calibration_error),
    boot_quantile=lambda: boot(F.expected_calibration_error, strategy="quantile"),
    sweep_classwise=lambda: float(F.sweep_calibration_error(x, y, kind="classwise")),
    smooth_classwise=lambda: float(F.smooth_calibration_error(x, y, kind="classwise")),
    refine_brier=lambda: float(F.refinement_loss(x, y, loss="brier")),
    refine_log=lambda: float(F.refinement_loss(x, y, loss="log")),
    refine_metric=metric,
    error_rate=lambda: float(F.error_rate(x, y)),
    balanced_error_rate=lambda: float(F.balanced_error_rate(x, y)),
    # the report's calibration test (199 resamples); an old version calling ECE per resample is
    # timed on `reps` resamples and scaled to 199
    calibration_test=lambda: float(F.consistency_resampling_test(F.expected_calibration_error, x, y, reps if old else 199).p_value),
    bayes_risk_sweep=lambda: float(torchcal.plots.bayes_risk_sweep(x, y, 3)[1].mean()),
)
w, c = time.perf_counter(), time.process_time()
value = rows[row]()
wall, cpu = time.perf_counter() - w, time.process_time() - c
if old and row.startswith("boot"):
    wall, cpu = wall * 1000 / (reps + 1), cpu * 1000 / (reps + 1)  # reps + 1 metric calls
if old and row == "calibration_test":
    wall, cpu = wall * 200 / (reps + 1), cpu * 200 / (reps + 1)
print(json.dumps(dict(wall=wall, cpu=cpu, value=value)))
'''
ALL = ("boot_smooth,boot_debiased,boot_quantile,sweep_classwise,smooth_classwise,refine_brier,refine_log,refine_metric,error_rate,"
       "balanced_error_rate,calibration_test,bayes_risk_sweep")



def run(path: str, row: str, old: bool, reps: int) -> dict[str, float]:
    """Time ``row`` with the torchcal found in ``path``, in a fresh process (run from /tmp, so
    that the checkout's own folder is not on its path)."""
    code = ROW.format(path=path, row=row, old=old, reps=reps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="a folder holding another version's torchcal/ package")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]), help="this checkout by default")
    parser.add_argument("--rows", default=ALL, help=f"comma-separated, of {ALL}")
    parser.add_argument("--reps", type=int, default=20, help="replicates of the old version's bootstrap rows")
    args = parser.parse_args()
    print("| row | old wall s | old CPU s | new wall s | new CPU s | CPU ratio | value old | value new |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in args.rows.split(","):
        old, new = run(args.old, row, True, args.reps), run(args.new, row, False, args.reps)
        print(
            f"| {row} | {old['wall']:.2f} | {old['cpu']:.2f} | {new['wall']:.2f} | {new['cpu']:.2f} | "
            f"{old['cpu'] / new['cpu']:.1f} | {old['value']:.6f} | {new['value']:.6f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
