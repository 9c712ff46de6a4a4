"""ResumableLoader: with DataLoader workers, a resume continues at the batch after the last
one the loop received, although the sampler has already handed out the batches in flight."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

from phalanx.runtime.data import ResumableLoader, ResumableSampler

DATASET = TensorDataset(torch.arange(103))


def loader(workers: int, rank: int = 1, world_size: int = 2, **kwargs) -> ResumableLoader:
    sampler = ResumableSampler(len(DATASET), rank=rank, world_size=world_size, seed=5)
    return ResumableLoader(DATASET, sampler, batch_size=4, num_workers=workers, **kwargs)


def batches(source, epochs: int) -> list[list[int]]:
    return [batch[0].tolist() for _ in range(epochs) for batch in source]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_continues_after_the_last_batch_the_loop_received(workers):
    expected = batches(loader(0), epochs=2)  # 13 batches per epoch on this rank
    first = loader(workers)
    received = [batch[0].tolist() for batch in itertools.islice(iter(first), 5)]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (0, 20)
    if workers:  # the reason for the loader: its workers were handed batches the loop never saw
        assert first.sampler.state_dict()["position"] > 20
    resumed = loader(workers)
    resumed.load_state_dict(state)
    assert received + batches(resumed, epochs=2)[: len(expected) - 5] == expected


def test_the_last_batch_of_an_epoch_moves_the_state_to_the_next_epoch():
    source = loader(2)
    iterator = iter(source)
    for _ in range(13):
        next(iterator)
    assert (source.state_dict()["epoch"], source.state_dict()["position"]) == (1, 0)


def test_a_pass_left_unfinished_continues_after_what_it_delivered():
    expected = batches(loader(0), epochs=1)
    source = loader(2)
    received = [batch[0].tolist() for batch in itertools.islice(iter(source), 3)]
    assert received + batches(source, epochs=1) == expected


def test_real_samples_delivered_leave_the_padding_out():
    """103 samples on 4 ranks: rank 3's 26th sample is padding, in its last batch."""
    source = loader(2, rank=3, world_size=4)
    counts = []
    before = 0
    for _ in source:
        counts.append(source.real_delivered - before)
        before = source.real_delivered
    assert counts == [4] * 6 + [1]  # 26 slots in batches of 4; the last holds 1 real sample and 1 padding
    assert source.real_delivered == 25

    resumed = loader(2, rank=3, world_size=4)  # mid-epoch, after 3 batches (12 slots): 4, 4, 4 and 1 real are left
    resumed.load_state_dict({**source.state_dict(), "epoch": 0, "position": 12})
    counts = []
    for _ in resumed:
        counts.append(resumed.real_delivered - sum(counts))
    assert counts == [4, 4, 4, 1]


def test_batches_of_no_size_are_refused():
    with pytest.raises(ValueError, match="batch_size=None"):
        ResumableLoader(DATASET, ResumableSampler(len(DATASET)), batch_size=None)


