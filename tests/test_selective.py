"""Risk-coverage curve and AURC against NumPy, with ties averaged over all their orders."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from torchcal.functional.selective import aurc, risk_coverage_curve


def _aurc_numpy(confidence: np.ndarray, wrong: np.ndarray) -> float:
    order = np.argsort(-confidence, kind="stable")
    return float(np.mean(np.cumsum(wrong[order]) / np.arange(1, len(wrong) + 1)))


@pytest.mark.parametrize("temperature", [1.0, 2.395])
def test_aurc_on_cifar10_matches_numpy(real, temperature):
    data = real("cifar10_resnet110_kangsepp")
    logits, labels = torch.from_numpy(data["logits"]).double() / temperature, torch.from_numpy(data["labels"])
    probs = torch.softmax(logits, 1).numpy()
    wrong = (probs.argmax(1) != data["labels"]).astype(float)
    # the confidence as log q_max = -log1p(sum of the others' exp(z_j - z_max)), to a relative 2^-36
    z = logits.numpy()
    terms = np.exp(z - z.max(1, keepdims=True))
    terms[np.arange(len(z)), z.argmax(1)] = 0
    rest = terms.sum(1)
    mantissa, exponent = np.frexp(-np.log1p(rest))
    confidence = np.ldexp(np.round(mantissa * 2.0**36) / 2.0**36, exponent)
    # the few tied confidences are all correct, so every order of the ties gives one answer
    _, group, sizes = np.unique(confidence, return_inverse=True, return_counts=True)
    assert all(len(set(wrong[group == g])) == 1 for g in np.flatnonzero(sizes > 1))
    assert float(aurc(logits, labels)) == pytest.approx(_aurc_numpy(confidence, wrong), rel=1e-12)
    curve = risk_coverage_curve(logits, labels)
    assert float(curve.risk[-1]) == pytest.approx(wrong.mean(), rel=1e-12)
    order = np.argsort(-confidence, kind="stable")
    risk = np.cumsum(wrong[order]) / np.arange(1, len(wrong) + 1)
    last_of_tie = np.r_[confidence[order][1:] != confidence[order][:-1], True]
    np.testing.assert_allclose(curve.risk.numpy(), risk[last_of_tie], rtol=1e-12)


def test_ties_are_averaged_over_their_orders():
    probs = torch.tensor([[.9, .1], [.7, .3], [.7, .3], [.7, .3], [.4, .6], [.4, .6]], dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 1, 1, 0])
    confidence, wrong = probs.max(1).values.numpy(), (probs.argmax(1) != labels).numpy().astype(float)
    groups = [np.flatnonzero(confidence == c) for c in sorted(set(confidence), reverse=True)]
    values = [_aurc_numpy(-np.arange(6.0), wrong[np.concatenate(order)])
              for order in itertools.product(*(itertools.permutations(g) for g in groups))]
    assert float(aurc(probs.log(), labels)) == pytest.approx(np.mean(values), rel=1e-12)
    permutation = torch.tensor([5, 3, 0, 4, 1, 2])
    assert float(aurc(probs[permutation].log(), labels[permutation])) == pytest.approx(np.mean(values), rel=1e-12)
    assert risk_coverage_curve(probs.log(), labels).coverage.tolist() == pytest.approx([1 / 6, 4 / 6, 1.0])


def test_float32_agrees(synthetic):
    scores, y = synthetic(5, 1000, seed=9)
    logits, labels = torch.from_numpy(scores), torch.from_numpy(y)
    assert float(aurc(logits.float(), labels)) == pytest.approx(float(aurc(logits, labels)), rel=1e-4)


def test_rows_of_the_same_logits_in_another_order_tie():
    """Three rows of the same posteriors, one answer right: every order of the group gives the
    same expected AURC, 2/3. The log-softmax of a row permuted across classes differs in its last
    bits, which split the tie (0.389 or 0.806 by the labels' order)."""
    same = torch.tensor([[0.0, 0.0, 2.0]] * 3, dtype=torch.float64)
    permuted = torch.tensor([[0.0, 0.0, 2.0], [2.0, 0.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    reference = float(aurc(same, torch.tensor([2, 0, 0])))
    assert reference == pytest.approx(2 / 3, abs=1e-12)
    for labels in ([2, 1, 0], [0, 2, 1], [1, 0, 2]):
        for dtype in (torch.float32, torch.float64):
            assert float(aurc(permuted.to(dtype), torch.tensor(labels))) == pytest.approx(reference, abs=1e-12)


def test_the_answers_are_the_error_rate_s_decisions():
    """Near-tied logits: the full-coverage risk is the error rate (argmax took the second class)."""
    from torchcal.functional import error_rate

    logits, labels = torch.tensor([[0.0, 2e-16], [0.0, 2e-16], [3.0, 0.0]], dtype=torch.float64), torch.tensor([1, 1, 0])
    assert float(risk_coverage_curve(logits, labels).risk[-1]) == pytest.approx(float(error_rate(logits, labels)), abs=1e-12)
