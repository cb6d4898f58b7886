"""Reproduce Kull et al. (NeurIPS 2019), "Beyond temperature scaling": the ResNet-110 CIFAR-10 column
of their Tables 3/4 and Supp. Tables 13-18, on the Kängsepp logits bundled with torchcal.

Their protocol: each calibrator is fitted by 5-fold cross-validation on the 5000 validation
samples, and the test posteriors are the average of the 5 fold models' posteriors. Regularised
methods choose their strength by an inner cross-validation on each fold's training part.
Reported: test log-loss (nats), classwise ECE (sum over classes of the class-j ECE, 15 bins) and
confidence ECE (15 bins).

    python recipes/kull_resnet110_cifar10.py            # all five calibrators (about a minute)
    python recipes/kull_resnet110_cifar10.py --fast     # temperature and vector scaling, for CI
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

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


def fold_averaged_log_posteriors(method: str, val_logits: Tensor, val_labels: Tensor, test_logits: Tensor,
                                 folds: int = 5, seed: int = 0) -> Tensor:
    """Log of the mean test posteriors of ``folds`` calibrators, each fitted on all but one fold of
    the validation data; (N_test, K)."""
    probs = torch.zeros(test_logits.shape, dtype=torch.float64)
    for held_out in fold_indices(val_labels, folds, seed):
        train = torch.ones(val_labels.shape[0], dtype=torch.bool)
        train[held_out] = False
        calibrator = make_calibrator(method).fit(val_logits[train], val_labels[train])
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
    """Our column: ``{method: measure(...)}``, with ``"uncalibrated"`` first."""
    test, val = load_scores(EXAMPLE_PATH), load_scores(EXAMPLE_PATH, split="val")
    results = {"uncalibrated": measure(test.logits, test.labels)}
    for method in methods:
        calibrated = fold_averaged_log_posteriors(method, val.logits, val.labels, test.logits, folds, seed)
        results[method] = measure(calibrated, test.labels)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
