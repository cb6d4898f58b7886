"""Calibration loss: NumPy reference, edge cases, and Ferrer's published relative losses."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

import torchcal
from torchcal.data.synthetic import ferrer_systems, gaussian_task
from torchcal.functional import (
    bayes_risk,
    brier_score,
    calibration_loss,
    cross_entropy,
    cross_validated_calibration_loss,
    zero_one_costs,
)


def np_log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def np_weighted(per_sample, labels, priors):
    if priors is None:
        return per_sample.mean()
    return sum(priors[c] * per_sample[labels == c].mean() for c in range(len(priors)))


def np_cross_entropy(z, y, priors=None):
    return np_weighted(-np_log_softmax(z)[np.arange(len(y)), y], y, priors)


def np_brier(z, y, priors=None):
    p = np.exp(np_log_softmax(z))
    return np_weighted(((p - np.eye(z.shape[1])[y]) ** 2).sum(axis=1), y, priors)


@pytest.mark.parametrize("k, scale", [(2, 3.0), (10, 2.0), (1000, 5.0), (4, 1e4)])
@pytest.mark.parametrize("use_priors", [False, True])
def test_calibration_loss_matches_numpy(k, scale, use_priors):
    rs = np.random.RandomState(k)
    raw = scale * rs.standard_normal((3000, k))
    labels = np.concatenate([np.arange(k), rs.randint(0, k, 3000 - k)])  # every class present
    calibrated = raw / 3 + rs.standard_normal(k)
    priors = rs.dirichlet(np.ones(k)) if use_priors else None
    for score, reference in ((cross_entropy, np_cross_entropy), (brier_score, np_brier)):
        raw_score, cal_score = reference(raw, labels, priors), reference(calibrated, labels, priors)
        got = calibration_loss(
            torch.from_numpy(raw), torch.from_numpy(calibrated), torch.from_numpy(labels), score=score,
            priors=None if priors is None else torch.from_numpy(priors),
        )
        assert got.absolute.item() == pytest.approx(raw_score - cal_score, rel=1e-9, abs=1e-11)
        assert got.relative.item() == pytest.approx(100 * (raw_score - cal_score) / raw_score, rel=1e-9, abs=1e-9)


def test_calibration_loss_of_a_decision_score():
    """Any score works, e.g. the Bayes risk with an abstain column (functools.partial)."""
    raw = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 1])
    score = partial(bayes_risk, costs=zero_one_costs(2, abstain=0.3))
    result = calibration_loss(raw, raw / 10, labels, score=score)  # raw/10 abstains everywhere
    assert (result.absolute.item(), result.relative.item()) == pytest.approx((0.5 - 0.3, 40.0))


def test_calibration_loss_can_be_negative():
    z = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    result = calibration_loss(z, 5 * z, torch.tensor([0, 0]))
    assert result.absolute.item() < 0 and result.relative.item() < 0


def test_calibration_loss_rejects_bad_input():
    perfect = torch.tensor([[0.0, -1e4], [-1e4, 0.0]])
    labels = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="score must be a function.*pass deployment priors as priors="):
        calibration_loss(perfect, perfect, labels, torch.tensor([0.5, 0.5]))  # (cross_entropy takes priors third)
    with pytest.raises(ValueError, match="calibrated_logits has K = 3"):
        calibration_loss(perfect, torch.zeros(2, 3), labels)
    with pytest.raises(ValueError, match="calibrated_logits has 3 rows"):
        calibration_loss(perfect, torch.zeros(3, 2), labels)
    with pytest.raises(ValueError, match="calibrated_logits contain 1 NaN"):
        calibration_loss(perfect, torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), labels)
    # the raw scores are named as the argument is (they were "logits")
    with pytest.raises(ValueError, match="raw_logits is empty"):
        calibration_loss(torch.zeros(0, 2), torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="raw_logits contain 1 NaN"):
        calibration_loss(torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), perfect, labels)
    # a calibrator class instead of an instance: "Calibrator.fit() missing 1 required positional argument"
    import torchcal
    from torchcal import TemperatureScaling
    from torchcal.functional import cross_validated_calibration_loss
    from torchcal.metrics import CalibrationLoss

    for call in (lambda: cross_validated_calibration_loss(3 * torch.randn(60, 3), torch.arange(60) % 3, TemperatureScaling),
                 lambda: CalibrationLoss(TemperatureScaling, 3),
                 lambda: torchcal.cross_validate(TemperatureScaling, 3 * torch.randn(60, 3), torch.arange(60) % 3)):
        with pytest.raises(TypeError, match=r"got the class TemperatureScaling; pass TemperatureScaling\(\)"):
            call()


def test_cross_validated_loss_leaves_the_calibrator_unfitted():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(400, 3, generator=g)
    labels = torch.distributions.Categorical(logits=logits / 3).sample()
    calibrator = torchcal.TemperatureScaling()
    result = cross_validated_calibration_loss(logits, labels, calibrator, folds=4, seed=1)
    expected = calibration_loss(logits, torchcal.cross_validate(torchcal.TemperatureScaling(), logits, labels, folds=4, seed=1), labels)
    assert result.absolute.item() == pytest.approx(expected.absolute.item(), rel=1e-12)
    assert result.relative.item() > 20  # over-confident by a factor 3
    assert not calibrator.is_fitted


def test_cross_validated_loss_fits_the_fold_calibrators_for_the_priors_it_scores_with():
    """The fold calibrators were fitted for the data's class frequencies and scored with the
    deployment priors: on a set with a rare class, 2.9 % relative calibration loss where a
    calibrator fitted for the priors (psrcal's protocol) removes 29.6 %."""
    g = torch.Generator().manual_seed(0)
    labels = torch.multinomial(torch.tensor([0.33, 0.02, 0.325, 0.325]), 3000, replacement=True, generator=g)
    logits = 2 * torch.randn(3000, 4, generator=g, dtype=torch.float64) + 2 * torch.nn.functional.one_hot(labels, 4)
    priors = torch.full((4,), 0.25, dtype=torch.float64)
    result = cross_validated_calibration_loss(logits, labels, torchcal.AffineCalibration(), priors=priors)
    fitted_for_priors = torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels, priors=priors)
    expected = calibration_loss(logits, fitted_for_priors, labels, priors=priors)
    assert result.relative.item() == pytest.approx(expected.relative.item(), rel=1e-12)
    metric = torchcal.metrics.CalibrationLoss(torchcal.AffineCalibration(), num_classes=4, priors=priors)
    metric.update(logits, labels)
    assert metric.compute().item() == pytest.approx(expected.relative.item(), rel=1e-12)
    unweighted_fit = calibration_loss(logits, torchcal.cross_validate(torchcal.AffineCalibration(), logits, labels), labels, priors=priors)
    assert result.relative.item() > unweighted_fit.relative.item() + 5


