"""Benchmark: temperature scaling on n x k logits (default 50,000 x 100), against every
alternative installed, and against the floor of ten log-softmax passes over the data.

Usage:
    python benchmarks/bench_temperature.py                  # 50,000 x 100, 1 thread, median of 5
    python benchmarks/bench_temperature.py --smoke          # 2,000 x 10, seconds
    python benchmarks/bench_temperature.py --n 200000 --k 1000 --threads 2

Data and measurement: see ``bench_common.py``. The objective is the mean log-loss of
``softmax(beta * logits)``, evaluated for every row at its fitted ``beta = 1 / T``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    PROBLEMS,
    SCIPY_NOTE,
    Row,
    identity_theta,
    main,
    probmetrics_get_calibrator,
    scipy_lbfgs,
    torch_uncertainty_fit,
)

PROBLEM = PROBLEMS["temperature"]


def torchcal_fit(logits, labels):
    import torchcal

    return torch.tensor([1 / torchcal.TemperatureScaling().fit(logits, labels).temperature])


def floor_ten_log_softmax(logits, labels):
    """Not a fit: ten log-softmax passes, the least any method that evaluates the loss ten times
    must do. Its 'objective' is that of the identity map."""
    for _ in range(10):
        torch.log_softmax(logits, dim=1)
    return torch.ones(1)


def torchcal_generic_lbfgs(logits, labels):
    """torchcal's own generic driver on the same model (strong-Wolfe L-BFGS on log T, float64)."""
    import torchcal

    model = torchcal.TemperatureScaling()
    model.num_classes = logits.shape[1]
    model._materialize(logits.shape[1])
    torchcal.Calibrator._fit(model, logits.double(), labels, None, "log", 1000)
    return torch.tensor([1 / model.temperature])


def gpleiss(logits, labels):
    """gpleiss/temperature_scaling's settings (its file hard-codes .cuda()): T0 = 1.5,
    LBFGS(lr=0.01, max_iter=50), no line search. (Before session 42 this row ran 200 iterations,
    four times gpleiss's work: its times and ratios in benchmarks/README.md are those of 200.)"""
    temperature = torch.nn.Parameter(torch.ones(1, device=logits.device) * 1.5)
    optimizer = torch.optim.LBFGS([temperature], lr=0.01, max_iter=50)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits / temperature, labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return 1 / temperature.detach().double()


def torch_uncertainty(logits, labels):
    return torch_uncertainty_fit("TemperatureScaler", logits, labels).inv_temp.detach().double()


def probmetrics(method):
    def fit(logits, labels):
        get_calibrator = probmetrics_get_calibrator()  # (numba stubbed where missing)
        from probmetrics.distributions import CategoricalLogits

        cal = get_calibrator(method)
        cal.fit_torch(CategoricalLogits(logits), labels)
        return torch.tensor([cal.invtemp_ if hasattr(cal, "invtemp_") else 1 / cal.temp_], dtype=torch.float64)

    return fit


def netcal(dtype):
    def fit(logits, labels):
        from netcal.scaling import TemperatureScaling

        probs = torch.softmax(logits.double(), 1).to(dtype).numpy()
        model = TemperatureScaling(method="mle")
        model.fit(probs, labels.numpy())
        return torch.tensor([float(torch.as_tensor(model.weights).flatten()[0])], dtype=torch.float64)

    return fit


def psrcal(logits, labels):
    from psrcal.calibration import AffineCalLogLoss

    cal = AffineCalLogLoss(torch.log_softmax(logits.double(), 1), labels, bias=False)
    cal.train()
    return torch.tensor([float(cal.temp)], dtype=torch.float64)


def dirichletcal(logits, labels):
    from dirichletcal.calib.tempscaling import TemperatureScaling

    cal = TemperatureScaling(logit_input=True).fit(logits.double().numpy(), labels.numpy())
    return torch.tensor([float(cal.coef_[0, 0])], dtype=torch.float64)


def scipy(logits, labels):
    return scipy_lbfgs(PROBLEM, identity_theta("temperature", logits.shape[1]), logits, labels)


ROWS = [
    Row("torchcal TemperatureScaling", torchcal_fit, note="1-D Newton on 1/T, float32 passes"),
    Row("floor: 10 x log_softmax", floor_ten_log_softmax, note="not a fit"),
    Row("torchcal generic L-BFGS", torchcal_generic_lbfgs, note="same model, strong-Wolfe L-BFGS, float64"),
    Row("gpleiss settings", gpleiss, note="T0=1.5, LBFGS lr=0.01, 50 it."),
    Row("torch-uncertainty TemperatureScaler", torch_uncertainty, needs=("torch_uncertainty",), note="defaults"),
    Row("probmetrics temp-scaling", probmetrics("temp-scaling"), needs=("probmetrics",), note="bisection"),
    Row("probmetrics torchcal-ts", probmetrics("torchcal-ts"), needs=("probmetrics", "torchmin")),
    Row("netcal TemperatureScaling float64", netcal(torch.float64), needs=("netcal",), note="probabilities in"),
    Row("netcal TemperatureScaling float32", netcal(torch.float32), needs=("netcal",), note="probabilities in"),
    Row("psrcal AffineCalLogLoss(bias=False)", psrcal, needs=("psrcal",)),
    # dirichletcal precomputes N (K+1)^2 outer products and jax holds several copies
    Row("dirichletcal TemperatureScaling", dirichletcal, needs=("dirichletcal", "jax"), memory=lambda n, k: 5 * 8 * n * (k + 1) ** 2, slow=True),
    Row("SciPy L-BFGS-B", scipy, needs=("scipy",), note=SCIPY_NOTE),
]

if __name__ == "__main__":
    main("temperature scaling fit", {"temperature": ROWS}, {"temperature": PROBLEM}, 50_000, 100)
