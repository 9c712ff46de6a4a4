"""SharedReduction on one process: which parts go into which all-reduce (the sum across ranks
itself is in the e2e runs: tests/e2e/workers/preemption_votes.py)."""

from __future__ import annotations

import torch

import phalanx


def test_parts_added_between_two_starts_are_read_back_each_as_float64(context):
    shared = phalanx.SharedReduction(context)
    assert not shared.pending
    first = shared.add(torch.tensor([1.0, 2.0], dtype=torch.float32))
    second = shared.add(torch.tensor([[3, 4], [5, 6]]))  # flattened
    assert shared.pending
    shared.start()
    assert not shared.pending
    assert first.wait().tolist() == [1.0, 2.0] and first.wait().dtype == torch.float64
    assert second.wait().tolist() == [3.0, 4.0, 5.0, 6.0]


def test_a_part_added_after_a_start_goes_into_the_next_all_reduce(context):
    shared = phalanx.SharedReduction(context)
    before = shared.add(torch.tensor([1.0]))
    shared.start()
    after = shared.add(torch.tensor([2.0]))
    assert shared.pending  # the next start is a collective of its own
    assert (before.wait().item(), after.wait().item()) == (1.0, 2.0)


def test_reading_a_part_not_started_starts_its_reduction_and_the_caller_s_tensor_is_not_reduced(context):
    shared = phalanx.SharedReduction(context)
    values = torch.tensor([7.0], dtype=torch.float64)
    part = shared.add(values)
    assert part.wait().item() == 7.0
    assert not shared.pending  # started by the read: the loop's start() after it has nothing to do
    part.wait().fill_(0.0)
    assert values.item() == 7.0  # a copy was reduced


def test_a_global_mean_handed_a_shared_reduction_only_adds_its_totals_to_it(context):
    shared = phalanx.SharedReduction(context)
    mean = phalanx.GlobalMean(context, "loss")
    mean.add_mean(4, loss=torch.tensor(0.5))
    pending = mean.compute_async(shared=shared)
    assert shared.pending
    shared.start()
    assert pending.result() == {"loss": 0.5, "samples": 4.0}
