"""The new statistics on a CUDA device: same values as on the CPU, results on the device (skipped
without a GPU)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from torchcal.data import EXAMPLE_PATH, load_scores
from torchcal.functional import (
    aurc,
    cllr,
    consistency_bands,
    consistency_resampling_test,
    corp_decomposition,
    debiased_calibration_error,
    detection_cost,
    equal_error_rate,
    expected_calibration_error,
    hosmer_lemeshow_test,
    kuiper_test,
    min_detection_cost,
    murphy_decomposition,
    smooth_calibration_error,
    smooth_reliability_curve,
    spiegelhalter_test,
)
from torchcal.metrics import Cllr, DetectionCost, SmoothCalibrationError, SpiegelhalterTest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")

STATISTICS = {
    "smooth_ece": smooth_calibration_error,
    "smooth_ece_classwise": partial(smooth_calibration_error, kind="classwise"),
    "debiased": debiased_calibration_error,
    "hosmer_lemeshow": lambda x, y: hosmer_lemeshow_test(x, y).statistic,
    "spiegelhalter": lambda x, y: spiegelhalter_test(x, y).statistic,
    "kuiper": lambda x, y: kuiper_test(x, y).statistic,
    "resampling": lambda x, y: consistency_resampling_test(expected_calibration_error, x, y, num_resamples=99).p_value,
    "corp": lambda x, y: torch.stack(list(corp_decomposition(x, y))),
    "murphy": lambda x, y: torch.stack(list(murphy_decomposition(x, y))),
    "aurc": aurc,
    "curve": lambda x, y: smooth_reliability_curve(x, y, num_replicates=50).upper,
    "bands": lambda x, y: consistency_bands(x, y, num_resamples=100).upper,
}


#: The smoothed curve is a ratio of two smoothed densities. Where the density is a millionth of its
#: peak (6e4 at confidence 1 on ResNet-110), the smoothing's round-off (1e-16 of the peak) becomes
#: 1e-9 to 1e-8 of the curve: a relative 1e-15 change of the float64 logits moves the band by 3.5e-8
#: on the CPU alone; the H200 differed from the CPU by 5e-8.
ATOL = {"curve": 1e-6}


@pytest.mark.parametrize("name", STATISTICS)
def test_statistics_agree_with_the_cpu(name):
    scores = load_scores(EXAMPLE_PATH)
    cpu = STATISTICS[name](scores.logits, scores.labels)
    gpu = STATISTICS[name](scores.logits.to(CUDA), scores.labels.to(CUDA))
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=ATOL.get(name, 1e-9), equal_nan=True)


def test_detection_and_streaming_smooth_ece_on_the_gpu():
    scores = load_scores(EXAMPLE_PATH)
    keep = scores.labels < 2
    logits, labels = scores.logits[keep][:, :2], scores.labels[keep]
    for fn in (cllr, equal_error_rate, min_detection_cost):
        torch.testing.assert_close(fn(logits.to(CUDA), labels.to(CUDA)).cpu(), fn(logits, labels), rtol=1e-9, atol=1e-12)
    metric = SmoothCalibrationError(10).to(CUDA)
    metric.update(scores.logits.to(CUDA), scores.labels.to(CUDA))
    torch.testing.assert_close(metric.compute().cpu(), smooth_calibration_error(scores.logits, scores.labels, grid_points=1001))
    priors = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for streaming, fn in ((Cllr(priors), partial(cllr, priors=priors)), (Cllr(), cllr),
                          (DetectionCost(0.3, priors=priors), partial(detection_cost, target_prior=0.3, priors=priors)),
                          (SpiegelhalterTest(2, kind="binary"), lambda x, y: spiegelhalter_test(x, y, kind="binary").statistic)):
        streaming = streaming.to(CUDA)
        for part in torch.arange(labels.shape[0]).tensor_split(3):
            streaming.update(logits[part].to(CUDA), labels[part].to(CUDA))
        value = streaming.compute()
        assert value.device.type == "cuda"
        torch.testing.assert_close(value.cpu(), fn(logits, labels), rtol=1e-9, atol=1e-12)
