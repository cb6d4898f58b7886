"""Shared machinery of the fitting benchmarks (not a benchmark itself).

Data (seeded, the recipe of the reference notes §9): latent logits ``z ~ 3 N(0, 1)`` of shape
(n, k); labels ``y ~ Categorical(softmax(z))``, so ``z`` is calibrated; observed logits
``2.5 (z @ A) + b`` with ``A = I + 0.05 N(0, 1)`` and ``b = 0.5 N(0, 1)`` drawn once from seed
1234: over-confident by 2.5, mildly class-mixed and class-biased, float32. Fit set: seed 0.

Every row runs in its own Python process, which generates the data (not timed), runs the fit once
as a warm-up (not timed), then ``--repeat`` more times, and reports the median time. Peak memory
is the growth of the process's peak resident set size while the row runs, on top of the data.
Rows whose package is missing are skipped with a note. The fitted parameters of every row are
mapped to one common parametrisation and the objective and its gradient are evaluated there in
float64 by the same code, so "reached objective" and "converged" mean the same for every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: converged when the largest absolute entry of the objective's gradient is below this
GRAD_TOL = 1e-6
#: iteration cap of the plain SciPy fits (--scipy-max-iter; 300 with --smoke unless given), printed in the header
SCIPY_MAX_ITER = 2000
SCIPY_NOTE = "NumPy float64, analytic gradient, gtol 1e-7, at most --scipy-max-iter iterations"


def make_data(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded synthetic logits (n, k) float32 and labels (n,); see the module docstring."""
    g = torch.Generator().manual_seed(1234)
    mixing = torch.eye(k) + 0.05 * torch.randn(k, k, generator=g)
    bias = 0.5 * torch.randn(k, generator=g)
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(n, k)
    labels = torch.empty(n, dtype=torch.long)
    for start in range(0, n, 100_000):  # batches keep the temporaries small at 1,000,000 x 1,000
        stop = min(n, start + 100_000)
        z = 3.0 * torch.randn(stop - start, k, generator=g)
        labels[start:stop] = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        logits[start:stop] = torch.addmm(bias, z, mixing, alpha=2.5)
    return logits, labels


# --------------------------------------------------------------------------- common objectives
@dataclass(frozen=True)
class Problem:
    """A calibration objective in one common parametrisation ``theta`` (float64)."""

    name: str
    features: Callable[[torch.Tensor], torch.Tensor]  # logits (n, k) float64 -> x (n, k)
    scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, theta) -> (n, k)
    penalty: Callable[[torch.Tensor, int], torch.Tensor] = lambda theta, k: theta.new_zeros(())

    def evaluate(self, theta: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
        """Objective and the largest absolute gradient entry at ``theta``."""
        n, k = logits.shape
        theta = theta.detach().double().flatten().clone().requires_grad_(True)
        loss = self.penalty(theta, k)
        grad = torch.autograd.grad(loss, theta)[0] if loss.requires_grad else torch.zeros_like(theta)
        for start in range(0, n, 10_000):  # chunks keep float64 copies small at 1,000,000 x 1,000
            x = self.features(logits[start : start + 10_000].double())
            part = torch.nn.functional.cross_entropy(self.scores(x, theta), labels[start : start + 10_000], reduction="sum") / n
            grad = grad + torch.autograd.grad(part, theta)[0]
            loss = loss + part.detach()
        return float(loss.detach()), float(grad.abs().max())


def _full(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    w = theta.view(k, k + 1)
    return x @ w[:, :k].T + w[:, k]


def odir_penalty(reg_lambda: float, reg_mu: float) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """ODIR in torchcal's (Kull et al.'s normalised) convention on ``theta = [W | b]``."""

    def penalty(theta: torch.Tensor, k: int) -> torch.Tensor:
        w = theta.view(k, k + 1)
        off = w[:, :k] - torch.diag(torch.diagonal(w[:, :k]))
        return reg_lambda / (k * (k - 1)) * off.square().sum() + reg_mu / k * w[:, k].square().sum()

    return penalty


def _log_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, dim=1)


def _identity(z: torch.Tensor) -> torch.Tensor:
    return z


PROBLEMS = {
    # theta = [beta] (inverse temperature)
    "temperature": Problem("temperature", _identity, lambda x, t: t[0] * x),
    # theta = [alpha, b_1..b_K] on log-posteriors
    "affine": Problem("affine", _log_softmax, lambda x, t: t[0] * x + t[1:]),
    # theta = [w_1..w_K, b_1..b_K] on logits
    "vector": Problem("vector", _identity, lambda x, t: t[: x.shape[1]] * x + t[x.shape[1] :]),
    # theta = [W | b] (K, K + 1) on logits
    "matrix": Problem("matrix", _identity, _full),
}


def dirichlet_odir(reg_lambda: float, reg_mu: float) -> Problem:
    """theta = [W | b] on log-posteriors, with the ODIR penalty."""
    return Problem("dirichlet-odir", _log_softmax, _full, odir_penalty(reg_lambda, reg_mu))


def matrix_odir(reg_lambda: float, reg_mu: float) -> Problem:
    """theta = [W | b] on logits, with the ODIR penalty."""
    return Problem("matrix-odir", _identity, _full, odir_penalty(reg_lambda, reg_mu))


# --------------------------------------------------------------------------- rows and running
@dataclass(frozen=True)
class Row:
    """One contender: ``fit(logits, labels) -> theta`` in the problem's parametrisation."""

    name: str
    fit: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    needs: tuple[str, ...] = ()  # importable modules; the row is skipped without them
    note: str = ""
    #: estimated peak memory in bytes for (n, k); rows over --max-memory-gb are skipped
    memory: Callable[[int, int], float] | None = None
    #: left out of --smoke runs (start-up or compilation alone takes tens of seconds)
    slow: bool = False


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def _reset_peak_rss() -> int:
    """Reset the process's peak resident memory to its current one (Linux: ``clear_refs`` 5) and
    return that baseline: the data's generation freed temporaries of up to 800 MB, which the peak
    otherwise keeps and a row below them reads as 0 MB."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (no reset: the old peak)
    return _status_bytes("VmRSS") or 0


def _peak_rss_bytes() -> int:
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)


@contextlib.contextmanager
def _blas_threads(threads: int) -> Iterator[None]:
    """NumPy's and SciPy's BLAS and OpenMP pools limited to ``threads``, as torch's is (NumPy's
    OpenBLAS took both cores: the SciPy matrix row at 20,000 x 100 took 44.8 s against 3.1 s)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(threads):
        yield


