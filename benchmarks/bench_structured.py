"""Benchmark: structured vector and matrix scaling (SVS, SMS; Berta et al. 2025) against
probmetrics' implementation (its default L-BFGS path, pytorch-minimize) at the paper's default
penalties (lambda = 1).

Usage:
    python benchmarks/bench_structured.py --n 10000 --k 10  --repeat 3
    python benchmarks/bench_structured.py --n 10000 --k 100 --repeat 1
    python benchmarks/bench_structured.py --n 10000 --k 1000 --repeat 1 --problem sms
    python benchmarks/bench_structured.py --smoke
    BENCH_CLOCK=cpu python benchmarks/bench_structured.py ...   # CPU seconds instead of wall time
    python benchmarks/bench_structured.py --real          # test log-loss on the real logits
    python benchmarks/bench_structured.py --real sst2_gpt2-0shot_ferrer --methods uncalibrated Platt quadratic

Data and measurement: see ``bench_common.py``. Both implementations preprocess with ts-mix
(temperature scaling, then mixing with the uniform distribution at weight 1 / (N + 1)); their
temperatures agree to 1e-8, so the objective is evaluated for every row on torchcal's float64
ts-mix features: the mean log-loss of the map plus the penalties, at the row's fitted map
(``theta = [weight | bias]``, the weight including the identity).
probmetrics needs numba at import only for its SAGA solvers, which are not run here; without
numba installed a stub decorator stands in for ``numba.njit``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Problem, Row, main, make_data, probmetrics_get_calibrator


@functools.cache
def _ts_mix_state(n: int, k: int) -> tuple[float, float]:
    """Inverse temperature and mixing weight of the ts-mix step on the benchmark's fit set."""
    import torchcal

    logits, labels = make_data(n, k)
    beta = 1 / torchcal.TemperatureScaling().fit(logits, labels).temperature
    return beta, 1 / (n + 1)


def _ts_mix(z: torch.Tensor, n: int) -> torch.Tensor:
    beta, eps = _ts_mix_state(n, z.shape[1])
    return torch.log((1 - eps) * torch.softmax(beta * z, dim=1) + eps / z.shape[1])


def _structured_penalty(n: int, matrix: bool):
    def penalty(theta: torch.Tensor, k: int) -> torch.Tensor:
        if not matrix:  # theta = [weight, bias]
            return k / n * ((theta[:k] - 1).square().sum() + theta[k:].square().sum())
        w = theta.view(k, k + 1)
        deviation = w[:, :k] - torch.eye(k, dtype=w.dtype)
        diag = deviation.diagonal().square().sum()
        return k / n * (diag + w[:, k].square().sum()) + k * (k - 1) / n * (deviation.square().sum() - diag)

    return penalty


def _problems(n: int) -> dict[str, Problem]:
    def vector(x, t):
        return t[: x.shape[1]] * x + t[x.shape[1] :]

    def full(x, t):
        k = x.shape[1]
        w = t.view(k, k + 1)
        return x @ w[:, :k].T + w[:, k]

    features = functools.partial(_ts_mix, n=n)
    return {
        "svs": Problem("svs", features, vector, _structured_penalty(n, matrix=False)),
        "sms": Problem("sms", features, full, _structured_penalty(n, matrix=True)),
    }


def torchcal_fit(name: str):
    def fit(logits, labels):
        import torchcal

        cls = torchcal.StructuredMatrixScaling if name == "sms" else torchcal.StructuredVectorScaling
        model = cls(reg_lambda=1.0).fit(logits, labels)
        if name == "sms":
            return torch.cat([model.weight.detach(), model.bias.detach().unsqueeze(1)], dim=1).flatten()
        return torch.cat([model.weight.detach(), model.bias.detach()])

    return fit


def probmetrics_fit(name: str):
    def fit(logits, labels):
        get_calibrator = probmetrics_get_calibrator()
        probs = torch.softmax(logits.double(), dim=1).numpy()
        model = get_calibrator(name).fit(probs, labels.numpy())
        if name == "sms":
            return torch.from_numpy(model.W_).double().flatten()
        return torch.cat([torch.from_numpy(model.v_), torch.from_numpy(model.b_)]).double()

    return fit


ROWS = {
    name: [
        Row(f"torchcal {name.upper()}", torchcal_fit(name)),
        Row(f"probmetrics {name}", probmetrics_fit(name), needs=("probmetrics", "torchmin"), note="float32 BFGS (L-BFGS above 1,000 parameters)"),
    ]
    for name in ("svs", "sms")
}


# ------------------------------------------------------------------------ real logits (--real)
REAL = Path(os.environ.get("TORCHCAL_REAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data" / "real"))


def _probmetrics_method(name: str):
    """A torchcal-style calibrator factory around probmetrics' ``get_calibrator(name)``: fit on
    posteriors, predict log-posteriors."""

    class Wrapped:
        def fit(self, logits, labels):
            self.model = probmetrics_get_calibrator()(name).fit(torch.softmax(logits.double(), 1).numpy(), labels.numpy())
            return self

        def __call__(self, logits):
            probs = self.model.predict_proba(torch.softmax(logits.double(), 1).numpy())
            return torch.from_numpy(probs).log()

    return Wrapped


