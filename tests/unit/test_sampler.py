"""ResumableSampler shards as DistributedSampler does, and resumes at the exact next sample."""

import itertools

import pytest
from torch.utils.data import DistributedSampler

from phalanx.runtime.data import ResumableSampler


@pytest.mark.parametrize("length, world, drop_last", [(10, 3, False), (10, 3, True), (12, 4, False), (7, 2, False), (5, 8, False)])
def test_same_shards_as_distributed_sampler_every_epoch(length, world, drop_last):
    for rank in range(world):
        ours = ResumableSampler(length, rank=rank, world_size=world, seed=7, drop_last=drop_last)
        theirs = DistributedSampler(range(length), num_replicas=world, rank=rank, seed=7, drop_last=drop_last)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)  # ours advances its epoch by itself
            assert ours.epoch == epoch + 1


def test_resume_mid_epoch_continues_with_the_exact_next_sample():
    whole = ResumableSampler(100, rank=1, world_size=4, seed=3)
    expected = list(itertools.chain(whole, whole))  # two epochs
    first = ResumableSampler(100, rank=1, world_size=4, seed=3)
    taken = list(itertools.islice(iter(first), 9))
    resumed = ResumableSampler(100, rank=1, world_size=4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert len(resumed) == 25 - 9
    assert taken + list(resumed) + list(resumed) == expected


def test_resume_refuses_another_world_size():
    state = ResumableSampler(10, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world size 2"):
        ResumableSampler(10, rank=0, world_size=4).load_state_dict(state)


def test_padding_is_counted_apart():
    sampler = ResumableSampler(10, rank=2, world_size=4)  # 12 slots: ranks 2 and 3 get one padded sample
    assert sampler.num_samples == 3
    assert sampler.real_samples(0, 3) == 2
    assert ResumableSampler(10, rank=0, world_size=4).real_samples(0, 3) == 3


def test_real_samples_are_counted_up_to_the_end_of_the_epoch():
    sampler = ResumableSampler(10, rank=2, world_size=4)
    assert len(list(sampler)) == 3 and sampler.real_handed_out == 2  # the third was padding
    list(sampler)
    assert sampler.real_handed_out == 4