def _thread_environment(threads: int) -> dict[str, str]:
    """A row process's environment, its BLAS and OpenMP pools sized to ``threads`` from the start."""
    return {**os.environ, **dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), str(threads))}


def run_row_in_this_process(row: Row, problem: Problem, n: int, k: int, repeat: int, threads: int) -> dict:
    """Warm-up, then ``repeat`` timed fits; returns times, peak memory above the data, and the
    common evaluation."""
    torch.set_num_threads(threads)
    logits, labels = make_data(n, k)
    base = _reset_peak_rss()
    times: list[float] = []
    with warnings.catch_warnings(), _blas_threads(threads):
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        theta = row.fit(logits, labels)
        warm_up = time.perf_counter() - start
        # Fits slower than 30 s are timed once (their warm-up run) to keep the script usable.
        runs = repeat if warm_up < 30 else 0
        for _ in range(runs):
            start = time.perf_counter()
            theta = row.fit(logits, labels)
            times.append(time.perf_counter() - start)
    peak = _peak_rss_bytes() - base
    objective, grad_max = problem.evaluate(torch.as_tensor(theta), logits, labels)
    return {
        "time": statistics.median(times) if times else warm_up,
        "runs": max(len(times), 1),
        "peak_mb": peak / 2**20,
        "objective": objective,
        "grad_max": grad_max,
    }


def _missing(row: Row) -> str | None:
    import importlib.util

    for module in row.needs:
        if module in sys.modules:
            continue
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} not installed"
        except (ImportError, ValueError):
            return f"{module} not installed"
    return None


