"""The new streaming statistics synchronised over 2 processes (gloo on CPU) equal one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchcal.functional.debiased_ece import debiased_calibration_error
from torchcal.functional.score_decomposition import murphy_decomposition
from torchcal.functional.smooth_ece import smooth_ece
from torchcal.metrics import BrierDecomposition, DebiasedCalibrationError, SmoothCalibrationError

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

N, K = 900, 3
SHARDS = [123, 777]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(N, K, generator=generator, dtype=torch.float64)
    return logits, torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=generator).squeeze(1)


CASES = {
    "smooth": (lambda: SmoothCalibrationError(K), lambda x, y: smooth_ece(x, y, grid_points=1001)),
    "smooth-classwise": (lambda: SmoothCalibrationError(K, kind="classwise"),
                         lambda x, y: smooth_ece(x, y, kind="classwise", grid_points=1001)),
    "debiased-uniform": (lambda: DebiasedCalibrationError(K, strategy="uniform"),
                         lambda x, y: debiased_calibration_error(x, y, strategy="uniform")),
    "debiased-quantile": (lambda: DebiasedCalibrationError(K), debiased_calibration_error),
    "brier-decomposition": (lambda: BrierDecomposition(K), lambda x, y: torch.stack(list(murphy_decomposition(x, y)))),
}


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=len(SHARDS))
    try:
        logits, labels = _data()
        shard = slice(sum(SHARDS[:rank]), sum(SHARDS[: rank + 1]))
        for name, (factory, reference) in CASES.items():
            metric = factory()
            for part in torch.arange(N)[shard].split(100):
                metric.update(logits[part], labels[part])
            torch.testing.assert_close(metric.compute(), reference(logits, labels), rtol=1e-10, atol=1e-12, msg=name)
    finally:
        dist.destroy_process_group()


def test_synchronised_statistics_equal_one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=len(SHARDS), join=True)
