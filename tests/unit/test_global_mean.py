"""GlobalMean on one process: the running sums (the all-reduce itself is in the e2e runs)."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx
from phalanx.runtime import metrics


@pytest.fixture
def context():
    context = phalanx.init()  # no torchrun variables: world size 1, no process group
    yield context
    context.close()


def test_the_mean_is_exact_across_folds_and_value_types(context):
    """More additions than one fold holds, float32 / int64 tensors and Python numbers mixed: the
    result is the float64 sum of exactly the values given, not float32 arithmetic."""
    mean = phalanx.GlobalMean(context, "loss", "correct")
    added = 3 * metrics._FOLD_EVERY + 7
    expected_loss = expected_correct = 0.0
    for step in range(added):
        loss = torch.tensor(0.1 + step * 1e-4, dtype=torch.float32)
        correct = torch.tensor(step % 3, dtype=torch.int64) if step % 2 else float(step % 3)
        mean.add(4, loss=loss, correct=correct)
        expected_loss += float(loss)  # the float32 value, summed in float64
        expected_correct += step % 3
    result = mean.compute()
    assert result["samples"] == 4 * added
    assert result["loss"] == pytest.approx(expected_loss / (4 * added), rel=1e-12)
    assert result["correct"] == pytest.approx(expected_correct / (4 * added), rel=1e-12)


def test_add_keeps_no_autograd_graph_and_reset_starts_over(context):
    mean = phalanx.GlobalMean(context, "loss")
    weight = torch.ones(3, requires_grad=True)
    mean.add(3, loss=(weight * 2).sum())
    assert not any(value.requires_grad for value in mean._pending[0])  # the step's graph can be freed
    assert mean.compute()["loss"] == pytest.approx(2.0)
    mean.reset()
    result = mean.compute()
    assert result["samples"] == 0 and math.isnan(result["loss"])