def main(description: str, rows: dict[str, list[Row]], problems: dict[str, Problem], default_n: int, default_k: int,
         epilog: str | None = None) -> None:
    """Command line of a benchmark script: runs every row in a subprocess and prints tables.

    ``rows`` and ``problems`` are keyed by problem name; ``--problem`` selects some. ``epilog``:
    what ``--help`` prints after the options (the script's docstring: its other modes' flags).
    """
    global SCIPY_MAX_ITER
    parser = argparse.ArgumentParser(description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=default_n, help="number of samples")
    parser.add_argument("--k", type=int, default=default_k, help="number of classes")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions after the warm-up")
    parser.add_argument("--threads", type=int, default=1, help="threads of every row: torch's, and NumPy's and SciPy's BLAS")
    parser.add_argument("--problem", nargs="*", default=list(rows), choices=list(rows))
    parser.add_argument("--rows", nargs="*", default=None, help="only rows whose name contains one of these")
    parser.add_argument("--smoke", action="store_true", help="quick run in one process: n=2000, k=10, 1 repetition, no slow rows")
    parser.add_argument("--max-memory-gb", type=float, default=6.0, help="skip rows estimated to need more")
    parser.add_argument("--scipy-max-iter", type=int, help=f"iteration cap of the plain SciPy fits ({SCIPY_MAX_ITER}; --smoke: 300)")
    parser.add_argument("--_row", help=argparse.SUPPRESS)
    parser.add_argument("--_problem", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.n, args.k, args.repeat = 2000, 10, 1
    SCIPY_MAX_ITER = args.scipy_max_iter or (300 if args.smoke else SCIPY_MAX_ITER)

    if args._row is not None:  # child process: run one row, print its result as JSON
        row = next(r for r in rows[args._problem] if r.name == args._row)
        result = run_row_in_this_process(row, problems[args._problem], args.n, args.k, args.repeat, args.threads)
        print("RESULT " + json.dumps(result))
        return

    print(f"# {description}")
    print(f"# n = {args.n:,}, k = {args.k}, threads = {args.threads}, median of {args.repeat} runs after a warm-up;")
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"SciPy rows: at most {SCIPY_MAX_ITER} iterations")
    for name in args.problem:
        results = []
        for row in rows[name]:
            if args.rows and not any(part in row.name for part in args.rows):
                continue
            skip = _missing(row)
            if skip is None and row.memory is not None and row.memory(args.n, args.k) > args.max_memory_gb * 2**30:
                estimate = row.memory(args.n, args.k)
                skip = "too slow at this size" if math.isinf(estimate) else f"needs ~{estimate / 2**30:.0f} GB (> --max-memory-gb {args.max_memory_gb:g})"
            if skip is None and args.smoke and row.slow:
                skip = "slow start-up, left out of --smoke"
            if skip is not None:
                results.append((row, None, skip))
                continue
            if args.smoke:  # in this process: no per-row start-up cost, memory not isolated
                results.append((row, run_row_in_this_process(row, problems[name], args.n, args.k, 1, args.threads), ""))
                continue
            command = [sys.executable, __import__("__main__").__file__, "--_row", row.name, "--_problem", name,
                       "--n", str(args.n), "--k", str(args.k), "--repeat", str(args.repeat), "--threads", str(args.threads),
                       "--scipy-max-iter", str(SCIPY_MAX_ITER)]
            done = subprocess.run(command, capture_output=True, text=True, env=_thread_environment(args.threads))
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                error = (done.stderr.strip().splitlines() or ["no output"])[-1]
                results.append((row, None, f"failed: {error[:100]}"))
            else:
                results.append((row, json.loads(line[7:]), ""))
            print(f"  ... {row.name}: {'done' if line else results[-1][2]}", file=sys.stderr, flush=True)
        print_table(name, results)


def print_table(problem: str, results: list[tuple[Row, dict | None, str]]) -> None:
    measured = [r for _, r, _ in results if r is not None]
    if not measured:
        return
    best = min(r["objective"] for r in measured)
    reference = next((r for row, r, _ in results if r is not None and row.name.startswith("torchcal")), None)
    print(f"\n## {problem}\n")
    print("| row | median time (s) | runs | peak memory (MB) | objective | gap to best | max abs gradient | converged | time / torchcal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for row, r, note in results:
        label = row.name + (f" ({row.note})" if row.note else "")
        if r is None:
            print(f"| {label} | skipped: {note} | | | | | | | |")
            continue
        gap = (r["objective"] - best) / abs(best)
        ratio = r["time"] / reference["time"] if reference else math.nan
        converged = "yes" if r["grad_max"] <= GRAD_TOL else "no"
        print(
            f"| {label} | {r['time']:.4f} | {r['runs']} | {r['peak_mb']:.0f} | {r['objective']:.10f} | {gap:.1e} | "
            f"{r['grad_max']:.1e} | {converged} | {ratio:.1f} |"
        )


@functools.cache
def load_torch_uncertainty():
    """torch_uncertainty's scalers without its package ``__init__``, which imports torchvision
    (whose PyPI wheel cannot load next to a CPU-only torch); the scaler code itself is unchanged."""
    import importlib
    import importlib.util
    import types

    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None or spec.origin is None:
        raise ImportError("torch_uncertainty not installed")
    root = Path(spec.origin).parent

    def stub(name: str, sub: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = [str(root / sub)]
        sys.modules[name] = module
        return module

    stub("torch_uncertainty", "")
    post = stub("torch_uncertainty.post_processing", "post_processing")
    post.PostProcessing = importlib.import_module("torch_uncertainty.post_processing.abstract").PostProcessing
    stub("torch_uncertainty.post_processing.calibration", "post_processing/calibration")
    prefix = "torch_uncertainty.post_processing.calibration."
    return types.SimpleNamespace(
        TemperatureScaler=importlib.import_module(prefix + "temperature_scaler").TemperatureScaler,
        VectorScaler=importlib.import_module(prefix + "vector_scaler").VectorScaler,
        MatrixScaler=importlib.import_module(prefix + "matrix_scaler").MatrixScaler,
        DirichletScaler=importlib.import_module(prefix + "dirichlet_scaler").DirichletScaler,
    )


def torch_uncertainty_fit(cls_name: str, logits: torch.Tensor, labels: torch.Tensor, **options):
    """Fit a torch_uncertainty scaler with its defaults on a loader of the logits (batches of 10,000)."""
    import logging

    logging.getLogger().setLevel(logging.ERROR)
    cls = getattr(load_torch_uncertainty(), cls_name)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(logits, labels), batch_size=10_000)
    scaler = cls(model=None, **options)
    scaler.fit(loader, progress=False)
    return scaler


def probmetrics_get_calibrator():
    """probmetrics' calibrator factory. probmetrics needs numba at import only for its SAGA
    solvers, which no benchmark runs; without numba a stub decorator stands in for ``numba.njit``."""
    try:
        import numba  # noqa: F401
    except ImportError:
        stub = types.ModuleType("numba")
        stub.njit = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda f: f)  # type: ignore[attr-defined]
        sys.modules["numba"] = stub
    from probmetrics.calibrators import get_calibrator

    return get_calibrator


