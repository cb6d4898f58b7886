"""Newton-CG for the full-matrix family on a CUDA device: the same fit as on the CPU, on the
device, with host synchronisations per pass and Newton step, not per chunk or class (skipped
without a GPU)."""

from __future__ import annotations

import pytest
import torch
from sync_count import count_host_syncs

import torchcal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _data(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    latent = 3 * torch.randn(n, k, generator=gen)
    labels = torch.multinomial(torch.softmax(latent, 1), 1, generator=gen).squeeze(1)
    return 2.5 * latent + torch.linspace(-1, 1, k), labels


@pytest.mark.parametrize("make", [
    lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2),
    lambda: torchcal.MatrixScaling(reg="odir", reg_lambda=1.0),
    lambda: torchcal.DirichletCalibration(reg="odir", reg_grid=(1e-2, 1.0, 100.0)),
], ids=["dirichlet-odir", "matrix-odir", "dirichlet-odir-cv"])
def test_newton_cg_on_cuda_equals_cpu_at_k_100(make):
    logits, labels = _data(20_000, 100)
    on_cpu = make().fit(logits, labels)
    on_cuda = make().fit(logits.to(CUDA), labels.to(CUDA))
    assert on_cuda.weight.device.type == "cuda" and on_cuda.fit_record_.converged
    assert on_cuda.reg_lambda_ == on_cpu.reg_lambda_
    torch.testing.assert_close(on_cuda.weight.cpu(), on_cpu.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_cuda.bias.cpu(), on_cpu.bias, rtol=0, atol=1e-6)


def test_newton_cg_reads_back_per_pass_not_per_chunk():
    logits, labels = _data(100_000, 200)
    logits, labels = logits.to(CUDA), labels.to(CUDA)
    make = lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2)
    make().fit(logits, labels)  # warm-up
    fitted = []
    syncs = count_host_syncs(lambda: fitted.append(make().fit(logits, labels)))
    record = fitted[0].fit_record_
    # one read-back per conjugate-gradient step or line-search trial (a pass each), a handful per
    # Newton step, and the set-up (temperature start, class counts)
    assert syncs <= record.evaluations + 6 * record.iterations + 60, (syncs, record)


def test_low_rank_blocks_on_cuda_equal_cpu(monkeypatch):
    """The large-K preconditioner (:class:`_LowRankBlocks`, forced at K = 100) on the device: the
    same optimum as on the CPU."""
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MAX_BLOCK_SIZE", 0)
    monkeypatch.setattr(torchcal.calibrators._multinomial, "_MIN_LOW_RANK_BLOCK_SIZE", 0)
    logits, labels = _data(20_000, 100)
    make = lambda: torchcal.DirichletCalibration(reg="odir", reg_lambda=1e-2)
    on_cpu = make().fit(logits, labels)
    on_cuda = make().fit(logits.to(CUDA), labels.to(CUDA))
    assert on_cuda.fit_record_.converged and on_cpu.fit_record_.converged
    torch.testing.assert_close(on_cuda.weight.cpu(), on_cpu.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(on_cuda.bias.cpu(), on_cpu.bias, rtol=0, atol=1e-6)


def test_folds_fitted_together_on_cuda_select_what_they_select_one_by_one():
    """On a GPU the cross-validation fits each grid point's folds together, as one batched problem
    (``cv_together=None``): the same lambda and final fit as the folds one by one, in fewer host
    synchronisations (one per pass for every fold)."""
    logits, labels = _data(20_000, 100)
    logits, labels = logits.to(CUDA), labels.to(CUDA)
    make = lambda together: torchcal.DirichletCalibration(reg="odir", reg_grid=(1e-2, 1.0, 100.0), cv_together=together)
    make(True).fit(logits, labels)  # warm-up
    fitted: dict = {}
    syncs = {together: count_host_syncs(lambda together=together: fitted.__setitem__(together, make(together).fit(logits, labels)))
             for together in (None, False)}
    assert fitted[None].reg_lambda_ == fitted[False].reg_lambda_
    torch.testing.assert_close(fitted[None].weight, fitted[False].weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(fitted[None].bias, fitted[False].bias, rtol=0, atol=1e-6)
    assert syncs[None] < syncs[False], syncs
