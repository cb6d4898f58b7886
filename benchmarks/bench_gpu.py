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
  100,000 x 1,000: 1,001,000 parameters; time, Newton steps, passes, host syncs, peak memory.
- ``dirichlet-cv``: the default Dirichlet-ODIR fit (lambda cross-validated over ``--reg-grid``, by
  default the default grid) on the same data, then a fixed fit at the chosen lambda (``--verbose``
  logs the regularisation path as it goes).
- ``structured``: SVS / SMS at lambda = 1 on 10,000 x K (``--structured-k``, the seeded data of
  ``bench_structured.py``) on the GPU, against probmetrics and torchcal on the machine's CPU.
- ``real``: the default cross-validated Dir-ODIR, MS-ODIR, SVS and SMS fits on the real CIFAR-100
  logits (``TORCHCAL_REAL_DATA`` or ``../shared/data/real``) on the GPU, against the same fits on
  the CPU: time, host syncs, chosen lambda, the CV / fixed-lambda ratio.
- ``folds``: the default cross-validated Dir-ODIR and MS-ODIR fits with each grid point's folds
  fitted together as one batched problem (``cv_together=True``, the default on a GPU) and one by
  one, on the real CIFAR-100 logits and (Dir-ODIR) on synthetic N x K (``--folds-synthetic``,
  100,000 x 1,000 by default) over ``--reg-grid``: time,
  host syncs, Newton-CG passes, the chosen lambda, the largest parameter difference.
- ``svs-newton``: SVS on the GPU with its log-loss fits by Newton's method alone (the default
  there) against L-BFGS finished by Newton, at lambda = 1 on 10,000 x K (``--structured-k``),
  cross-validated there for K >= 1,000 and on the real CIFAR-10 / CIFAR-100 logits.
- ``metrics``: cross-entropy + Brier + ECE streamed over 1,000,000 x 1,000 in batches of 10,000
  and of 100,000 rows: torchcal's fused ``PosteriorQuality`` against torchmetrics' ``MulticlassCalibrationError``.
- ``syncs``: host synchronisations per solver iteration and per metric update, counted by
  ``torch.cuda.set_sync_debug_mode``.

Times are medians of ``--repeat`` runs after a warm-up, bracketed by ``torch.cuda.synchronize``.

Usage (on a machine with a GPU):
    python benchmarks/bench_gpu.py                       # every section, full size
    python benchmarks/bench_gpu.py --scale 0.1 --repeat 1 --sections temperature metrics
    python benchmarks/bench_gpu.py --sections real structured dirichlet dirichlet-cv --verbose
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
from torchcal.calibrators.matrix import DEFAULT_REG_GRID
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
    report("gpleiss settings (T0 = 1.5, lr 0.01, 50 it.)", seconds, beta, 0, "")

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


def fit_counted(make: Callable[[], torch.nn.Module], logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, object]:
    """Seconds and host synchronisations of one fit (no warm-up; counted while timed), and the model."""
    holder = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        syncs = count_host_syncs(lambda: holder.append(make().fit(logits, labels)))
    torch.cuda.synchronize()
    return time.perf_counter() - start, syncs, holder[0]


def section_dirichlet(args, cross_validate: bool = False) -> None:
    """Dirichlet-ODIR on 100,000 x 1,000 at lambda = mu = 1e-3, or (``cross_validate``) the default
    fit, which cross-validates lambda over the default grid, then a fixed fit at the chosen lambda."""
    n, k = int(100_000 * args.scale), 1000
    logits, labels = make_data(n, k)
    rows = []

    def run(name: str, make: Callable[[], torch.nn.Module]) -> object | None:
        torch.cuda.reset_peak_memory_stats()
        try:
            seconds, syncs, model = fit_counted(make, logits, labels)  # tens of seconds: first-call costs are noise
        except torch.OutOfMemoryError as error:
            rows.append([name, "out of memory", "", "", "", "", "", "", str(error)[:60]])
            return None
        theta = torch.cat([model.weight, model.bias.unsqueeze(1)], 1)
        loss, grad = dirichlet_odir(model.reg_lambda_, model.reg_mu_).evaluate(theta, logits, labels)
        r = model.fit_record_
        rows.append([name, f"{seconds:.2f}", f"{model.reg_lambda_:g}", f"{r.iterations}/{r.evaluations}", str(syncs), f"{loss:.10f}",
                     f"{grad:.1e}", str(r.converged), f"{torch.cuda.max_memory_allocated() / GB:.1f}"])
        print(rows[-1], model.cv_losses_ or "", flush=True)
        return model

    if not cross_validate:
        run("lambda = mu = 1e-3", lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-3, reg_mu=1e-3))
    elif (model := run(f"lambda cross-validated over {args.reg_grid or 'the default grid'}",
                       lambda: torchcal.DirichletCalibration(reg="odir", reg_grid=args.reg_grid or DEFAULT_REG_GRID))) is not None:
        lam, mu = model.reg_lambda_, model.reg_mu_
        run("fixed at the chosen lambda", lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam, reg_mu=mu))
    table(f"Dirichlet-ODIR, {n:,} x {k:,} ({k * (k + 1):,} parameters)",
          ["fit", "s", "lambda", "Newton steps/passes (final fit)", "host syncs", "objective", "max |grad|", "converged", "peak GB"], rows)
    del logits, labels
    torch.cuda.empty_cache()


