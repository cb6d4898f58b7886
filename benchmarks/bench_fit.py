"""Benchmark: affine calibration, vector scaling, matrix scaling and Dirichlet calibration with
ODIR on n x k logits (default 50,000 x 100), against every alternative installed.

Usage:
    python benchmarks/bench_fit.py                                   # all four, 50,000 x 100
    python benchmarks/bench_fit.py --problem affine vector           # some of them
    python benchmarks/bench_fit.py --smoke                           # 2,000 x 10, seconds
    python benchmarks/bench_fit.py --problem dirichlet-odir --reg 0.01
    python benchmarks/bench_fit.py --sweep --n 10000 --repeat 3      # Dir-/MS-ODIR at every lambda of the grid
    python benchmarks/bench_fit.py --sweep --n 10000 --tol 1e-6      # stopped at the issue's "converged"
    python benchmarks/bench_fit.py --sweep --n 10000 --k 1000 --lambdas 1e-3
    python benchmarks/bench_fit.py --cv --n 10000                    # cross-validated lambda vs one fit

Data and measurement: see ``bench_common.py``. Every row's fitted map is evaluated in the same
parametrisation (affine ``[alpha, b]`` on log-posteriors, vector ``[w, b]`` and matrix ``[W | b]``
on logits, Dirichlet ``[W | b]`` on log-posteriors plus the ODIR penalty ``lambda / (K (K-1))
sum_{i != j} W_ij^2 + mu / K sum b^2`` with ``lambda = mu = --reg``); "converged" means the
largest absolute gradient entry there is below 1e-6. Libraries with another convention get the
equivalent strengths (dirichletcal: ``reg_norm=False``, ``ref_row=False``).

``--sweep`` fits Dirichlet-ODIR and matrix-ODIR at every lambda of the default grid (mu = lambda)
in this process and reports, per fit, the passes over the data the solver made (gradients and
Hessian-vector products), its time, and that time divided by the time of one forward+backward pass
(the float64 autograd evaluation of the objective and its gradient by ``bench_common``, which also
says whether the fit converged); torch-uncertainty's scalers (at lambda = --reg) are timed in the
same run. ``--cv`` times the default ``DirichletCalibration(reg="odir").fit`` (5-fold
cross-validated lambda) against one fit at the lambda it selects.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    PROBLEMS,
    SCIPY_NOTE,
    Problem,
    Row,
    dirichlet_odir,
    identity_theta,
    main,
    make_data,
    matrix_odir,
    scipy_lbfgs,
    torch_uncertainty_fit,
)

# --reg is read before argparse runs in the children too, so every process sees the same penalty.
REG = float(sys.argv[sys.argv.index("--reg") + 1]) if "--reg" in sys.argv else 1e-3
if "--reg" in sys.argv:
    del sys.argv[sys.argv.index("--reg") : sys.argv.index("--reg") + 2]
    os.environ["BENCH_FIT_REG"] = str(REG)
REG = float(os.environ.get("BENCH_FIT_REG", REG))

PROBLEM_SET = {**{name: PROBLEMS[name] for name in ("affine", "vector", "matrix")}, "dirichlet-odir": dirichlet_odir(REG, REG)}


def _theta(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in parts])


def _full_theta(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight.detach().double(), bias.detach().double().reshape(-1, 1)], dim=1).flatten()


# --------------------------------------------------------------------------- torchcal
def torchcal_affine(logits, labels):
    import torchcal

    cal = torchcal.AffineCalibration().fit(logits, labels)
    return _theta(cal.log_alpha.exp(), cal.beta)


def torchcal_vector(logits, labels):
    import torchcal

    cal = torchcal.VectorScaling().fit(logits, labels)
    return _theta(cal.weight, cal.bias)


def torchcal_matrix(logits, labels):
    import torchcal

    cal = torchcal.MatrixScaling().fit(logits, labels)
    return _full_theta(cal.weight, cal.bias)


def torchcal_dirichlet(logits, labels):
    import torchcal

    cal = torchcal.DirichletCalibration(reg="odir", reg_lambda=REG, reg_mu=REG).fit(logits, labels)
    return _full_theta(cal.weight, cal.bias)


def torchcal_generic(make, extract):
    """torchcal's generic driver (strong-Wolfe L-BFGS, float64) on the same model and objective."""

    def fit(logits, labels):
        import torchcal

        model = make()
        model.num_classes = logits.shape[1]
        model._materialize(logits.shape[1])
        torchcal.Calibrator._fit(model, model._features(logits.double()), labels, None, "log", 1000)
        return extract(model)

    return fit


