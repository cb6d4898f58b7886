"""Benchmark: calibration at GPU scale, against the device's memory bandwidth.

Sections (all on one CUDA device, float32 logits generated on the device with a seeded generator
by the recipe of ``bench_common.make_data``: latent ``z ~ 3 N(0, 1)``, labels drawn from
``softmax(z)``, observed ``2.5 (z @ A) + b``; over-confident and class-mixed):

- ``copy``: the bandwidth ceiling, a device-to-device copy of 4 GiB (bytes read + written).
- ``temperature``: temperature scaling on 1,000,000 x 1,000 (4 GB): torchcal's Newton solver, the
  floor of ten log-softmax passes, torchcal's generic L-BFGS and the gpleiss settings, each with
  the reached objective (float64) and the bytes the solver must read (one pass per evaluation).
- ``fits``: the 50,000 x 100 affine, vector, matrix and Dirichlet-ODIR fits of ``bench_fit.py``.
- ``dirichlet``: Dirichlet-ODIR (lambda = mu = 1e-3, the normalised ODIR of ``bench_fit.py``) on
  100,000 x 1,000: 1,001,000 parameters.
- ``metrics``: cross-entropy + Brier + ECE streamed over 1,000,000 x 1,000 in batches of 10,000
  and of 100,000 rows: torchcal's fused ``PosteriorQuality`` against torchmetrics' ``MulticlassCalibrationError``.
- ``syncs``: host synchronisations per solver iteration and per metric update, counted by
  ``torch.cuda.set_sync_debug_mode``.

Times are medians of ``--repeat`` runs after a warm-up, bracketed by ``torch.cuda.synchronize``.

Usage (on a machine with a GPU):
    python benchmarks/bench_gpu.py                       # every section, full size
    python benchmarks/bench_gpu.py --scale 0.1 --repeat 1 --sections temperature metrics
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import PROBLEMS, dirichlet_odir
from bench_temperature import gpleiss

import torchcal
from tests.sync_count import count_host_syncs
from torchcal.metrics import PosteriorQuality

DEVICE = torch.device("cuda")
GB = 1e9


def make_data(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``bench_common.make_data`` recipe, drawn on the GPU (same distribution, other draws)."""
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    mixing = torch.eye(k, device=DEVICE) + 0.05 * torch.randn(k, k, generator=g, device=DEVICE)
    bias = 0.5 * torch.randn(k, generator=g, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.empty(n, k, device=DEVICE)
    labels = torch.empty(n, dtype=torch.long, device=DEVICE)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        z = 3.0 * torch.randn(stop - start, k, generator=g, device=DEVICE)
        labels[start:stop] = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        logits[start:stop] = torch.addmm(bias, z, mixing, alpha=2.5)
    return logits, labels


def timed(run: Callable[[], object], repeat: int, warm_up: bool = True) -> tuple[float, object]:
    """Median seconds of ``repeat`` runs after one warm-up, and the last run's result."""
    result = run() if warm_up else None
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


# --------------------------------------------------------------------------- sections


def section_copy(args) -> float:
    x = torch.randn(1 << 30, device=DEVICE)
    y = torch.empty_like(x)
    seconds, _ = timed(lambda: y.copy_(x), 10)
    bandwidth = 2 * x.numel() * 4 / seconds / GB
    table("copy (the ceiling)", ["what", "time (ms)", "GB/s (read + write)"], [["4 GiB device-to-device copy", f"{1e3 * seconds:.2f}", f"{bandwidth:.0f}"]])
    del x, y
    torch.cuda.empty_cache()
    return bandwidth


def section_temperature(args, ceiling: float) -> None:
    n, k = int(1_000_000 * args.scale), 1000
    logits, labels = make_data(n, k)
    data_bytes = logits.numel() * 4
    problem = PROBLEMS["temperature"]
    rows = []

    def report(name, seconds, theta, passes, note=""):
        loss, grad = problem.evaluate(theta.to(DEVICE), logits, labels) if theta is not None else (float("nan"), float("nan"))
        gbs = passes * data_bytes / seconds / GB
        rows.append([name, f"{seconds:.3f}", f"{passes}", f"{gbs:.0f}", f"{gbs / ceiling:.2f}", f"{loss:.10f}", f"{grad:.1e}", note])

    def torchcal_fit():
        return torchcal.TemperatureScaling().fit(logits, labels)

    seconds, model = timed(torchcal_fit, args.repeat)
    # aminmax, the true-class gather and the float64 row means read the data once each, then
    # one pass per Newton evaluation
    passes = 3 + model.fit_record_.evaluations - 1
    report("torchcal TemperatureScaling", seconds, torch.tensor([1 / model.temperature]), passes, f"{model.fit_record_.evaluations - 1} Newton passes")
    def floor():
        for _ in range(10):
            torch.log_softmax(logits, 1)

    seconds, _ = timed(floor, args.repeat)
    report("floor: 10 x log_softmax", seconds, None, 20, "read + write each")
    seconds, beta = timed(lambda: gpleiss(logits, labels), 1)
    report("gpleiss settings (T0 = 1.5, lr 0.01, 200 it.)", seconds, beta, 0, "")

    def generic():
        model = torchcal.TemperatureScaling()
        model.num_classes = k
        model._materialize(k, DEVICE)
        torchcal.Calibrator._fit(model, logits, labels, None, "log", 1000)
        return model

    seconds, model = timed(generic, 1)
    report("torchcal generic L-BFGS (strong Wolfe)", seconds, torch.tensor([1 / model.temperature]), 0, "float32 features")
    table(
        f"temperature scaling, {n:,} x {k:,} float32 ({data_bytes / GB:.1f} GB)",
        ["row", "median s", "passes", "GB/s", "x ceiling", "objective", "max |grad|", "note"],
        rows,
    )
    del logits, labels
    torch.cuda.empty_cache()


def section_fits(args) -> None:
    """The 50,000 x 100 fits of ``bench_fit.py``, on the GPU."""
    logits, labels = make_data(int(50_000 * args.scale), 100)
    rows = []
    for name, make, problem, theta in (
        ("AffineCalibration", torchcal.AffineCalibration, PROBLEMS["affine"], lambda m: torch.cat([m.log_alpha.exp().view(1), m.beta])),
        ("VectorScaling", torchcal.VectorScaling, PROBLEMS["vector"], lambda m: torch.cat([m.weight, m.bias])),
        ("MatrixScaling", torchcal.MatrixScaling, PROBLEMS["matrix"], lambda m: torch.cat([m.weight, m.bias.unsqueeze(1)], 1)),
        ("DirichletCalibration(odir, 1e-3)", lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3),
         dirichlet_odir(1e-3, 1e-3), lambda m: torch.cat([m.weight, m.bias.unsqueeze(1)], 1)),
    ):
        seconds, model = timed(lambda: make().fit(logits, labels), args.repeat)
        loss, grad = problem.evaluate(theta(model).detach(), logits, labels)
        rows.append([name, f"{seconds:.3f}", f"{model.fit_record_.evaluations}", f"{loss:.10f}", f"{grad:.1e}"])
    table(f"fits, {logits.shape[0]:,} x 100 float32 on the GPU", ["calibrator", "median s", "evaluations", "objective", "max |grad|"], rows)


