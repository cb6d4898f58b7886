"""Every calibration statistic of torchcal on the CIFAR-10 ResNet-110 test logits (Kängsepp, bundled),
before and after temperature scaling fitted on the 5000 validation samples (T = 2.395, SOURCES.md).

Binned ECEs use 15 bins; the tests are of top-label calibration except Hosmer–Lemeshow (the
multinomial test, 10 groups; the temperature was fitted on other data, so its p-value is that of C
under labels resampled from the posteriors, 999 resamples, not a chi-square's); the
consistency-resampling test uses the top-label ECE with 999 label resamples (99 with ``--fast``).

    python recipes/calibration_statistics_resnet110.py
    python recipes/calibration_statistics_resnet110.py --fast   # 99 consistency resamples, for CI
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from torchcal import TemperatureScaling
from torchcal.data import EXAMPLE_PATH, load_scores
from torchcal.functional import brier_score, cross_entropy, expected_calibration_error
from torchcal.functional.calibration_tests import (
    CalibrationTestResult,
    hosmer_lemeshow_test,
    kolmogorov_smirnov_test,
    kuiper_test,
    spiegelhalter_test,
)
from torchcal.functional.consistency_resampling import consistency_resampling_test
from torchcal.functional.debiased_ece import debiased_calibration_error, sweep_calibration_error
from torchcal.functional.score_decomposition import corp_decomposition, murphy_decomposition
from torchcal.functional.selective import aurc
from torchcal.functional.smooth_ece import smooth_calibration_error, smooth_ece_bandwidth


def statistics(logits: Tensor, labels: Tensor, resamples: int = 999) -> dict[str, float]:
    """Name -> value of every statistic, for one set of posteriors."""
    hl = hosmer_lemeshow_test(logits, labels, degrees_of_freedom="external")
    corp = corp_decomposition(logits, labels)
    murphy = murphy_decomposition(logits, labels)
    tests: dict[str, Callable[..., CalibrationTestResult]] = {
        "Spiegelhalter Z": spiegelhalter_test, "Kolmogorov-Smirnov": kolmogorov_smirnov_test, "Kuiper": kuiper_test,
    }
    values = {
        "NLL (nats)": cross_entropy(logits, labels),
        "Brier": brier_score(logits, labels),
        "ECE top-label 15 bins (%)": 100 * expected_calibration_error(logits, labels),
        "ECE equal-mass 15 bins (%)": 100 * expected_calibration_error(logits, labels, strategy="quantile"),
        "debiased l2 ECE, equal-mass (%)": 100 * debiased_calibration_error(logits, labels),
        "ECE sweep, l2 (%)": 100 * sweep_calibration_error(logits, labels),
        "ECE sweep, l1 (%)": 100 * sweep_calibration_error(logits, labels, norm="l1"),
        "smooth ECE top-label (%)": 100 * smooth_calibration_error(logits, labels),
        "smooth ECE bandwidth": smooth_ece_bandwidth(logits, labels)[0],
        "smooth ECE classwise (%)": 100 * smooth_calibration_error(logits, labels, kind="classwise"),
        "Hosmer-Lemeshow C (multinomial)": hl.statistic,
        "Hosmer-Lemeshow p": hl.p_value,
    }
    for name, test in tests.items():
        result = test(logits, labels)
        values[f"{name} statistic"], values[f"{name} p"] = result.statistic, result.p_value
    values[f"consistency resampling p (ECE, L = {resamples})"] = consistency_resampling_test(
        partial(expected_calibration_error, n_bins=15), logits, labels, num_resamples=resamples
    ).p_value
    values |= {
        "CORP Brier MCB (top-label)": corp.miscalibration, "CORP Brier DSC": corp.discrimination,
        "CORP Brier UNC": corp.uncertainty,
        "Murphy REL (classwise Brier)": murphy.reliability, "Murphy RES": murphy.resolution,
        "Murphy UNC": murphy.uncertainty,
        "AURC": aurc(logits, labels),
    }
    return {name: float(value) for name, value in values.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="99 label resamples instead of 999")
    resamples = 99 if parser.parse_args(argv).fast else 999
    test, val = load_scores(EXAMPLE_PATH), load_scores(EXAMPLE_PATH, split="val")
    assert test.labels is not None and val.labels is not None
    calibrator = TemperatureScaling().fit(val.logits, val.labels)
    with torch.no_grad():
        calibrated = calibrator(test.logits)
    before, after = (statistics(x, test.labels, resamples) for x in (test.logits, calibrated))
    width = max(map(len, before))
    print(f"CIFAR-10 ResNet-110 test logits (N = {test.labels.shape[0]}); temperature fitted on the validation "
          f"split: T = {calibrator.temperature:.3f}")
    print(f"| {'statistic':<{width}} | {'raw':>10} | {'temperature':>11} |")
    print(f"|{'-' * (width + 2)}|{'-' * 12}|{'-' * 13}|")
    for name in before:
        print(f"| {name:<{width}} | {before[name]:>10.4g} | {after[name]:>11.4g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
