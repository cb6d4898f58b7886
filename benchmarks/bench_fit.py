"""Benchmark: affine calibration, vector scaling, matrix scaling and Dirichlet calibration with
ODIR on n x k logits (default 50,000 x 100), against every alternative installed.

Usage:
    python benchmarks/bench_fit.py                                   # all four, 50,000 x 100
    python benchmarks/bench_fit.py --problem affine vector           # some of them
    python benchmarks/bench_fit.py --smoke                           # 2,000 x 10, seconds
    python benchmarks/bench_fit.py --problem dirichlet-odir --reg 0.01

Data and measurement: see ``bench_common.py``. Every row's fitted map is evaluated in the same
parametrisation (affine ``[alpha, b]`` on log-posteriors, vector ``[w, b]`` and matrix ``[W | b]``
on logits, Dirichlet ``[W | b]`` on log-posteriors plus the ODIR penalty ``lambda / (K (K-1))
sum_{i != j} W_ij^2 + mu / K sum b^2`` with ``lambda = mu = --reg``); "converged" means the
largest absolute gradient entry there is below 1e-6. Libraries with another convention get the
equivalent strengths (dirichletcal: ``reg_norm=False``, ``ref_row=False``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import PROBLEMS, Row, dirichlet_odir, identity_theta, main, scipy_lbfgs, torch_uncertainty_fit

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


def netcal_vector(logits, labels):
    from netcal.scaling import LogisticCalibration

    model = LogisticCalibration(method="mle")
    model.fit(torch.softmax(logits.double(), 1).numpy(), labels.numpy())
    weights = torch.as_tensor(model.weights).double().flatten()
    k = logits.shape[1]
    # netcal works on log(clip(probs)): w * log p + b = w * z + (b - w * lse(z)) per row; the row
    # term is the same for every class only when w is constant, so this is exact for the fit's
    # objective only up to that; it is reported as measured.
    return _theta(weights[:k], torch.as_tensor(model.bias).double().flatten() if hasattr(model, "bias") else weights[k:])


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
        Row("SciPy L-BFGS-B", scipy("affine"), note="NumPy float64, analytic gradient, gtol 1e-7, max 2000 it."),
    ],
    "vector": [
        Row("torchcal VectorScaling", torchcal_vector, note="Newton, (2K)^2 Hessian"),
        Row("torchcal generic L-BFGS", torchcal_generic(_make_vector, _extract_vector), note="same model"),
        Row("torch-uncertainty VectorScaler", tu_vector, needs=("torch_uncertainty",), note="defaults; no bias: a smaller model"),
        Row("dirichletcal VectorScaling", dirichletcal("vector"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY, slow=True),
        Row("netcal LogisticCalibration", netcal_vector, needs=("netcal",), note="finite differences; ~1000 s at 50,000 x 100, run only up to n k = 500,000", slow=True,
            memory=lambda n, k: 0 if n * k <= 500_000 else float("inf")),
        Row("SciPy L-BFGS-B", scipy("vector"), note="NumPy float64, analytic gradient, gtol 1e-7, max 2000 it."),
    ],
    "matrix": [
        Row("torchcal MatrixScaling", torchcal_matrix),
        Row("torch-uncertainty MatrixScaler", tu_matrix, needs=("torch_uncertainty",), note="defaults"),
        Row("dirichletcal MatrixScaling", dirichletcal("matrix"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY, slow=True),
        Row("SciPy L-BFGS-B", scipy("matrix"), note="NumPy float64, analytic gradient, gtol 1e-7, max 2000 it."),
    ],
    "dirichlet-odir": [
        Row("torchcal DirichletCalibration(odir)", torchcal_dirichlet),
        Row("torch-uncertainty DirichletScaler", tu_dirichlet, needs=("torch_uncertainty",), note="defaults"),
        Row("dirichletcal FullDirichletCalibrator", dirichletcal("dirichlet"), needs=("dirichletcal", "jax"), memory=DIRICHLETCAL_MEMORY,
            slow=True, note="ref_row=False"),
        Row("SciPy L-BFGS-B", scipy("dirichlet-odir"), note="NumPy float64, analytic gradient, gtol 1e-7, max 2000 it."),
    ],
}

if __name__ == "__main__":
    main(f"affine / vector / matrix / Dirichlet-ODIR (lambda = mu = {REG:g}) fits", ROWS, PROBLEM_SET, 50_000, 100)