def section_dirichlet(args) -> None:
    n, k = int(100_000 * args.scale), 1000
    logits, labels = make_data(n, k)
    problem = dirichlet_odir(1e-3, 1e-3)
    rows = []

    def fit():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3, reg_mu=1e-3).fit(logits, labels)

    torch.cuda.reset_peak_memory_stats()
    try:
        seconds, model = timed(fit, 1, warm_up=False)  # tens of seconds: kernels' first-call costs are noise
    except torch.OutOfMemoryError as error:
        rows.append(["torchcal DirichletCalibration", "out of memory", "", "", "", "", str(error)[:60]])
    else:
        theta = torch.cat([model.weight, model.bias.unsqueeze(1)], 1)
        loss, grad = problem.evaluate(theta, logits, labels)
        r = model.fit_record_
        rows.append(["torchcal DirichletCalibration (Newton-CG)", f"{seconds:.2f}", f"{r.iterations}/{r.evaluations}", f"{loss:.10f}",
                     f"{grad:.1e}", str(r.converged), f"{torch.cuda.max_memory_allocated() / GB:.1f}"])
        print(rows[-1], flush=True)
    table(f"Dirichlet-ODIR, {n:,} x {k:,} ({k * (k + 1):,} parameters)",
          ["row", "s", "Newton iterations/passes", "objective", "max |grad|", "converged", "peak GB"], rows)
    del logits, labels
    torch.cuda.empty_cache()