def section_real(args) -> None:
    """The default cross-validated fits on the real CIFAR-100 logits (10,000 x 100), on the GPU:
    time, host syncs and the chosen lambda; the fixed fit at that lambda for the ratio; the same
    default fit on this machine's CPU for the selection and the parameters."""
    import numpy as np
    from bench_structured import REAL as real

    families = {
        "Dir-ODIR": (torchcal.DirichletCalibration, {"reg": "odir"}),
        "MS-ODIR": (torchcal.MatrixScaling, {"reg": "odir"}),
        "SVS": (torchcal.StructuredVectorScaling, {}),
        "SMS": (torchcal.StructuredMatrixScaling, {}),
    }
    rows = []
    for file in ("cifar100_resnet20_ferrer", "cifar100_vgg19bn_ferrer", "cifar100_repvgg-a2_ferrer", "cifar100_lenet5_netcal"):
        if not (real / f"{file}.npz").exists():
            print(f"{file}: not found in {real}")
            continue
        with np.load(real / f"{file}.npz") as d:
            cpu_logits, cpu_labels = torch.from_numpy(d["logits"]).float(), torch.from_numpy(d["labels"]).long()
        logits, labels = cpu_logits.to(DEVICE), cpu_labels.to(DEVICE)
        for family, (cls, kwargs) in families.items():
            if family not in args.families:
                continue
            if not rows:
                cls(**kwargs, reg_lambda=1.0).fit(logits, labels)  # warm-up: kernels' first calls
            seconds, syncs, model = fit_counted(lambda: cls(**kwargs), logits, labels)
            fixed = {"reg_lambda": model.reg_lambda_} | ({"reg_mu": model.reg_mu_} if "reg" in kwargs else {})
            fixed_seconds, _, _ = fit_counted(lambda: cls(**kwargs, **fixed), logits, labels)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                on_cpu = cls(**kwargs).fit(cpu_logits, cpu_labels)
            cpu_seconds = time.perf_counter() - start
            same = on_cpu.reg_lambda_ == model.reg_lambda_
            diff = max((a.detach().cpu() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), on_cpu.parameters()))
            test = -torch.log_softmax(model(logits).double(), 1)[torch.arange(len(labels)), labels].mean().item()
            rows.append([f"{file} {family}", f"{seconds:.2f}", str(syncs), f"{fixed_seconds:.3f}", f"{seconds / fixed_seconds:.1f}x",
                         f"{model.reg_lambda_:g}", f"{cpu_seconds:.2f} ({torch.get_num_threads()} threads)", "yes" if same else f"no ({on_cpu.reg_lambda_:g})",
                         f"{diff:.1e}", f"{test:.6f}"])
            print(rows[-1], flush=True)
    table("default cross-validated fits on the real CIFAR-100 logits (10,000 x 100), GPU against this machine's CPU",
          ["set / family", "GPU s", "host syncs", "GPU fixed-lambda s", "CV / fixed", "lambda", "CPU s", "same lambda on CPU", "max |param diff|", "training log-loss"], rows)