def scipy_lbfgs(problem: Problem, theta0, logits: torch.Tensor, labels: torch.Tensor, gtol: float = 1e-7):
    """A plain SciPy fit: L-BFGS-B on a NumPy float64 objective with its analytic gradient (the
    loss and gradient below are exact for every problem of this module), stopped at the same
    gradient tolerance as torchcal's L-BFGS (largest absolute entry 1e-7)."""
    import numpy as np
    from scipy.optimize import minimize
    from scipy.special import log_softmax

    z = logits.double().numpy()
    y = labels.numpy()
    n, k = z.shape
    x = log_softmax(z, axis=1) if problem.features is _log_softmax else z
    onehot = np.zeros((n, k))
    onehot[np.arange(n), y] = 1.0
    penalty_weights = None
    if problem.name == "dirichlet-odir":
        # the ODIR penalty is sum(w * theta^2): its gradient at theta = 1 is 2 w (one backward pass;
        # its Hessian, formed before, took (K (K + 1))^2 floats: 1.8 GB at K = 100, inside the timed fit)
        ones = torch.ones(k * (k + 1), dtype=torch.float64, requires_grad=True)
        penalty_weights = torch.autograd.grad(problem.penalty(ones, k), ones)[0].numpy() / 2

    def fun(theta):
        if problem.name == "temperature":
            s = theta[0] * x
        elif problem.name == "affine":
            s = theta[0] * x + theta[1:]
        elif problem.name == "vector":
            s = theta[:k] * x + theta[k:]
        else:
            w = theta.reshape(k, k + 1)
            s = x @ w[:, :k].T + w[:, k]
        log_q = log_softmax(s, axis=1)
        loss = -log_q[np.arange(n), y].mean()
        r = (np.exp(log_q) - onehot) / n
        if problem.name == "temperature":
            grad = np.array([(r * x).sum()])
        elif problem.name == "affine":
            grad = np.r_[(r * x).sum(), r.sum(0)]
        elif problem.name == "vector":
            grad = np.r_[(r * x).sum(0), r.sum(0)]
        else:
            grad = np.c_[r.T @ x, r.sum(0)].ravel()
        if penalty_weights is not None:
            loss += (penalty_weights * theta**2).sum()
            grad = grad + 2 * penalty_weights * theta
        return loss, grad

    result = minimize(fun, np.asarray(theta0, dtype=np.float64), jac=True, method="L-BFGS-B",
                      options={"maxiter": SCIPY_MAX_ITER, "maxfun": 2 * SCIPY_MAX_ITER, "gtol": gtol, "ftol": 1e-15})
    return torch.from_numpy(result.x)


def identity_theta(problem: str, k: int) -> torch.Tensor:
    """The identity map in the common parametrisation."""
    if problem == "temperature":
        return torch.ones(1, dtype=torch.float64)
    if problem == "affine":
        return torch.cat([torch.ones(1), torch.zeros(k)]).double()
    if problem == "vector":
        return torch.cat([torch.ones(k), torch.zeros(k)]).double()
    return torch.cat([torch.eye(k), torch.zeros(k, 1)], dim=1).flatten().double()