def test_ferrer_table5_datap_mc1():
    """K = 10, Datap-mc1: relative calibration loss 23 % (XE) and 20 % (Brier), affine by 5-fold CV."""
    task = gaussian_task(num_classes=10)
    logits = ferrer_systems(task)["Datap-mc1"]
    calibrated = torchcal.cross_validate(torchcal.AffineCalibration(), logits, task.labels)
    assert calibration_loss(logits, calibrated, task.labels).relative.item() == pytest.approx(23, abs=0.5)
    assert calibration_loss(logits, calibrated, task.labels, score=brier_score).relative.item() == pytest.approx(20, abs=0.5)


# Ferrer & Ramos (TMLR 2025) Table 2: RCL (%) with affine calibration by cross-validation. Our folds
# are not the authors' scikit-learn folds, hence a tolerance of 0.1 rather than the rounding 0.05.
@pytest.mark.parametrize("name, published", [("sst2_gpt2-0shot_ferrer", 46.0), ("agnews_gpt2-0shot_ferrer", 34.2)])
def test_ferrer_ramos_table2_relative_calibration_loss(real, name, published):
    data = real(name)
    z, y = torch.from_numpy(data["logits"]), torch.from_numpy(data["labels"])
    result = cross_validated_calibration_loss(z, y, torchcal.AffineCalibration())
    assert result.relative.item() == pytest.approx(published, abs=0.1)


def test_a_perfect_raw_system_has_an_absolute_loss_and_an_undefined_relative_one():
    """Raw and calibrated risk both 0: the absolute loss is 0, and the relative one 0 / 0. Both
    the functional and the metric refused, also for the absolute loss alone (in a Lightning
    validation loop a perfect batch stopped the run)."""
    from torchcal.metrics import CalibrationLoss

    perfect = torch.tensor([[0.0, -8.0], [-8.0, 0.0]]).repeat(50, 1)
    labels = torch.tensor([0, 1]).repeat(50)
    risk = partial(bayes_risk, costs=zero_one_costs(2))
    result = calibration_loss(perfect, perfect / 2, labels, risk)
    assert float(result.absolute) == 0.0 and math.isnan(float(result.relative))
    result = calibration_loss(perfect, perfect / 2, labels)  # cross-entropy: the raw is the better one
    assert float(result.absolute) == pytest.approx(float(cross_entropy(perfect, labels) - cross_entropy(perfect / 2, labels)))
    fitted = torchcal.TemperatureScaling().fit(perfect, labels)
    for calibrator in (torchcal.TemperatureScaling(), fitted):  # cross-validated, and streaming through a fitted one
        for relative in (False, True):
            metric = CalibrationLoss(calibrator, 2, risk, relative=relative)
            metric.update(perfect, labels)
            value = float(metric.compute())
            assert math.isnan(value) if relative else value == 0.0


def test_grouped_folds_keep_copies_of_a_sample_out_of_its_calibrator_s_training_part():
    """Every sample twice: spread over the folds, isotonic regression is fitted on a copy of each
    sample it calibrates and its relative calibration loss rises from 18 % to 31 %; with each
    copy's original row as its group, it stays that of the samples once (17 %)."""
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(300, 3, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=gen).squeeze(1)
    calibrator = torchcal.IsotonicCalibration()
    once = float(cross_validated_calibration_loss(logits, labels, calibrator).relative)
    twice, rows = logits.repeat(2, 1), torch.arange(300).repeat(2)
    spread = float(cross_validated_calibration_loss(twice, labels.repeat(2), calibrator).relative)
    grouped = float(cross_validated_calibration_loss(twice, labels.repeat(2), calibrator, groups=rows).relative)
    assert spread > once + 8 and abs(grouped - once) < 3