def section_metrics(args, ceiling: float) -> None:
    n, k = int(1_000_000 * args.scale), 1000
    logits, labels = make_data(n, k)
    for batch in (10_000, 100_000):
        metrics_table(logits, labels, batch, args, ceiling)
    del logits, labels
    torch.cuda.empty_cache()


def metrics_table(logits: torch.Tensor, labels: torch.Tensor, batch: int, args, ceiling: float) -> None:
    from torchmetrics.classification import MulticlassCalibrationError

    (n, k) = logits.shape
    batches = [(logits[i : i + batch], labels[i : i + batch]) for i in range(0, n, batch)]
    data_bytes = logits.numel() * 4
    rows = []

    def fused(precision, validate=True):
        def run():
            metric = PosteriorQuality(k, 15, precision=precision, validate_args=validate).to(DEVICE)
            for z, y in batches:
                metric.update(z, y)
            return {name: float(v) for name, v in metric.compute().items()}

        return run

    def tm():
        metric = MulticlassCalibrationError(k, n_bins=15, norm="l1", validate_args=False).to(DEVICE)
        for z, y in batches:
            metric.update(z, y)
        return {"ece": float(metric.compute())}

    def floor():
        for z, _ in batches:
            torch.log_softmax(z, 1)
        return {}

    candidates = {
        "log_softmax pass (no metric)": floor,
        "torchcal PosteriorQuality float32": fused("float32"),
        "torchcal PosteriorQuality float32, no checks": fused("float32", False),
        "torchcal PosteriorQuality float64": fused("float64"),
        "torchmetrics MulticlassCalibrationError (ECE only)": tm,
    }
    times = {}
    for name, run in candidates.items():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times[name], values = timed(run, args.repeat)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        gbs = data_bytes / times[name] / GB
        shown = "  ".join(f"{key} {value:.5f}" for key, value in values.items() if key in ("cross_entropy", "brier", "ece"))
        rows.append([name, f"{1e3 * times[name]:.1f}", f"{gbs:.0f}", f"{gbs / ceiling:.2f}", f"{peak:.0f}", shown])
    reference = times["torchmetrics MulticlassCalibrationError (ECE only)"]
    for row, name in zip(rows, candidates):
        row.insert(2, f"{reference / times[name]:.2f}")
    table(f"streaming metrics, {n:,} x {k:,} float32 in batches of {batch:,}",
          ["row", "median ms", "x torchmetrics speed", "GB/s (logits read once)", "x ceiling", "peak MiB above data", "values"], rows)


def section_syncs(args) -> None:
    logits, labels = make_data(20_000, 100)
    rows = []
    for name, make in (
        ("TemperatureScaling", torchcal.TemperatureScaling),
        ("VectorScaling", torchcal.VectorScaling),
        ("DirichletCalibration(odir, 1e-3)", lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3)),
    ):
        make().fit(logits, labels)  # warm-up
        holder = {}
        syncs = count_host_syncs(lambda: holder.setdefault("m", make().fit(logits, labels)))
        r = holder["m"].fit_record_
        rows.append([f"{name}.fit", str(syncs), f"{r.iterations} it. / {r.evaluations} ev.", f"{syncs / max(r.evaluations, 1):.1f}"])
    for validate in (True, False):
        metric = PosteriorQuality(100, 15, precision="float32", validate_args=validate).to(DEVICE)
        metric.update(logits[:10_000], labels[:10_000])
        syncs = count_host_syncs(lambda: [metric.update(logits[i : i + 1000], labels[i : i + 1000]) for i in range(0, 10_000, 1000)])
        rows.append([f"PosteriorQuality.update (validate_args={validate})", str(syncs), "10 updates", f"{syncs / 10:.1f}"])
    table("host synchronisations", ["what", "syncs", "work", "per evaluation / update"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the default sizes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sections", nargs="+", default=["copy", "temperature", "metrics", "syncs", "fits", "dirichlet"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device.")
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"torch {torch.__version__}, {props.name}, {props.total_memory / 2**30:.0f} GiB, torchcal {torchcal.__version__}")
    ceiling = section_copy(args) if "copy" in args.sections else 3000.0
    for name in args.sections:
        start = time.perf_counter()
        if name == "temperature":
            section_temperature(args, ceiling)
        elif name == "dirichlet":
            section_dirichlet(args)
        elif name == "fits":
            section_fits(args)
        elif name == "metrics":
            section_metrics(args, ceiling)
        elif name == "syncs":
            section_syncs(args)
        elif name != "copy":
            sys.exit(f"unknown section {name!r}")
        print(f"({name}: {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
