"""Every metric synchronised over processes (gloo on CPU) equals the single-process value.

One spawn of 4 processes checks all metrics at once: over all 4 with uneven shards of several
batches each (one of them empty: torchmetrics sent its list states as float32 vectors, which
aborted the job), then over a group of 2 of them with even shards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo import spawn_gloo
from test_metrics_streaming import batches, case_list, costs_for, expected_cost_case, make_data

import torchcal
from torchcal.functional import bayes_decisions, calibration_loss, cross_validated_calibration_loss, posterior_quality
from torchcal.metrics import CalibrationLoss, PosteriorQuality

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

N, K = 1200, 3
UNEVEN = [0, 151, 420, 629]  # 4 processes, one without samples
EVEN = [600, 600]  # processes 0 and 1


def _cases(logits, labels):
    """(name, metric factory taking torchmetrics kwargs, reference value on the full data, inputs)."""
    cases = [(name, factory, fn(logits, labels), logits) for name, factory, fn in case_list(K)]
    cost_factory, cost_fn = expected_cost_case(K)
    decisions = bayes_decisions(logits, costs_for(K))
    cases.append(("expected-cost", cost_factory, cost_fn(decisions, labels), decisions))
    # a collection whose members share one state: each member synchronises it at compute()
    cases.append(("posterior-quality", lambda **kw: PosteriorQuality(K, **kw), posterior_quality(logits, labels)._asdict(), logits))
    fitted = torchcal.TemperatureScaling().fit(*make_data(300, K, 2.0, seed=1))
    with torch.no_grad():
        raw_vs_fitted = calibration_loss(logits, fitted(logits), labels).relative
    cases.append(("calibration-loss", lambda **kw: CalibrationLoss(fitted, K, **kw), raw_vs_fitted, logits))
    # (the metric keeps the logits in float64, whose temperature fit differs in round-off)
    cross_validated = cross_validated_calibration_loss(logits.double(), labels, torchcal.TemperatureScaling(), folds=3).relative
    cases.append(("calibration-loss-cv", lambda **kw: CalibrationLoss(torchcal.TemperatureScaling(), K, folds=3, **kw),
                  cross_validated, logits))
    return cases


def _check(cases, labels, shard: slice, group, tag: str) -> None:
    for name, factory, expected, inputs in cases:
        metric = factory(process_group=group)
        shard_inputs, shard_labels = inputs[shard], labels[shard]
        for part in batches(shard_inputs.shape[0], [97]):
            metric.update(shard_inputs[part], shard_labels[part])
        value = metric.compute()  # the relative loss for CalibrationLoss
        pairs = [(key, value[key], expected[key]) for key in expected] if isinstance(expected, dict) else [(name, value, expected)]
        for key, got, want in pairs:
            assert abs(got.item() - want.item()) <= 1e-10 * max(1.0, abs(want.item())), (tag, key, got, want)
        if name.startswith("calibration-loss"):  # result() synchronises too
            assert abs(metric.result().relative.item() - expected.item()) <= 1e-10 * abs(expected.item()), (tag, name)


def _worker(rank: int) -> None:
    logits, labels = make_data(N, K, 2.0, seed=0)  # identical in every process
    cases = _cases(logits, labels)
    start = sum(UNEVEN[:rank])
    _check(cases, labels, slice(start, start + UNEVEN[rank]), None, "4 uneven")
    pair = dist.new_group([0, 1])  # every process must take part in creating it
    if rank < 2:
        _check(cases, labels, slice(sum(EVEN[:rank]), sum(EVEN[: rank + 1])), pair, "2 even")
    # states accumulated under other options on another process are refused on every process (the
    # digest state's max hid them: DetectionCosts with target priors 0.5 and 0.01 returned 0.62 and
    # 1.77, a mixture); the process without samples takes no part
    from torchcal.metrics import DetectionCost

    metric = DetectionCost(target_prior=0.5 if rank == 1 else 0.01)
    shard = slice(start, start + UNEVEN[rank])
    if UNEVEN[rank]:
        metric.update(logits[shard, :2], (labels[shard] > 0).long())
    with pytest.raises(ValueError, match="built with other options"):
        metric.compute()
    # no process with an update: NaN, as without a group (the options check had raised: the second diff review)
    assert math.isnan(float(DetectionCost(target_prior=0.5 if rank == 1 else 0.01).compute()))


def test_synchronised_metrics_equal_one_process():
    assert sum(UNEVEN) == sum(EVEN) == N
    spawn_gloo(_worker, len(UNEVEN))