def real_table(files: list[str], methods: list[str] | None = None, folds: int = 5) -> None:
    """Test log-loss on real logits: CIFAR-10 ResNet-110 fitted on its validation split and
    scored on its test split; the other files by ``folds``-fold cross-validation (within which the
    "CV lambda" rows cross-validate their lambda again, on each training part)."""
    import time

    import numpy as np

    import torchcal
    from torchcal.fit import fold_indices

    odir = {"reg": "odir", "reg_lambda": 10.0}
    every = {
        "uncalibrated": None,
        "TS": torchcal.TemperatureScaling,
        "Dir-ODIR (CV lambda)": lambda: torchcal.DirichletCalibration(reg="odir"),
        "MS-ODIR (CV lambda)": lambda: torchcal.MatrixScaling(reg="odir"),
        "Dir-ODIR (lambda = mu = 10)": lambda: torchcal.DirichletCalibration(**odir),
        "MS-ODIR (lambda = mu = 10)": lambda: torchcal.MatrixScaling(**odir),
        "SVS (lambda = 1)": lambda: torchcal.StructuredVectorScaling(reg_lambda=1.0),
        "SMS (lambda = 1)": lambda: torchcal.StructuredMatrixScaling(reg_lambda=1.0),
        "SVS (CV lambda)": torchcal.StructuredVectorScaling,
        "SMS (CV lambda)": torchcal.StructuredMatrixScaling,
        "probmetrics ts-mix": _probmetrics_method("ts-mix"),
        "probmetrics svs": _probmetrics_method("svs"),
        "probmetrics sms": _probmetrics_method("sms"),
        "Platt": torchcal.PlattScaling,
        "quadratic": torchcal.QuadraticScaling,
        "probmetrics quadratic-scaling": _probmetrics_method("quadratic-scaling"),
    }
    methods = methods or [m for m in every if "lambda = mu" not in m and "uadratic" not in m and m != "Platt"]
    if importlib.util.find_spec("probmetrics") is None:  # (skipped with a note, as the other tables do)
        skipped = [m for m in methods if m.startswith("probmetrics")]
        if skipped:
            print(f"# skipped: {', '.join(skipped)} (probmetrics not installed)")
        methods = [m for m in methods if m not in skipped]
    print(f"| method | {' | '.join(files)} |")
    print("|---|" + "---:|" * len(files))
    rows: dict[str, list[str]] = {name: [] for name in methods}
    for file in files:
        with np.load(REAL / f"{file}.npz") as d:
            data = {k: torch.from_numpy(d[k]) for k in d.files if k.startswith(("logits", "labels"))}
        for name in methods:
            make = every[name]
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if "logits_val" in data:  # the published calibration / test split
                    logits, labels = data["logits"], data["labels"]
                    out = torch.log_softmax(logits.double(), 1) if make is None else make().fit(data["logits_val"], data["labels_val"])(logits)
                else:
                    logits, labels = data["logits"], data["labels"]
                    out = torch.empty(logits.shape, dtype=torch.float64)
                    for test in fold_indices(labels, folds, 0):
                        train = torch.ones(len(labels), dtype=torch.bool)
                        train[test] = False
                        out[test] = (torch.log_softmax(logits[test].double(), 1) if make is None
                                     else make().fit(logits[train], labels[train])(logits[test]).detach().double())
            nll = -out.detach().double()[torch.arange(len(labels)), labels].mean().item()
            rows[name].append(f"{nll:.4f} ({time.perf_counter() - start:.1f} s)")
            print(f"  ... {file} {name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    for name, cells in rows.items():
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    if os.environ.get("BENCH_CLOCK") == "cpu":
        # On a machine shared with other jobs a process may get a quarter of a core: CPU seconds of
        # the (single-threaded) fitting process are then the fair measure. Inherited by every row.
        import time

        import bench_common

        bench_common.time = types.SimpleNamespace(perf_counter=time.process_time)
        if "--_row" not in sys.argv:
            print("# times below are CPU seconds of the fitting process (BENCH_CLOCK=cpu), not wall time")
    if "--real" in sys.argv:  # --real [FILE ...] [--methods NAME ...]
        args = sys.argv[sys.argv.index("--real") + 1 :]
        cut = args.index("--methods") if "--methods" in args else len(args)
        real_table(args[:cut] or ["cifar10_resnet110_kangsepp", "cifar100_resnet20_ferrer", "cifar100_vgg19bn_ferrer",
                                  "cifar100_repvgg-a2_ferrer", "cifar100_lenet5_netcal"], args[cut + 1 :] or None)
        sys.exit()
    n = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--n=")), None)
    if n is None and "--n" in sys.argv:
        n = int(sys.argv[sys.argv.index("--n") + 1])
    n = 2000 if "--smoke" in sys.argv else (n or 10_000)
    main("SVS / SMS fit (lambda = 1) against probmetrics", ROWS, _problems(n), default_n=10_000, default_k=100, epilog=__doc__)