class SignalDispositions(torch.utils.data.Dataset):
    """Each item: whether the worker that loads it ignores SIGTERM and SIGUSR1, and ran the user's init."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        import signal

        ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1)]
        return torch.tensor([*ignored, torch.utils.data.get_worker_info().seed == USER_INIT_SEEN.get("seed")])


USER_INIT_SEEN: dict[str, int] = {}


def user_worker_init(worker_id: int) -> None:
    USER_INIT_SEEN["seed"] = torch.utils.data.get_worker_info().seed


def test_workers_ignore_the_preemption_signals_and_still_run_the_users_init():
    """A SIGTERM to the process group (torchrun's agent, SLURM) must not kill the workers: the
    training process would die of it before its preemption guard could save."""
    source = ResumableLoader(SignalDispositions(), ResumableSampler(4), batch_size=2, num_workers=1,
                             worker_init_fn=user_worker_init)  # fmt: skip
    for batch in source:
        assert batch.all(), batch.tolist()


def test_with_drop_last_the_state_after_the_last_whole_batch_is_the_next_epoch():
    """The short tail is never delivered: a checkpoint after the last whole batch resumes at
    the next epoch's start, not at a pass that would deliver nothing."""
    source = loader(0, drop_last=True)  # 52 samples on this rank, batches of 4: 13 whole ones
    short = ResumableLoader(DATASET, ResumableSampler(len(DATASET), rank=1, world_size=2, seed=5), batch_size=5,
                            drop_last=True)  # fmt: skip  # 10 whole batches of 5, a tail of 2 dropped
    iterator = iter(short)
    for _ in range(10):
        next(iterator)
    assert short.resume_point == (1, 0)
    assert len(list(source)) == 13


def test_batches_out_of_order_are_refused():
    with pytest.raises(ValueError, match="in_order=False"):
        ResumableLoader(DATASET, ResumableSampler(len(DATASET)), batch_size=2, num_workers=1, in_order=False)


def test_a_state_saved_with_another_batch_size_is_refused():
    """The sample position would carry over, the steps counted from it would not (the probe saw
    "step 90/285" and a run that ended at step 201 of 285)."""
    from phalanx.errors import SettingsRefused

    first = loader(0)
    list(itertools.islice(iter(first), 3))
    sampler = ResumableSampler(len(DATASET), rank=1, world_size=2, seed=5)
    larger = ResumableLoader(DATASET, sampler, batch_size=8)
    with pytest.raises(SettingsRefused, match="saved with a batch size of 4 per process; this run's is 8") as refused:
        larger.load_state_dict(first.state_dict())
    assert "resume with the checkpoint's batch size (4)" in refused.value.hint
    assert larger.state_dict()["position"] == 0  # nothing was loaded


@pytest.mark.parametrize("workers", [0, 2])
def test_a_replayed_step_gives_its_batches_again_and_keeps_the_position(workers):
    """Heal mode: the step in progress failed; the loop receives its batches once more, then the
    next ones, and the resume point stays after them (they were counted once)."""
    expected = batches(loader(0), epochs=1)
    source = loader(workers)
    source.keep_step_batches()
    iterator = iter(source)
    received = [next(iterator)[0].tolist() for _ in range(3)]
    source.step_ended()  # a step of three batches completed
    received += [next(iterator)[0].tolist() for _ in range(2)]  # the next step's two: it fails
    position = source.state_dict()["position"]
    source.replay()
    assert source.state_dict()["position"] == position
    again = [next(iterator)[0].tolist() for _ in range(2)]
    assert again == received[3:5]
    assert source.batch_index == 4  # a replayed batch keeps its index in the pass
    source.replay()  # the step failed once more: the same two batches again
    assert [next(iterator)[0].tolist() for _ in range(2)] == received[3:5]
    source.step_ended()
    rest = [batch[0].tolist() for batch in iterator]
    assert source.batch_index == len(expected) - 1
    assert received + rest == expected
    assert source.state_dict()["epoch"] == 1


def test_a_failed_last_step_of_an_epoch_is_replayed_before_the_pass_ends():
    source = loader(0)
    source.keep_step_batches()
    delivered = [batch[0].tolist() for batch in itertools.islice(iter(source), 12)]
    source.step_ended()
    iterator = iter(source)  # the pass continues after what it delivered
    last = next(iterator)[0].tolist()
    source.replay()
    assert next(iterator)[0].tolist() == last
    with pytest.raises(StopIteration):
        next(iterator)
    assert last not in delivered


@pytest.mark.parametrize("workers", [0, 2])
def test_a_world_that_shrank_in_the_process_goes_on_in_the_new_shards_and_no_sample_is_lost(workers):
    """Heal mode in an elastic job: 3 ranks trained two steps, the third step failed as a rank's
    node was lost; the 2 others go on from the last completed step in their new shards, in the
    same loop (the same iterator), and the epoch's samples are each trained once."""
    sources = [loader(workers, rank=rank, world_size=3) for rank in range(3)]
    iterators = [iter(source) for source in sources]
    for source in sources:
        source.keep_step_batches()
    trained = [index for _ in range(2) for it in iterators for index in next(it)[0].tolist()]
    for source in sources:
        source.step_ended()
    state = sources[0].state_dict()  # the last completed step's position, with world size 3
    for it in iterators[:2]:
        next(it)  # the failed step's batches: trained again, in the new shards
    for rank, source in enumerate(sources[:2]):
        source.reshard(rank, 2, state)
        assert source.real_delivered == 0
    for it in iterators[:2]:
        trained += [index for batch in it for index in batch[0].tolist()]
    iterators[2].close()  # the lost rank's (its DataLoader workers end)
    assert sorted(set(trained)) == list(range(len(DATASET)))
    assert len(trained) == len(DATASET) + 1  # 2 ranks pad 103 samples with one repeated, as DistributedSampler
    assert [source.state_dict()["epoch"] for source in sources[:2]] == [1, 1]
    assert sources[1].sampler.world_size == 2 and sources[1].sampler.rank == 1
