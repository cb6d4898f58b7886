"""PosteriorQuality: the fused streaming metric equals the functional forms it fuses."""

from __future__ import annotations

import pytest
import torch

import torchcal.functional as F
from torchcal.functional.decisions import bayes_risk, zero_one_costs
from torchcal.metrics import PosteriorQuality


def _data(num_classes: int, n: int = 2000, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with row scales from 1e-2 to 1e4 (|z| up to ~1e4 and beyond) and random labels."""
    scale = torch.logspace(-2, 4, n, dtype=torch.float64).unsqueeze(1)
    return (torch.randn(n, num_classes, dtype=torch.float64) * scale).to(dtype), torch.randint(0, num_classes, (n,))


def _streamed(metric: PosteriorQuality, logits: torch.Tensor, labels: torch.Tensor, batch: int) -> dict:
    for start in range(0, len(labels), batch):
        metric.update(logits[start : start + batch], labels[start : start + batch])
    return metric.compute()


def _reference(logits: torch.Tensor, labels: torch.Tensor, priors=None) -> dict:
    return {
        "cross_entropy": F.cross_entropy(logits, labels, priors),
        "nce": F.cross_entropy(logits, labels, priors, normalize=True),
        "brier": F.brier_score(logits, labels, priors),
        "nbs": F.brier_score(logits, labels, priors, normalize=True),
        "error_rate": F.error_rate(logits, labels)
        if priors is None
        else bayes_risk(logits, labels, zero_one_costs(logits.shape[1]), priors),
        "ece": F.expected_calibration_error(logits, labels, n_bins=15, kind="top-label"),
    }


def _assert_close(result: dict, reference: dict, rtol: float, atol: float = 0.0) -> None:
    assert result.keys() == reference.keys()
    for name, value in reference.items():
        assert result[name].dtype == torch.float64 and result[name].shape == ()
        torch.testing.assert_close(result[name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("num_classes", [2, 10, 1000])
def test_equals_functional_forms(num_classes):
    logits, labels = _data(num_classes)
    result = _streamed(PosteriorQuality(num_classes), logits, labels, batch=700)
    _assert_close(result, _reference(logits, labels), rtol=1e-10)


@pytest.mark.parametrize("num_classes", [2, 10])
def test_priors_and_normalisation(num_classes):
    logits, labels = _data(num_classes)
    priors = torch.linspace(1, 3, num_classes, dtype=torch.float64)
    priors /= priors.sum()
    result = _streamed(PosteriorQuality(num_classes, priors=priors), logits, labels, batch=500)
    _assert_close(result, _reference(logits, labels, priors), rtol=1e-10)


def test_equals_separate_metrics_on_float32_logits(synthetic):
    from torchcal.metrics import BrierScore, CalibrationError, CrossEntropy

    scores, labels = synthetic(5, 3000, seed=1)
    logits, labels = torch.from_numpy(scores).float(), torch.from_numpy(labels)
    separate = [CrossEntropy(5), BrierScore(5), CalibrationError(5, 15)]
    for metric in separate:
        metric.update(logits, labels)
    result = _streamed(PosteriorQuality(5), logits, labels, batch=1000)
    for name, metric in zip(("cross_entropy", "brier", "ece"), separate):
        torch.testing.assert_close(result[name], metric.compute(), rtol=1e-10, atol=0.0)


def test_batch_split_invariance():
    logits, labels = _data(10)
    whole = _streamed(PosteriorQuality(10), logits, labels, batch=len(labels))
    for batch in (1, 37, 999):
        _assert_close(_streamed(PosteriorQuality(10), logits, labels, batch), whole, rtol=1e-12)


def test_ties_go_to_the_first_maximal_class():
    logits = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [3.0, 0.0, 0.0]])
    labels = torch.tensor([0, 1, 2, 0])
    metric = PosteriorQuality(3)
    metric.update(logits, labels)
    assert float(metric.compute()["error_rate"]) == 0.5
    torch.testing.assert_close(metric.compute()["ece"], F.expected_calibration_error(logits, labels), rtol=1e-12, atol=0)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_ties_on_integer_logits_many_classes(precision):
    """Integer logits tie often, with the label anywhere among the maximal classes; rows whose
    norm of exp(z - max) passes the tie filter without a tie go through the same fix-up."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 4, (3000, 50), generator=g).float()
    logits[:500] = 3 - torch.rand(500, 50, generator=g) * 1e-3  # untied but near-tied rows
    labels = torch.randint(0, 50, (3000,), generator=g)
    result = _streamed(PosteriorQuality(50, precision=precision), logits, labels, batch=700)
    assert float(result["error_rate"]) == float(F.error_rate(logits, labels))
    torch.testing.assert_close(result["ece"], F.expected_calibration_error(logits, labels), rtol=1e-6, atol=1e-12)


def test_float32_precision():
    """Float32 per-sample terms with float64 sums: ~1e-6 relative; ECE bins equal the float64 ones
    except for confidences within float32 round-off of a bin edge (none in these data)."""
    logits, labels = _data(100, n=20_000, dtype=torch.float32)
    logits = logits.clamp(-50, 50)
    fast = _streamed(PosteriorQuality(100, precision="float32"), logits, labels, batch=4000)
    exact = _streamed(PosteriorQuality(100), logits, labels, batch=4000)
    for name in ("cross_entropy", "nce", "brier", "nbs"):
        torch.testing.assert_close(fast[name], exact[name], rtol=1e-6, atol=0.0)
    assert float(fast["error_rate"]) == float(exact["error_rate"])
    torch.testing.assert_close(fast["ece"], exact["ece"], rtol=1e-6, atol=1e-9)


def test_float32_precision_keeps_its_digits_under_a_per_row_offset():
    """float64 logits with a per-row offset of 1e4 (the same posteriors) were cast to float32 as
    they were, losing five digits of their differences: the mean log-loss 6e-6 off (relative),
    where the docs promise about 1e-7 (review finding). The row maxima now go first, in float64."""
    logits, labels = _data(10, n=5000)
    logits = logits.clamp(-30, 30)
    offset = 1e4 * (1 + torch.rand(len(labels), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    exact = _streamed(PosteriorQuality(10), logits, labels, batch=5000)
    fast = _streamed(PosteriorQuality(10, precision="float32"), logits + offset, labels, batch=5000)
    for name in ("cross_entropy", "nce", "brier", "nbs"):
        torch.testing.assert_close(fast[name], exact[name], rtol=5e-7, atol=0.0, msg=lambda m: f"{name}: {m}")
    assert float(fast["error_rate"]) == float(exact["error_rate"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_set_dtype_casts_the_terms_to_the_state(dtype):
    """After torchmetrics' ``set_dtype`` the sums have another dtype; the per-sample terms follow."""
    logits, labels = _data(10, n=500)
    metric = PosteriorQuality(10).set_dtype(dtype)
    result = _streamed(metric, logits, labels, batch=200)
    for name, value in _reference(logits, labels).items():
        assert result[name].dtype == dtype
        torch.testing.assert_close(result[name], value.to(dtype), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_state_size_independent_of_n_and_shared_by_the_members():
    metric = PosteriorQuality(10, n_bins=15)
    sizes = []
    for n in (10, 10_000):
        logits, labels = _data(10, n=n)
        metric.update(logits, labels)
        members = dict(metric.items(copy_state=False))
        state = members["ece"].metric_state
        sizes.append(sum(s.numel() for name, s in state.items() if name not in ("options_digest", "sample_count")))  # (bookkeeping)
        assert all(m.class_sums is members["ece"].class_sums for m in members.values())  # one state
    assert sizes[0] == sizes[1] == 4 * 10 + 3 * 15
    assert all(s.dtype == torch.float64 for s in state.values())
    assert sorted(metric.compute_groups[0]) == sorted(members) and len(metric.compute_groups) == 1


def test_reset_and_empty_normalisation():
    metric = PosteriorQuality(3)
    metric.update(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))  # one class: naive score 0
    result = metric.compute()
    assert torch.isnan(result["nce"]) and torch.isnan(result["nbs"])
    metric.reset()
    assert all(float(m.class_sums.sum()) == 0 for m in metric.values(copy_state=False))


@pytest.mark.parametrize("given_priors", [False, True])
def test_the_functional_bundle_gives_nan_where_the_naive_score_is_0_as_the_metric_does(given_priors):
    """One class holds every label (or every prior): the functional raised "the naive system has a
    score of 0" for the whole bundle, the metric gave NaN for NCE and NBS and the four other values."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0])
    priors = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) if given_priors else None
    bundle = F.posterior_quality(logits, labels, priors=priors)._asdict()
    metric = PosteriorQuality(3, priors=priors)
    metric.update(logits, labels)
    streamed = metric.compute()
    for name, value in bundle.items():
        if name in ("nce", "nbs"):
            assert torch.isnan(value) and torch.isnan(streamed[name])
        else:
            torch.testing.assert_close(value, streamed[name], rtol=1e-12, atol=0)
    torch.testing.assert_close(bundle["cross_entropy"], F.cross_entropy(logits, labels, priors))


@pytest.mark.parametrize(
    "logits, labels, message",
    [
        (torch.tensor([[0.0, float("nan")], [0.0, 1.0]]), torch.tensor([0, 1]), "NaN"),
        (torch.tensor([[0.0, -float("inf")], [0.0, 1.0]]), torch.tensor([0, 1]), "infinite"),
        (torch.zeros(2, 3), torch.tensor([0, 1]), "K = 3 classes but 2 were expected"),
        (torch.zeros(2, 2), torch.tensor([0, 2]), r"must lie in \[0, 2\)"),
        (torch.zeros(2, 2), torch.tensor([0.0, 1.0]), "integer tensor"),
        (torch.zeros(2, 2), torch.tensor([0, 1, 1]), "3 entries"),
        (torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 1]), "floating-point"),
    ],
)
def test_validation_messages(logits, labels, message):
    with pytest.raises(ValueError, match=message):
        PosteriorQuality(2).update(logits, labels)


def test_huge_finite_logits_pass_validation():
    """A batch whose sum overflows is still finite: the full check runs and lets it through."""
    logits = torch.tensor([[3e38, 0.0], [3e38, 3e38]])
    metric = PosteriorQuality(2)
    metric.update(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(metric.compute()["cross_entropy"], F.cross_entropy(logits, torch.tensor([0, 1])))


def test_validate_args_false_skips_checks():
    metric = PosteriorQuality(2, validate_args=False)
    metric.update(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]))  # no check, no error
    assert torch.isnan(metric.compute()["cross_entropy"])


def test_constructor_checks():
    with pytest.raises(ValueError, match="precision"):
        PosteriorQuality(3, precision="float16")
    with pytest.raises(ValueError, match="n_bins"):
        PosteriorQuality(3, n_bins=0)
    with pytest.raises(ValueError, match="priors must sum to one"):
        PosteriorQuality(3, priors=torch.tensor([0.5, 0.5, 0.5]))