def section_folds(args) -> None:
    """The default cross-validated fits, each grid point's folds together and one by one."""
    import numpy as np
    from bench_structured import REAL as real

    import torchcal.calibrators.matrix as matrix

    solve, passes = matrix.fit_multinomial_logistic, [0]

    def counted(*arguments, **options):
        theta, record = solve(*arguments, **options)
        passes[0] += record.evaluations
        return theta, record

    matrix.fit_multinomial_logistic = counted
    problems = []
    for file in ("cifar100_resnet20_ferrer", "cifar100_vgg19bn_ferrer", "cifar100_repvgg-a2_ferrer", "cifar100_lenet5_netcal"):
        if (real / f"{file}.npz").exists():
            with np.load(real / f"{file}.npz") as d:
                logits, labels = torch.from_numpy(d["logits"]).float().to(DEVICE), torch.from_numpy(d["labels"]).long().to(DEVICE)
            problems += [(f"{file} {family}", cls, logits, labels, DEFAULT_REG_GRID) for family, cls in
                         (("Dir-ODIR", torchcal.DirichletCalibration), ("MS-ODIR", torchcal.MatrixScaling))]
    for size in args.folds_synthetic:
        n, k = (int(v) for v in size.split("x"))
        n = int(n * args.scale)
        problems.append((f"synthetic {n:,} x {k:,} Dir-ODIR", torchcal.DirichletCalibration, *make_data(n, k), args.reg_grid or DEFAULT_REG_GRID))
    torchcal.DirichletCalibration(reg="odir", cv_together=True).fit(*problems[0][2:4])  # warm-up: kernels' first calls
    rows = []
    for name, cls, logits, labels, grid in problems:
        results = {}
        for together in (True, False):
            passes[0] = 0
            torch.cuda.reset_peak_memory_stats()
            try:
                seconds, syncs, model = fit_counted(lambda: cls(reg="odir", reg_grid=grid, cv_together=together), logits, labels)
            except torch.OutOfMemoryError as error:
                rows.append([name, str(together), "out of memory", "", "", "", str(error)[:60]])
                torch.cuda.empty_cache()
                continue
            results[together] = (seconds, model)
            rows.append([name, "together" if together else "one by one", f"{seconds:.3f}", str(syncs), str(passes[0]), f"{model.reg_lambda_:g}",
                         f"{torch.cuda.max_memory_allocated() / GB:.1f}"])
            print(rows[-1], flush=True)
        if len(results) == 2:
            diff = max((a - b).abs().max().item() for a, b in zip(results[True][1].parameters(), results[False][1].parameters()))
            rows.append([name, "ratio, parameter difference", f"{results[False][0] / results[True][0]:.2f}x", "", "", "", f"{diff:.1e}"])
    matrix.fit_multinomial_logistic = solve
    table("default cross-validated fits: each grid point's folds together (one batched problem) and one by one",
          ["problem", "folds", "s", "host syncs", "Newton-CG passes", "lambda", "peak GB / max |param diff|"], rows)


def section_structured(args) -> None:
    """SVS / SMS at lambda = 1 (``bench_structured.py``'s rows, same seeded data) on the GPU, against
    probmetrics and torchcal on this machine's CPU (all threads), with the reached objective."""
    import bench_structured
    from bench_common import make_data as make_cpu_data

    rows = []
    for k in args.structured_k:
        n = 10_000
        cpu_logits, cpu_labels = make_cpu_data(n, k)
        logits, labels = cpu_logits.to(DEVICE), cpu_labels.to(DEVICE)
        problems = bench_structured._problems(n)
        for name in ("svs", "sms") if k <= 100 else ("sms",):
            repeat = args.repeat if k <= 100 else 1
            candidates = [("torchcal GPU", lambda: bench_structured.torchcal_fit(name)(logits, labels), True),
                          ("torchcal CPU", lambda: bench_structured.torchcal_fit(name)(cpu_logits, cpu_labels), False),
                          ("probmetrics CPU", lambda: bench_structured.probmetrics_fit(name)(cpu_logits, cpu_labels), False)]
            times, measured = {}, []
            for row, run, gpu in candidates:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        times[row], theta = timed(run, repeat, warm_up=gpu or k <= 100)
                except ImportError as error:
                    rows.append([f"{n:,} x {k} {name}", row, "not installed", "", "", str(error)[:50]])
                    continue
                loss, grad = problems[name].evaluate(theta.detach().cpu(), cpu_logits, cpu_labels)
                measured.append([f"{n:,} x {k} {name}", row, f"{times[row]:.3f}", "", f"{loss:.10f}", f"{grad:.1e}"])
            for cells in measured:
                cells[3] = f"{times[cells[1]] / times['torchcal GPU']:.1f}x"
            rows.extend(measured)
            print(*measured, sep="\n", flush=True)
    table("SVS / SMS (lambda = 1): torchcal on the GPU against probmetrics and torchcal on the CPU (all threads)",
          ["problem", "row", "median s", "x torchcal GPU time", "objective", "max |grad|"], rows)