# --------------------------------------------------------------------------- alternatives
def psrcal_affine(logits, labels):
    from psrcal.calibration import AffineCalLogLoss

    cal = AffineCalLogLoss(torch.log_softmax(logits.double(), 1), labels, bias=True)
    cal.train()
    return _theta(torch.as_tensor(cal.temp).reshape(1), torch.as_tensor(cal.bias))


def tu_vector(logits, labels):
    scaler = torch_uncertainty_fit("VectorScaler", logits, labels, num_classes=logits.shape[1])
    return _theta(scaler.inv_temp, torch.zeros(logits.shape[1]))


def tu_matrix(logits, labels):
    scaler = torch_uncertainty_fit("MatrixScaler", logits, labels, num_classes=logits.shape[1])
    return _full_theta(scaler.inv_temperature_weight, scaler.inv_temperature_bias)


def tu_dirichlet(logits, labels):
    scaler = torch_uncertainty_fit("DirichletScaler", logits, labels, num_classes=logits.shape[1], lambda_reg=REG, mu_reg=REG)
    return _full_theta(scaler.inv_temperature_weight, scaler.inv_temperature_bias)


def dirichletcal(kind):
    def fit(logits, labels):
        from dirichletcal.calib.fulldirichlet import FullDirichletCalibrator
        from dirichletcal.calib.matrixscaling import MatrixScaling
        from dirichletcal.calib.vectorscaling import VectorScaling

        k = logits.shape[1]
        y = labels.numpy()
        if kind == "vector":
            cal = VectorScaling(logit_input=True).fit(logits.double().numpy(), y)
            return _theta(torch.as_tensor(cal.coef_).diagonal(), torch.as_tensor(cal.intercept_))
        if kind == "matrix":
            cal = MatrixScaling(logit_input=True).fit(logits.double().numpy(), y)
        else:
            probs = torch.softmax(logits.double(), 1).numpy()
            cal = FullDirichletCalibrator(reg_lambda=REG / (k * (k - 1)), reg_mu=REG / k, ref_row=False).fit(probs, y)
        return _full_theta(torch.as_tensor(cal.coef_), torch.as_tensor(cal.intercept_))

    return fit


def scipy(problem):
    def fit(logits, labels):
        return scipy_lbfgs(PROBLEM_SET[problem], identity_theta(problem, logits.shape[1]), logits, labels)

    return fit


# dirichletcal precomputes N (K+1)^2 outer products, and jax holds several copies of them
DIRICHLETCAL_MEMORY = lambda n, k: 5 * 8 * n * (k + 1) ** 2


def _extract_affine(model):
    return _theta(model.log_alpha.exp(), model.beta)


def _extract_vector(model):
    return _theta(model.weight, model.bias)


def _make_affine():
    import torchcal

    return torchcal.AffineCalibration()


def _make_vector():
    import torchcal

    return torchcal.VectorScaling()


