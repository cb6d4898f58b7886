"""Benchmark: structured vector and matrix scaling (SVS, SMS; Berta et al. 2025) against
probmetrics' implementation (its default L-BFGS path, pytorch-minimize) at the paper's default
penalties (lambda = 1).

Usage:
    python benchmarks/bench_structured.py --n 10000 --k 10  --repeat 3
    python benchmarks/bench_structured.py --n 10000 --k 100 --repeat 1
    python benchmarks/bench_structured.py --n 10000 --k 1000 --repeat 1 --problem sms
    python benchmarks/bench_structured.py --smoke

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
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Problem, Row, main, make_data


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
        model = cls().fit(logits, labels)
        if name == "sms":
            return torch.cat([model.weight.detach(), model.bias.detach().unsqueeze(1)], dim=1).flatten()
        return torch.cat([model.weight.detach(), model.bias.detach()])

    return fit


def probmetrics_fit(name: str):
    def fit(logits, labels):
        try:
            import numba  # noqa: F401
        except ImportError:
            stub = types.ModuleType("numba")
            stub.njit = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda f: f)
            sys.modules["numba"] = stub
        from probmetrics.calibrators import get_calibrator

        probs = torch.softmax(logits.double(), dim=1).numpy()
        model = get_calibrator(name).fit(probs, labels.numpy())
        if name == "sms":
            return torch.from_numpy(model.W_).double().flatten()
        return torch.cat([torch.from_numpy(model.v_), torch.from_numpy(model.b_)]).double()

    return fit


ROWS = {
    name: [
        Row(f"torchcal {name.upper()}", torchcal_fit(name)),
        Row(f"probmetrics {name}", probmetrics_fit(name), needs=("probmetrics", "torchmin"), note="float32 L-BFGS"),
    ]
    for name in ("svs", "sms")
}


if __name__ == "__main__":
    n = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--n=")), None)
    if n is None and "--n" in sys.argv:
        n = int(sys.argv[sys.argv.index("--n") + 1])
    n = 2000 if "--smoke" in sys.argv else (n or 10_000)
    main("SVS / SMS fit (lambda = 1) against probmetrics", ROWS, _problems(n), default_n=10_000, default_k=100)