def section_svs_newton(args) -> None:
    """SVS on the GPU with every log-loss fit by Newton's method alone (the default up to
    ``_NEWTON_DEVICE_CLASSES`` classes, forced here for every K) against L-BFGS finished by Newton
    (the CPU's path above ``_NEWTON_CPU_CLASSES``; L-BFGS alone above ``_NEWTON_POLISH_CLASSES``):
    lambda = 1 on the seeded 10,000 x K data of ``bench_structured.py`` (and the default
    cross-validated fit there for K >= 1,000), and the default cross-validated fit on the real
    logits; time, host syncs, the chosen lambda and the largest parameter difference."""
    import numpy as np
    from bench_common import make_data as make_cpu_data
    from bench_structured import REAL as real

    import torchcal.calibrators.structured as structured

    problems = [(f"10,000 x {k}, lambda = 1", *make_cpu_data(10_000, k), 1.0) for k in args.structured_k]
    problems += [(f"10,000 x {k}, default CV", *make_cpu_data(10_000, k), None) for k in args.structured_k if k >= 1000]
    for file in ("cifar10_resnet110_kangsepp", "cifar100_resnet20_ferrer", "cifar100_vgg19bn_ferrer",
                 "cifar100_repvgg-a2_ferrer", "cifar100_lenet5_netcal"):
        if (real / f"{file}.npz").exists():
            with np.load(real / f"{file}.npz") as d:
                problems.append((f"{file}, default CV", torch.from_numpy(d["logits"]).float(), torch.from_numpy(d["labels"]).long(), None))
    default = structured._NEWTON_DEVICE_CLASSES
    rows = []
    for name, cpu_logits, cpu_labels, reg_lambda in problems:
        logits, labels = cpu_logits.to(DEVICE), cpu_labels.to(DEVICE)
        fitted = {}
        for path, classes in (("Newton alone", 1 << 30), ("L-BFGS, then Newton", 0)):
            structured._NEWTON_DEVICE_CLASSES = classes
            try:
                torchcal.StructuredVectorScaling(reg_lambda=1.0).fit(logits, labels)  # warm-up
                fitted[path] = fit_counted(lambda: torchcal.StructuredVectorScaling(reg_lambda=reg_lambda), logits, labels)
            finally:
                structured._NEWTON_DEVICE_CLASSES = default
        (newton_s, newton_syncs, newton), (lbfgs_s, lbfgs_syncs, lbfgs) = fitted.values()
        diff = max((a - b).abs().max().item() for a, b in zip(newton.parameters(), lbfgs.parameters()))
        rows.append([name, f"{newton_s:.3f} ({newton_syncs})", f"{lbfgs_s:.3f} ({lbfgs_syncs})", f"{lbfgs_s / newton_s:.1f}x",
                     f"{newton.reg_lambda_:g} / {lbfgs.reg_lambda_:g}", f"{diff:.1e}"])
        print(rows[-1], flush=True)
    table("SVS on the GPU: Newton alone against L-BFGS finished by Newton",
          ["problem", "Newton alone: s (host syncs)", "L-BFGS, then Newton: s (host syncs)", "ratio", "lambda", "max |param diff|"], rows)


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
    parser.add_argument("--sections", nargs="+", default=["copy", "temperature", "metrics", "syncs", "fits", "dirichlet", "structured", "svs-newton", "real", "dirichlet-cv", "folds"])
    parser.add_argument("--families", nargs="+", default=["Dir-ODIR", "MS-ODIR", "SVS", "SMS"], help="families of the real section")
    parser.add_argument("--structured-k", nargs="+", type=int, default=[10, 100, 1000], help="K of the structured section")
    parser.add_argument("--reg-grid", nargs="+", type=float, help="lambdas of the dirichlet-cv and folds sections (default: the default grid)")
    parser.add_argument("--folds-synthetic", nargs="+", default=["100000x1000"], help="N x K of the folds section's synthetic problems")
    parser.add_argument("--verbose", action="store_true", help="log the regularisation paths and Newton steps")
    args = parser.parse_args()
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
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
        elif name == "dirichlet-cv":
            section_dirichlet(args, cross_validate=True)
        elif name == "real":
            section_real(args)
        elif name == "folds":
            section_folds(args)
        elif name == "structured":
            section_structured(args)
        elif name == "svs-newton":
            section_svs_newton(args)
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