ROWS = {
    "affine": [
        Row("torchcal AffineCalibration", torchcal_affine, note="Newton, (K+1)^2 Hessian"),
        Row("torchcal generic L-BFGS", torchcal_generic(_make_affine, _extract_affine), note="same model"),
        Row("psrcal AffineCalLogLoss", psrcal_affine, needs=("psrcal",), note="SciPy L-BFGS-B, 100 it."),
        Row("SciPy L-BFGS-B", scipy("affine"), needs=("scipy",), note=SCIPY_NOTE),
    ],
    "vector": [
        Row("torchcal VectorScaling", torchcal_vector, note="Newton, (2K)^2 Hessian"),
        Row("torchcal generic L-BFGS", torchcal_generic(_make_vector, _extract_vector), note="same model"),
        Row("torch-uncertainty VectorScaler", tu_vector, needs=("torch_uncertainty",), note="defaults; no bias: a smaller model"),
        Row("dirichletcal VectorScaling", dirichletcal("vector"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY, slow=True),
        Row("SciPy L-BFGS-B", scipy("vector"), needs=("scipy",), note=SCIPY_NOTE),
    ],
    "matrix": [
        Row("torchcal MatrixScaling", torchcal_matrix),
        Row("torch-uncertainty MatrixScaler", tu_matrix, needs=("torch_uncertainty",), note="defaults"),
        Row("dirichletcal MatrixScaling", dirichletcal("matrix"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY, slow=True),
        Row("SciPy L-BFGS-B", scipy("matrix"), needs=("scipy",), note=SCIPY_NOTE),
    ],
    "dirichlet-odir": [
        Row("torchcal DirichletCalibration(odir)", torchcal_dirichlet),
        Row("torch-uncertainty DirichletScaler", tu_dirichlet, needs=("torch_uncertainty",), note="defaults"),
        Row("dirichletcal FullDirichletCalibrator", dirichletcal("dirichlet"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY,
            slow=True, note="ref_row=False"),
        Row("SciPy L-BFGS-B", scipy("dirichlet-odir"), needs=("scipy",), note=SCIPY_NOTE),
    ],
}

# --------------------------------------------------------------------------- --sweep and --cv
def _pass_time(problem: Problem, theta: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Median of three forward+backward passes (objective and gradient, float64 autograd)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        problem.evaluate(theta, logits, labels)
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def _timed(fit, repeat: int = 1):
    """The median time of ``repeat`` calls of ``fit`` and the last call's result."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fit()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result


def _data(n: int, k: int, real: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic data of bench_common, or the logits and labels of a real .npz file."""
    if real is None:
        return make_data(n, k)
    import numpy as np

    with np.load(real) as f:
        return torch.from_numpy(f["logits"]), torch.from_numpy(f["labels"])


def sweep(logits: torch.Tensor, labels: torch.Tensor, lambdas: list[float], alternatives: bool, repeat: int, tol: float) -> None:
    import torchcal

    n, k = logits.shape
    # torch-uncertainty's scalers use torch.optim.LBFGS, whose first use imports torch._dynamo (1.6 s),
    # which its first timed fit would pay
    torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))])
    print(f"\n## Fixed-lambda fits, {n:,} x {k} (mu = lambda), 1 thread, the median time of {repeat} fits, tol = {tol:g}\n")
    print("| model | lambda | time (s) | passes | Newton it. | pass time (s) | time / pass | objective | max abs gradient | converged | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, make, problem_of in (
        ("Dir-ODIR", torchcal.DirichletCalibration, dirichlet_odir),
        ("MS-ODIR", torchcal.MatrixScaling, matrix_odir),
    ):
        pass_time = None
        for lam in lambdas:
            seconds, cal = _timed(lambda: make(reg="odir", reg_lambda=lam, tol=tol).fit(logits, labels), repeat)
            problem = problem_of(lam, lam)
            theta = _full_theta(cal.weight, cal.bias)
            pass_time = pass_time or _pass_time(problem, theta, logits, labels)
            objective, grad = problem.evaluate(theta, logits, labels)
            r = cal.fit_record_
            print(f"| torchcal {name} | {lam:g} | {seconds:.2f} | {r.evaluations} | {r.iterations} | {pass_time:.4f} | {seconds / pass_time:.0f} | "
                  f"{objective:.10f} | {grad:.1e} | {'yes' if grad <= 1e-6 else 'no'} | {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} |", flush=True)
        if not alternatives:
            continue
        try:
            if name == "Dir-ODIR":
                seconds, scaler = _timed(lambda: torch_uncertainty_fit("DirichletScaler", logits, labels, num_classes=k, lambda_reg=REG, mu_reg=REG), repeat)
                problem = dirichlet_odir(REG, REG)
            else:
                seconds, scaler = _timed(lambda: torch_uncertainty_fit("MatrixScaler", logits, labels, num_classes=k), repeat)
                problem = matrix_odir(0.0, 0.0)
        except ImportError as error:
            print(f"| torch-uncertainty | | skipped: {error} | | | | | | | | |")
            continue
        theta = _full_theta(scaler.inv_temperature_weight, scaler.inv_temperature_bias)
        objective, grad = problem.evaluate(theta, logits, labels)
        label = f"torch-uncertainty {'DirichletScaler' if name == 'Dir-ODIR' else 'MatrixScaler (no penalty)'}"
        lam = REG if name == "Dir-ODIR" else 0.0
        print(f"| {label} | {lam:g} | {seconds:.2f} | | | {pass_time:.4f} | {seconds / pass_time:.0f} | {objective:.10f} | {grad:.1e} | "
              f"{'yes' if grad <= 1e-6 else 'no'} | |", flush=True)


