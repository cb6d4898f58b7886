"""Reproduce Kull et al. (NeurIPS 2019), "Beyond temperature scaling": the ResNet-110 CIFAR-10 column
of their Tables 3/4 and Supp. Tables 13-18, on the Kängsepp logits bundled with torchcal.

Their protocol (dirichletcal/experiments_dnn, scripts/tune_dirichlet_nn_slim.py and the notebook
of Tables 3/4): each calibrator is fitted by 5-fold cross-validation on the 5000 validation
samples, and the test posteriors are the average of the 5 fold models' posteriors. The
regularised ones (Dir-L2, Dir-ODIR, MS-ODIR) are fitted so at every point of a grid of strengths
(for ODIR, (lambda, mu) pairs: the two are tuned separately), and the point with the lowest
out-of-fold validation log-loss is kept. Here that choice is the calibrator's own 5-fold
cross-validation over the grids of configs/kull-2019-dirichlet.yaml (theirs, in torchcal's
normalisation); its folds are drawn apart from the 5 whose models are averaged.
Reported: test log-loss (nats), classwise ECE (sum over classes of the class-j ECE, 15 bins) and
confidence ECE (15 bins).

    python recipes/kull_resnet110_cifar10.py            # all five calibrators (20-45 s, one thread)
    python recipes/kull_resnet110_cifar10.py --fast     # temperature and vector scaling, for CI
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from torchcal.cli import load_config
from torchcal.data import EXAMPLE_PATH, load_scores
from torchcal.fit import fold_indices
from torchcal.functional import cross_entropy, error_rate, expected_calibration_error
from torchcal.report import make_calibrator

#: method: (Kull et al.'s name, test log-loss, classwise ECE) for ResNet-110 on CIFAR-10.
PUBLISHED = {
    "uncalibrated": ("Uncal", 0.3583, 0.098),
    "temperature": ("TempS", 0.2093, 0.043),
    "dirichlet-l2": ("Dir-L2", 0.2030, 0.032),
    "dirichlet-odir": ("Dir-ODIR", 0.2051, 0.039),
    "vector": ("VecS", 0.2062, 0.036),
    "matrix-odir": ("MS-ODIR", 0.2038, 0.036),
}
FAST = ["temperature", "vector"]
#: Constructor options per method: the regularised ones' grids and folds.
OPTIONS: dict[str, dict] = load_config("kull-2019-dirichlet")["options"]


def chosen_strengths(method: str, val_logits: Tensor, val_labels: Tensor, seed: int = 0) -> dict[str, float]:
    """The regularisation strengths with the lowest out-of-fold log-loss on the validation data over
    the method's grid (``{}`` for a method without one): ``reg_lambda``, and ``reg_mu`` for ODIR."""
    options = OPTIONS.get(method, {})
    if "reg_grid" not in options:
        return {}
    calibrator = make_calibrator(method, **options, cv_seed=seed).fit(val_logits, val_labels)
    strengths = {"reg_lambda": calibrator.reg_lambda_}
    if calibrator.reg == "odir":
        strengths["reg_mu"] = calibrator.reg_mu_
    return strengths


def fold_averaged_log_posteriors(method: str, val_logits: Tensor, val_labels: Tensor, test_logits: Tensor,
                                 folds: int = 5, seed: int = 0, strengths: dict[str, float] | None = None) -> Tensor:
    """Log of the mean test posteriors of ``folds`` calibrators, each fitted on all but one fold of
    the validation data, at the regularisation ``strengths`` (default: :func:`chosen_strengths`);
    (N_test, K)."""
    if strengths is None:
        strengths = chosen_strengths(method, val_logits, val_labels, seed)
    probs = torch.zeros(test_logits.shape, dtype=torch.float64)
    for held_out in fold_indices(val_labels, folds, seed):
        train = torch.ones(val_labels.shape[0], dtype=torch.bool)
        train[held_out] = False
        calibrator = make_calibrator(method, **strengths).fit(val_logits[train], val_labels[train])
        with torch.no_grad():
            probs += calibrator(test_logits).exp().double() / folds
    return probs.log()


def measure(log_probs: Tensor, labels: Tensor) -> dict[str, float]:
    return {
        "log_loss": float(cross_entropy(log_probs, labels)),
        "classwise_ece": float(expected_calibration_error(log_probs, labels, n_bins=15, kind="classwise", reduction="sum")),
        "confidence_ece": float(expected_calibration_error(log_probs, labels, n_bins=15)),
        "error_percent": 100 * float(error_rate(log_probs, labels)),
    }


def reproduce(methods: Sequence[str], folds: int = 5, seed: int = 0) -> dict[str, dict[str, float]]:
    """Our column: ``{method: measure(...)}``, with ``"uncalibrated"`` first; a regularised method's
    entry also holds the strengths chosen (``reg_lambda``, ``reg_mu``)."""
    test, val = load_scores(EXAMPLE_PATH), load_scores(EXAMPLE_PATH, split="val")
    results = {"uncalibrated": measure(test.logits, test.labels)}
    for method in methods:
        strengths = chosen_strengths(method, val.logits, val.labels, seed)
        calibrated = fold_averaged_log_posteriors(method, val.logits, val.labels, test.logits, folds, seed, strengths)
        results[method] = {**measure(calibrated, test.labels), **strengths}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the validation folds")
    args = parser.parse_args(argv)
    methods = FAST if args.fast else [m for m in PUBLISHED if m != "uncalibrated"]
    results = reproduce(methods, seed=args.seed)
    print(f"ResNet-110 CIFAR-10 (test error {results['uncalibrated']['error_percent']:.2f} %; published 6.44 %)")
    print(f"{'method':<16}{'log-loss':>10}{'published':>11}{'cw-ECE':>9}{'published':>11}{'conf-ECE':>10}")
    for method, r in results.items():
        name, log_loss, cw_ece = PUBLISHED[method]
        print(f"{name:<16}{r['log_loss']:>10.4f}{log_loss:>11.4f}{r['classwise_ece']:>9.3f}{cw_ece:>11.3f}"
              f"{r['confidence_ece']:>10.4f}")
    print("published confidence ECE: Uncal 0.0475, TempS 0.0113")
    for method, r in results.items():
        if "reg_lambda" in r:
            mu = f", mu = {r['reg_mu']:g}" if "reg_mu" in r else ""
            print(f"chosen for {PUBLISHED[method][0]}: lambda = {r['reg_lambda']:g}{mu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
