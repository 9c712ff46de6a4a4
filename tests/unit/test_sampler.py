"""ResumableSampler shards as DistributedSampler does, and resumes at the exact next sample."""

import itertools
import re

import pytest
from torch.utils.data import DistributedSampler

from phalanx.errors import SettingsRefused
from phalanx.runtime.data import ResumableSampler


@pytest.mark.parametrize(
    "length, world, drop_last", [(10, 3, False), (10, 3, True), (12, 4, False), (7, 2, False), (5, 8, False)]
)
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


def test_a_pass_left_unfinished_continues_where_it_stopped():
    """The position is what was handed out (read from the pass in progress), also when the
    loop broke out: a new pass over the sampler continues the epoch instead of repeating it."""
    whole = list(ResumableSampler(100, rank=1, world_size=4, seed=3))
    sampler = ResumableSampler(100, rank=1, world_size=4, seed=3)
    taken = list(itertools.islice(iter(sampler), 9))
    assert sampler.position == 9 and sampler.state_dict()["position"] == 9 and sampler.epoch == 0
    assert taken + list(sampler) == whole
    assert (sampler.position, sampler.epoch) == (0, 1)


def epoch_after_a_world_change(length: int, before: int, taken: int, after: int) -> tuple[list[int], int]:
    """The samples an epoch trains when ``before`` ranks take ``taken`` each and ``after`` ranks
    go on from their checkpoint; and how many the new ranks hand out again."""
    ranks = [ResumableSampler(length, rank=r, world_size=before, seed=5) for r in range(before)]
    trained = [index for sampler in ranks for index in itertools.islice(iter(sampler), taken)]
    state = ranks[0].state_dict()
    resumed = [ResumableSampler(length, rank=r, world_size=after, seed=5) for r in range(after)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    return trained + [index for sampler in resumed for index in sampler], resumed[0].replayed


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (4, 2), (2, 4)])
def test_another_world_size_continues_the_epoch_with_no_sample_twice_or_skipped(before, after):
    """12 samples taken (6 x 2, 4 x 3...) divide by the new world size: every sample of the
    epoch once, the padding of the new world's shards apart."""
    trained, replayed = epoch_after_a_world_change(60, before, 12 // before, after)
    assert replayed == 0 and sorted(trained) == list(range(60))


def test_a_position_that_does_not_divide_trains_the_last_few_again_and_skips_none():
    trained, replayed = epoch_after_a_world_change(60, 2, 5, 3)  # 10 taken: 9 divide by 3
    assert replayed == 1 and set(trained) == set(range(60)) and len(trained) == 61


def mid_epoch_state(**settings) -> dict:
    sampler = ResumableSampler(10, rank=0, world_size=2, **settings)
    next(iter(sampler))  # one sample of the epoch handed out
    return sampler.state_dict()


def test_resume_refuses_another_seed():
    state = mid_epoch_state(seed=1)
    with pytest.raises(SettingsRefused, match="drawn with seed 1; this run's seed is 2"):
        ResumableSampler(10, rank=0, world_size=2, seed=2).load_state_dict(state)


@pytest.mark.parametrize(
    "changed, says",
    [({"shuffle": False}, "drawn with shuffle True; this run's shuffle is False"),
     ({"length": 12}, "drawn with dataset length 10; this run's dataset length is 12")],
)  # fmt: skip
def test_resume_refuses_another_shuffling_or_dataset_length(changed, says):
    # each draws another order: the samples the checkpoint trained this epoch would not be those skipped
    state = mid_epoch_state()
    resumed = ResumableSampler(changed.get("length", 10), rank=0, world_size=2, shuffle=changed.get("shuffle", True))
    with pytest.raises(SettingsRefused, match=re.escape(says)):
        resumed.load_state_dict(state)
    at_a_new_epoch = ResumableSampler(10, rank=0, world_size=2).state_dict()  # nothing of it trained: any order
    resumed.load_state_dict(at_a_new_epoch)
    assert resumed.position == 0


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


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("length", "world_size"), [(10, 4), (7, 3), (8, 2), (5, 8), (1, 1)])
def test_real_count_matches_the_padding_of_distributed_sampler(length, world_size, drop_last):
    """Each handed-out index is real when it is the first occurrence of its position in
    DistributedSampler's padded order: the brute-force count the closed form must equal."""
    for rank in range(world_size):
        sampler = ResumableSampler(length, rank=rank, world_size=world_size, shuffle=False, drop_last=drop_last)
        real_positions = [p for p in range(sampler.num_samples) if rank + p * world_size < length]
        counts = []
        for _ in iter(sampler):
            counts.append(sampler.real_handed_out)
        assert counts == [sum(1 for p in real_positions if p < taken) for taken in range(1, sampler.num_samples + 1)]
        assert sampler.real_samples(0, sampler.num_samples) == len(real_positions)


def test_real_count_only_grows_by_what_is_handed_out():
    """Moving the position (set_epoch mid-pass, a resume) hands nothing out: the counter keeps
    its value, so a loop's per-batch differences stay the batch's real samples."""
    sampler = ResumableSampler(10, rank=2, world_size=4, shuffle=False)
    it = iter(sampler)
    next(it), next(it)
    assert sampler.real_handed_out == 2
    sampler.set_epoch(5)  # a new epoch from its beginning
    assert sampler.real_handed_out == 2
    resumed = ResumableSampler(10, rank=2, world_size=4, shuffle=False)
    resumed.load_state_dict({**sampler.state_dict(), "position": 2})
    assert resumed.real_handed_out == 0
    assert len(list(resumed)) == 1 and resumed.real_handed_out == 0  # position 2 is this rank's padding