def cross_validation(logits: torch.Tensor, labels: torch.Tensor) -> None:
    import torchcal

    n, k = logits.shape
    seconds_cv, cal = _timed(lambda: torchcal.DirichletCalibration(reg="odir").fit(logits, labels))
    lam = cal.reg_lambda_
    seconds_fixed, fixed = _timed(lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=lam).fit(logits, labels))
    tried = sum(v < float("inf") for v in cal.cv_losses_)
    difference = float((cal.weight - fixed.weight).detach().abs().max())
    print(f"\n## Dir-ODIR with cross-validated lambda, {n:,} x {k}, 1 thread\n")
    print("| fit | time (s) | ratio | selected lambda | grid points fully cross-validated | max abs parameter difference |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| default `DirichletCalibration(reg=\"odir\").fit` (5-fold CV over {len(cal.reg_grid)} lambdas) | {seconds_cv:.2f} | {seconds_cv / seconds_fixed:.1f} | {lam:g} | {tried} | {difference:.1e} |")
    print(f"| one fit at lambda = {lam:g} | {seconds_fixed:.2f} | 1.0 | | | |")


if __name__ == "__main__" and ("--sweep" in sys.argv or "--cv" in sys.argv):
    import torchcal.calibrators.matrix

    parser = argparse.ArgumentParser(description="Dir-/MS-ODIR lambda sweep and cross-validation")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cv", action="store_true")
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--lambdas", type=float, nargs="*", default=list(torchcal.calibrators.matrix.DEFAULT_REG_GRID)[::-1])
    parser.add_argument("--no-alternatives", action="store_true")
    parser.add_argument("--real", default=None, help="an .npz file with logits and labels instead of the synthetic data")
    parser.add_argument("--repeat", type=int, default=1, help="--sweep: the median time of this many fits per row")
    parser.add_argument("--tol", type=float, default=1e-9, help="--sweep: torchcal's gradient tolerance (1e-6: the issue's 'converged')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch {torch.__version__}")
    logits, labels = _data(args.n, args.k, args.real)
    if args.sweep:
        sweep(logits, labels, args.lambdas, not args.no_alternatives, args.repeat, args.tol)
    if args.cv:
        cross_validation(logits, labels)
    sys.exit(0)


if __name__ == "__main__":
    main(f"affine / vector / matrix / Dirichlet-ODIR (lambda = mu = {REG:g}) fits", ROWS, PROBLEM_SET, 50_000, 100, epilog=__doc__)
