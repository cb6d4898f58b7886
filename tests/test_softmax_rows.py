"""The streaming metrics' hot loop: exp as exp2, and the per-row softmax statistics."""

import numpy as np
import pytest
import torch

import torchcal.functional as F
from torchcal._fast_exp import scaled_exp
from torchcal.metrics import CalibrationError
from torchcal.metrics._softmax_rows import softmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.5])
def test_scaled_exp_matches_exp(dtype, scale):
    x = -torch.rand(100_000, dtype=torch.float64) * 80 / scale  # exp(-80) is still a normal float32
    x[:2] = torch.tensor([0.0, -1e-30])
    expected = np.exp(scale * x.numpy())
    got = scaled_exp(x.to(dtype), scale).double().numpy()
    # about |scale x| ulp from rounding the product (and the reference's), plus exp2's own ulp
    bound = (2 * np.abs(scale * x.numpy()) + 4) * torch.finfo(dtype).eps
    assert np.all(np.abs(got - expected) <= bound * expected)
    assert got[0] == 1.0


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_scaled_exp_into_out(scale):
    expected = torch.exp(scale * torch.tensor([0.0, -1.0, -2.0]))
    x = torch.tensor([0.0, -1.0, -2.0])
    assert scaled_exp(x, scale, out=x) is x  # in place
    torch.testing.assert_close(x, expected)
    x, out = torch.tensor([0.0, -1.0, -2.0]), torch.empty(3)
    assert scaled_exp(x, scale, out=out) is out
    torch.testing.assert_close(out, expected)
    assert x.tolist() == [0.0, -1.0, -2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_rows_against_numpy(dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, 30, generator=g, dtype=torch.float64) * 6 + 200
    logits[:50] = torch.randint(0, 3, (50, 30), generator=g).double()  # ties
    labels = torch.randint(0, 30, (2000,), generator=g)
    rows = softmax_rows(logits.to(dtype), labels, dtype)

    z, y = logits.to(dtype).double().numpy(), labels.numpy()
    top = z.max(axis=1)
    e = np.exp(z - top[:, None])
    q = e / e.sum(axis=1, keepdims=True)
    rtol = 10 * torch.finfo(dtype).eps
    np.testing.assert_array_equal(rows.top.numpy(), top)
    np.testing.assert_array_equal(rows.true_logit.numpy(), z[np.arange(len(y)), y])
    np.testing.assert_allclose(rows.total.numpy(), e.sum(axis=1), rtol=rtol)
    np.testing.assert_allclose(rows.norm.numpy(), np.linalg.norm(e, axis=1), rtol=rtol)
    np.testing.assert_allclose(rows.confidence.numpy(), q.max(axis=1), rtol=rtol)
    np.testing.assert_allclose(rows.log_loss.numpy(), -np.log(q[np.arange(len(y)), y]), rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(rows.correct.numpy(), z.argmax(axis=1) == y)  # first maximum on ties
    assert rows.correct[:50].sum() < (z[:50] == top[:50, None])[np.arange(50), y[:50]].sum()  # ties did occur


def test_top_label_calibration_error_on_ties_equals_functional():
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 4, (3000, 50), generator=g).float()
    labels = torch.randint(0, 50, (3000,), generator=g)
    metric = CalibrationError(50, 15)
    for start in range(0, 3000, 700):
        metric.update(logits[start : start + 700], labels[start : start + 700])
    torch.testing.assert_close(metric.compute(), F.expected_calibration_error(logits, labels), rtol=1e-12, atol=1e-15)
