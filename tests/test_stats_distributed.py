"""The new streaming statistics synchronised over 2 processes (gloo on CPU) equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo import spawn_gloo

from torchcal.functional.calibration_tests import spiegelhalter_test
from torchcal.functional.debiased_ece import debiased_calibration_error
from torchcal.functional.detection import cllr, detection_cost
from torchcal.functional.score_decomposition import murphy_decomposition
from torchcal.functional.smooth_ece import smooth_calibration_error
from torchcal.metrics import (
    Cllr,
    DebiasedCalibrationError,
    DetectionCost,
    MurphyDecomposition,
    SmoothCalibrationError,
    SpiegelhalterTest,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

N, K = 900, 3
SHARDS = [123, 777]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(N, K, generator=generator, dtype=torch.float64)
    return logits, torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=generator).squeeze(1)


CASES = {
    "smooth": (lambda: SmoothCalibrationError(K), lambda x, y: smooth_calibration_error(x, y, grid_points=1001)),
    "smooth-classwise": (lambda: SmoothCalibrationError(K, kind="classwise"),
                         lambda x, y: smooth_calibration_error(x, y, kind="classwise", grid_points=1001)),
    "debiased-uniform": (lambda: DebiasedCalibrationError(K, strategy="uniform"),
                         lambda x, y: debiased_calibration_error(x, y, strategy="uniform")),
    "debiased-quantile": (lambda: DebiasedCalibrationError(K), debiased_calibration_error),
    "murphy-decomposition": (lambda: MurphyDecomposition(K), lambda x, y: torch.stack(list(murphy_decomposition(x, y)))),
    "spiegelhalter": (lambda: SpiegelhalterTest(K), lambda x, y: spiegelhalter_test(x, y).statistic),
}
PRIORS = torch.tensor([0.3, 0.7], dtype=torch.float64)
BINARY_CASES = {  # on the binary problem "class 1 or not"
    "cllr": (lambda: Cllr(priors=PRIORS), lambda x, y: cllr(x, y, priors=PRIORS)),
    "cllr-data-priors": (Cllr, cllr),  # every log-odds gathered
    "dcf": (lambda: DetectionCost(0.2, 10.0, priors=PRIORS), lambda x, y: detection_cost(x, y, 0.2, 10.0, priors=PRIORS)),
    "dcf-data-priors": (lambda: DetectionCost(0.2, 10.0), lambda x, y: detection_cost(x, y, 0.2, 10.0)),
}


def _worker(rank: int) -> None:
    logits, labels = _data()
    shard = slice(sum(SHARDS[:rank]), sum(SHARDS[: rank + 1]))
    binary = (torch.stack([torch.logsumexp(logits[:, [0, 2]], 1), logits[:, 1]], 1), (labels == 1).long())
    for cases, (x, y) in ((CASES, (logits, labels)), (BINARY_CASES, binary)):
        for name, (factory, reference) in cases.items():
            metric = factory()
            for part in torch.arange(N)[shard].split(100):
                metric.update(x[part], y[part])
            torch.testing.assert_close(metric.compute(), reference(x, y), rtol=1e-10, atol=1e-12, msg=name)
    test = SpiegelhalterTest(K, alternative="less")
    test.update(logits[shard], labels[shard])
    expected = spiegelhalter_test(logits, labels, alternative="less")
    torch.testing.assert_close(test.result().p_value, expected.p_value, rtol=1e-10, atol=1e-12)


def test_synchronised_statistics_equal_one_process():
    spawn_gloo(_worker, len(SHARDS))
