"""GlobalMean on one process: the running sums (the all-reduce itself is in the e2e runs)."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx
from phalanx.runtime import metrics


def test_the_mean_is_exact_across_folds_and_value_types(context):
    """More additions than one fold holds, tensors of several dtypes and Python numbers mixed:
    the result is the float64 sum of exactly the values given, not float32 arithmetic."""
    mean = phalanx.GlobalMean(context, "loss", "correct")
    added = 3 * metrics._FOLD_EVERY + 7
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    expected_loss = expected_correct = 0.0
    for step in range(added):
        loss = torch.tensor(0.1 + step * 1e-4, dtype=dtypes[step % 3])
        correct = [torch.tensor(step % 3, dtype=torch.int64), float(step % 3), torch.tensor(step % 3 == 1)][step % 3]
        mean.add(4, loss=loss, correct=correct)
        expected_loss += float(loss)  # the value as given, summed in float64
        expected_correct += float(correct)
    result = mean.compute()
    assert result["samples"] == 4 * added
    assert result["loss"] == pytest.approx(expected_loss / (4 * added), rel=1e-12)
    assert result["correct"] == pytest.approx(expected_correct / (4 * added), rel=1e-12)


def test_the_tensor_column_converts_every_dtype_exactly():
    values = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(2**40 + 1, dtype=torch.int64), torch.tensor(True)]
    column = metrics._float64_column(values, torch.device("cpu"))
    assert column.dtype == torch.float64 and column.tolist() == [float(torch.tensor(0.1)), 2.0**40 + 1, 1.0]
    same_type = [torch.tensor(0.1), torch.tensor(0.2)]  # the usual case: one stack, one conversion
    assert metrics._float64_column(same_type, torch.device("cpu")).tolist() == [float(v) for v in same_type]


def test_values_in_host_memory_are_summed_on_the_host_and_the_device_sum_weights_exactly(context):
    """On the CPU every kept tensor is read at the fold and summed on the host: no float64 sums
    are kept as tensors. The sum for values on an accelerator is not reached here (CI has no
    GPU: tests/gpu covers that routing); its arithmetic is the same on any device, so it is
    called directly with CPU tensors: weights times values, each converted exactly."""
    mean = phalanx.GlobalMean(context, "loss")
    mean.add_mean(2, loss=torch.tensor(0.5))
    mean.add_mean(3, loss=torch.tensor(1.25, dtype=torch.float16))
    assert mean.compute() == {"loss": pytest.approx((2 * 0.5 + 3 * 1.25) / 5, rel=1e-12), "samples": 5.0}
    assert mean._device_sums is None
    big = torch.tensor(2**40 + 1, dtype=torch.int64)  # not exact in float32
    mean._add_on_device(0, [(2, torch.tensor(0.1)), (3, big)])
    assert mean._device_sums.dtype == torch.float64
    assert mean._device_sums.tolist() == [2 * float(torch.tensor(0.1)) + 3 * (2.0**40 + 1)]


def test_add_keeps_no_autograd_graph_and_reset_starts_over(context):
    mean = phalanx.GlobalMean(context, "loss")
    weight = torch.ones(3, requires_grad=True)
    mean.add(3, loss=(weight * 2).sum())
    values = [value for _, row in mean._pending for value in row]
    assert not any(
        isinstance(value, torch.Tensor) and value.requires_grad for value in values
    )  # the graph can be freed
    assert mean.compute()["loss"] == pytest.approx(2.0)
    mean.reset()
    result = mean.compute()
    assert result["samples"] == 0 and math.isnan(result["loss"])


def test_a_diverged_loss_shows_as_nan_or_inf_and_does_not_raise(context):
    mean = phalanx.GlobalMean(context, "loss")
    mean.add_mean(2, loss=torch.tensor(float("inf")))
    assert mean.compute()["loss"] == math.inf
    mean.add_mean(2, loss=torch.tensor(float("-inf")))
    assert math.isnan(mean.compute()["loss"])


def test_a_non_finite_value_is_counted_apart_so_later_spans_of_the_running_sums_stay_finite(context):
    """The sums since an earlier snapshot leave out a NaN or infinity added before it: the
    reporter's running sums take a diverged batch without showing NaN ever after. In host
    memory and on a device alike (the device sum is called directly, as above)."""
    mean = phalanx.GlobalMean(context, "loss")
    mean.add_mean(2, loss=torch.tensor(1.0))
    before = mean.snapshot()
    mean.add_mean(2, loss=torch.tensor(float("nan")))
    mean.add_mean(2, loss=float("inf"))
    at_the_nan = mean.snapshot()
    mean.add_mean(4, loss=torch.tensor(3.0))
    mean.add_mean(4, loss=5.0)
    pending = mean.compute_async(before, at_the_nan)
    first, nan, now = pending.running_sums("loss")
    assert math.isnan(nan.mean_since(first)) and math.isnan(pending.result()["loss"])
    assert now.mean_since(nan) == 4.0 and now.samples == 14
    assert [row["loss"] for row in pending.snapshot_results()][0] == 1.0
    on_device = phalanx.GlobalMean(context, "loss")
    on_device._add_on_device(0, [(2, torch.tensor(1.0)), (1, torch.tensor(float("-inf"))), (2, torch.tensor(4.0))])
    assert on_device._device_sums.tolist() == [10.0] and on_device._device_infinite.tolist() == [0.0, 1.0]
    on_device._add_on_device(0, [(1, torch.tensor(float("nan")))])
    assert on_device._device_infinite.tolist() == [1.0, 2.0]  # a NaN: one of each


def test_a_started_computation_holds_the_values_added_before_it_only(context):
    """compute_async snapshots the totals: what a training step adds while the all-reduce runs
    belongs to the next logging point, not to the one in flight."""
    mean = phalanx.GlobalMean(context, "loss")
    mean.add(2, loss=torch.tensor(3.0))
    pending = mean.compute_async()
    mean.add(2, loss=torch.tensor(100.0))
    assert pending.result() == {"loss": 1.5, "samples": 2.0}
    assert pending.result() is pending.result()  # read once, kept
    assert mean.compute() == {"loss": pytest.approx(103.0 / 4), "samples": 4.0}


def test_batch_means_are_weighted_by_their_samples_and_an_empty_batch_adds_nothing(context):
    mean = phalanx.GlobalMean(context, "loss")
    mean.add_mean(2, loss=torch.tensor(1.0))
    mean.add_mean(6, loss=torch.tensor(3.0))
    mean.add_mean(0, loss=torch.tensor(float("nan")))  # a rank's batch of padding only
    assert mean.compute() == {"loss": pytest.approx(20.0 / 8), "samples": 8.0}
    mean.add(2, loss=10.0)  # a sum over 2 samples goes into the same total
    assert mean.compute() == {"loss": pytest.approx(30.0 / 10), "samples": 10.0}


def test_snapshots_are_reduced_with_the_next_computation_and_keep_their_own_totals(context):
    """An epoch's end keeps its totals aside; the next logging point reduces them in the same
    collective and returns each one's means, in the order given."""
    mean = phalanx.GlobalMean(context, "loss", "correct")
    mean.add(2, loss=torch.tensor(3.0), correct=1)
    first = mean.snapshot()
    mean.add_mean(4, loss=torch.tensor(0.5), correct=torch.tensor(0.25))
    second = mean.snapshot()
    mean.add(2, loss=7.0, correct=2)
    pending = mean.compute_async(first, second)
    mean.add(2, loss=100.0, correct=0)  # after the start: in none of them
    assert pending.snapshot_results() == [
        {"loss": 1.5, "correct": 0.5, "samples": 2.0},
        {"loss": pytest.approx(5.0 / 6), "correct": pytest.approx(2.0 / 6), "samples": 6.0},
    ]
    assert pending.result() == {"loss": pytest.approx(12.0 / 8), "correct": pytest.approx(4.0 / 8), "samples": 8.0}
    assert mean.compute_async().snapshot_results() == []
    with pytest.raises(ValueError, match="a snapshot of 1 value"):
        mean.compute_async(phalanx.GlobalMean(context, "loss").snapshot())
