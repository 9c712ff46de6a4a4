"""A distributed sampler that resumes mid-epoch at the exact next sample, and its loader.

:class:`ResumableSampler` shards as ``torch.utils.data.DistributedSampler`` does; with DataLoader
workers it runs ahead of the loop, so :class:`ResumableLoader` counts what it delivered and
resumes at the exact next batch.
"""

from __future__ import annotations

import itertools
import math
import operator
import signal
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from phalanx.errors import SettingsRefused
from phalanx.runtime.preemption import PREEMPTION_SIGNALS

#: What draws an epoch's order, which a resume must keep: each attribute, and its name in messages.
_ORDER = {"seed": "seed", "shuffle": "shuffle", "dataset_length": "dataset length"}


class ResumableSampler(Sampler[int]):
    """A DistributedSampler that resumes mid-epoch at the exact next sample.

    It shards as ``torch.utils.data.DistributedSampler`` does (the same permutation from
    ``seed + epoch``, the same padding and stride), moves to the next epoch by itself when one
    is exhausted (no ``set_epoch`` to forget), and carries (epoch, position) through
    :meth:`state_dict`. With DataLoader workers, checkpoint the :class:`ResumableLoader`'s
    state instead: the sampler runs ahead of the loop by the batches being prepared.

    Args:
        dataset_length: the number of samples in the dataset.
        rank: this process's rank.
        world_size: the number of processes that share the dataset.
        seed: the shuffling seed, the same on every rank.
        shuffle: a new permutation every epoch; False: in order.
        drop_last: drop the tail that does not divide by ``world_size``; False: pad it
            with repeated samples, as DistributedSampler does.

    Raises:
        ValueError: ``rank`` is not in ``0..world_size - 1``, or the dataset is empty.

    Example::

        sampler = phalanx.ResumableSampler(len(dataset), rank=context.rank, world_size=context.world_size, seed=0)
        for index in sampler:  # this rank's shard of epoch 0; iterating again gives epoch 1
            ...
    """

    def __init__(
        self, dataset_length: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False,
    ) -> None:  # fmt: skip
        if dataset_length < 1:
            raise ValueError("the dataset is empty")
        self.dataset_length = dataset_length
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self._position = 0  # where this epoch's pass started, or was moved to (see position)
        self._handing_out: Iterator[int] | None = None  # the pass in progress: its indices still to come
        self._real_offset = 0  # real_handed_out minus the real samples below the current position
        self._shard(rank, world_size)
        self._remaining_at_start = self.num_samples
        #: Samples of the resumed epoch handed out again after a resume with another world size.
        self.replayed = 0

    def _shard(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.rank, self.world_size = rank, world_size
        if self.drop_last and self.dataset_length % world_size:
            self.num_samples = math.ceil((self.dataset_length - world_size) / world_size)
        else:
            self.num_samples = math.ceil(self.dataset_length / world_size)
        self.total_size = self.num_samples * world_size
        # This rank's positions below this hold real data; the padding (if any) comes after.
        self._real_positions = min(self.num_samples, max(0, math.ceil((self.dataset_length - rank) / world_size)))

    def reshard(self, rank: int, world_size: int, state: dict[str, int]) -> None:
        """Goes on as ``rank`` of ``world_size`` from ``state`` (a :meth:`state_dict` of any
        world size), in this process: heal mode's elastic job, whose world shrank without a
        restart. As :meth:`load_state_dict`, with the new shard; real_handed_out starts again at 0.

        Raises:
            ValueError: ``rank`` is not in ``0..world_size - 1``.
        """
        self._handing_out, self._position, self._real_offset = None, 0, 0
        self._shard(rank, world_size)
        self.load_state_dict(state)

    def _epoch_indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_length, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_length))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[self.rank : self.total_size : self.world_size]

    @property
    def position(self) -> int:
        """Samples of this epoch already handed out on this rank: where a resume continues."""
        if self._handing_out is None:
            return self._position
        return self.num_samples - operator.length_hint(self._handing_out)  # exact for a list's iterator

    def __iter__(self) -> Iterator[int]:
        start = self._position = self.position  # a pass left unfinished continues from where it stopped
        self._remaining_at_start = self.num_samples - start
        # A list iterator counts what it handed out (position reads the count), chained to the
        # pass's end: no Python code runs per sample, which the DataLoader asks for one by one.
        self._handing_out = iter(self._epoch_indices()[start:])
        return itertools.chain(self._handing_out, self._end_of_pass())

    def _end_of_pass(self) -> Iterator[int]:
        """Runs once the pass's indices are exhausted, and yields none."""
        self._handing_out, self._position = None, self.num_samples
        self.epoch += 1  # the next pass is the next epoch, reshuffled
        self._move_to(0)
        yield from ()

    @property
    def real_handed_out(self) -> int:
        """Real (not padding) samples handed out since this sampler was made; the difference
        across a batch is that batch's real count, also for the batch that ends an epoch."""
        return self._real_offset + min(self.position, self._real_positions)

    def _move_to(self, position: int) -> None:
        """Sets the position without handing anything out: real_handed_out keeps its value."""
        self._real_offset += min(self.position, self._real_positions) - min(position, self._real_positions)
        self._handing_out = None
        self._position = position

    def __len__(self) -> int:
        return self._remaining_at_start

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's API, for loops that call it; a new epoch starts at its beginning."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._move_to(0)
        self._remaining_at_start = self.num_samples - self.position

    def real_samples(self, start: int, stop: int) -> int:
        """How many of this rank's samples [start, stop) of the epoch are real, not padding."""
        return max(0, min(stop, self._real_positions) - min(start, self._real_positions))

    def state_dict(self) -> dict[str, int]:
        """Where this rank is (epoch, position), with the world size and the order it holds for."""
        order = {key: getattr(self, key) for key in _ORDER}
        return {"epoch": self.epoch, "position": self.position, "world_size": self.world_size, **order}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues the saved epoch at the saved position.

        Saved with another world size, the epoch goes on after the ``position x saved world
        size`` samples of the (same) permutation the saved world handed out; where that count
        does not divide by the new world size, the last few (:attr:`replayed`) are trained once
        more, and none is skipped.

        Raises:
            SettingsRefused: the state was saved mid-epoch with another data order (another seed,
                shuffling or dataset length).
        """
        for key, what in _ORDER.items():
            if state["position"] > 0 and state[key] != getattr(self, key):  # (a new epoch draws a new order anyway)
                raise SettingsRefused(
                    f"the checkpoint's data order was drawn with {what} {state[key]}; this run's {what} is "
                    f"{getattr(self, key)}",
                    "the samples the checkpoint trained this epoch are not those this order would skip: the resume "
                    "would train some twice and skip others.",
                    f"resume with the checkpoint's {what} ({state[key]}), or start a new training in another checkpoint "
                    "folder",
                )
        consumed = state["position"] * state["world_size"]
        position, self.replayed = divmod(consumed, self.world_size)
        self.epoch = state["epoch"]
        self._move_to(position)
        self._remaining_at_start = self.num_samples - self.position


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`ResumableSampler` whose state is what the loop received.

    Any DataLoader argument except ``sampler``, ``batch_sampler`` and ``in_order=False`` can be
    passed (``num_workers``, ``pin_memory``, ``collate_fn``, ``drop_last``...). Checkpoint its
    :meth:`state_dict` rather than the sampler's: with workers, the sampler's position includes
    the batches still being prepared, which a resume would skip. :attr:`real_delivered` counts
    the real (not padding) samples delivered: a batch's difference is its real count.

    Each pass draws its workers' base seed from the sampler's seed and the epoch, not from the
    global RNG, so a resumed run's random numbers follow an uninterrupted run's (a ``generator``
    given here is used instead; restore its state too). Random streams inside the workers start
    again at a resume mid-epoch.

    Its workers ignore the preemption signals, which torchrun's agent and SLURM send to the
    whole process group: a worker killed by one would crash the training before it could stop
    after the step and save. One stuck inside the dataset is killed with the rank (SIGKILL after
    the agent's grace period).

    Args:
        dataset: the dataset the sampler indexes.
        sampler: this rank's :class:`ResumableSampler`.
        batch_size: samples per batch.
        kwargs: other DataLoader arguments.

    Raises:
        ValueError: a batch size below 1, or ``in_order=False``.

    Example::

        sampler = phalanx.ResumableSampler(len(dataset), rank=context.rank, world_size=context.world_size)
        loader = phalanx.ResumableLoader(dataset, sampler, batch_size=32, num_workers=2)
        loader.load_state_dict(saved)  # an earlier loader.state_dict(), from a checkpoint
        for inputs, labels in loader:  # the rest of the saved epoch, from the next batch
            ...
    """

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, batch_size: int = 1, **kwargs: Any) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: ResumableLoader counts whole batches of at least 1 sample")
        if kwargs.get("in_order") is False:
            raise ValueError(
                "in_order=False: ResumableLoader resumes after the batches delivered, which must come in order"
            )
        kwargs["worker_init_fn"] = _IgnorePreemptionSignals(kwargs.get("worker_init_fn"))
        self._own_generator = kwargs.get("generator") is None
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._pass: _Pass | None = None  # the pass in progress
        self._real_before = 0  # real samples delivered before that pass
        # The (index, batch) pairs of the step in progress, kept to replay, and those being replayed.
        self._step_batches: deque[tuple[int, Any]] | None = None
        self._replaying: deque[tuple[int, Any]] = deque()
        self._resharded = False  # the pass in progress ends at the loop's next batch (reshard)
        #: The index in its pass of the batch the loop received last (a replayed batch keeps its own).
        self.batch_index = -1

    def __iter__(self) -> Iterator[Any]:
        epoch = self.resume_point[0]
        while (yield from self._pass_over()) and self.sampler.epoch == epoch:
            pass  # resharded (heal mode): the rest of the epoch, in the new shard

    def _pass_over(self) -> Generator[Any, None, bool]:
        """One pass from the sampler's position; True where :meth:`reshard` ended it early."""
        sampler = self.sampler
        if self._pass is not None:  # the last pass was left unfinished: continue after what it delivered
            sampler.load_state_dict(self.state_dict())
        self._real_before = self.real_delivered
        # Only the positions at the end of an epoch can be padding: below this, every sample is real.
        real_until = sampler.real_samples(0, sampler.num_samples)
        self._pass = progress = _Pass(sampler.epoch, sampler.position, real_until)
        if self._own_generator:  # the iterator's seed draw: from the epoch, not from the global RNG
            self.generator = torch.Generator().manual_seed(sampler.seed * 1_000_003 + sampler.epoch)
        for batch in super().__iter__():
            progress.delivered += 1  # counted before the loop has the batch: a checkpoint after it includes it
            self.batch_index = progress.delivered - 1
            if self._step_batches is not None:
                self._step_batches.append((self.batch_index, batch))
            yield batch
            while self._replaying:  # a failed step's batches, again (kept again: the step may fail twice)
                again = self._replaying.popleft()
                self._step_batches.append(again)  # type: ignore[union-attr]  # replay() needs it
                self.batch_index = again[0]
                yield again[1]
            if self._resharded:
                self._resharded = False
                return True
        self._real_before = self.real_delivered
        self._pass = None  # the pass is over: the sampler's own state is exact again
        return False

    def keep_step_batches(self, keep: bool = True) -> None:
        """From now on keeps the batches of the step in progress, for :meth:`replay` (or no
        longer, with ``keep=False``: the loop ended)."""
        self._step_batches = deque() if keep else None

    def step_ended(self) -> None:
        """The step in progress completed: its batches are not needed again."""
        if self._step_batches is not None:
            self._step_batches.clear()

    def reshard(self, rank: int, world_size: int, state: dict[str, int]) -> None:
        """Heal mode's elastic job, whose world shrank without a restart: the loop's next batch
        is this rank's first of the rest of the epoch from ``state`` (the old world's last
        completed step's), in its shard of the new world; real_delivered starts again at 0.

        Args:
            rank: this rank in the new world.
            world_size: the new world's size.
            state: where the epoch goes on.
        """
        self._resharded = self._pass is not None  # the pass in progress ends (else the next one starts there)
        self.sampler.reshard(rank, world_size, state)
        self._pass, self._real_before = None, 0
        self._replaying.clear()
        self.step_ended()  # its batches are in the rest of the epoch: not replayed

    def replay(self) -> None:
        """The step in progress failed: the loop receives its batches again, then goes on (the
        position, counted when they were first delivered, stays)."""
        assert self._step_batches is not None, "keep_step_batches() first"
        self._replaying.extend(self._step_batches)
        self._step_batches.clear()

    def _delivered_stop(self, progress: _Pass) -> int:
        """The sampler position after the last batch delivered in the pass in progress."""
        return min(progress.start + progress.delivered * self.batch_size, self.sampler.num_samples)

    @property
    def resume_point(self) -> tuple[int, int]:
        """(epoch, sample position) after the last batch delivered: where a resume continues."""
        progress = self._pass
        if progress is None:
            return self.sampler.epoch, self.sampler.position
        stop = self._delivered_stop(progress)
        left = self.sampler.num_samples - stop
        if left == 0 or (self.drop_last and left < self.batch_size):  # nothing more this epoch
            return progress.epoch + 1, 0
        return progress.epoch, stop

    @property
    def pass_start(self) -> int:
        """The sample position where the pass in progress began (or the next one begins): not 0
        in an epoch resumed from a checkpoint."""
        return self._pass.start if self._pass is not None else self.resume_point[1]

    @property
    def real_delivered(self) -> int:
        """Real samples delivered since the loader was made (or its state loaded)."""
        progress = self._pass
        if progress is None:
            return self._real_before
        stop = progress.start + progress.delivered * self.batch_size
        if stop <= progress.real_until:  # every batch but an epoch's last, read at every step: no call
            return self._real_before + stop - progress.start
        return self._real_before + self.sampler.real_samples(progress.start, self._delivered_stop(progress))

    def state_dict(self) -> dict[str, int]:
        """Where a resume continues (after the last batch delivered), with the batch size."""
        epoch, position = self.resume_point  # the sampler's own schema, at the delivered position
        return {**self.sampler.state_dict(), "epoch": epoch, "position": position, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues after the last batch the saved loader delivered.

        Raises:
            SettingsRefused: the state was saved with another batch size. The sample position
                would carry over, but not the steps counted from it: a loop's step number,
                schedule and progress would no longer match the data (exit code 2).

        Args:
            state: what :meth:`state_dict` returned.
        """
        if state.get("batch_size", self.batch_size) != self.batch_size:
            raise SettingsRefused(
                f"the checkpoint was saved with a batch size of {state['batch_size']} per process; this run's is "
                f"{self.batch_size}",
                "the data position carries over, but the steps counted so far, the learning-rate schedule and the "
                "progress would not match it: the resume would not be exact.",
                f"resume with the checkpoint's batch size ({state['batch_size']}), or start a new training in another "
                "checkpoint folder",
            )
        self.sampler.load_state_dict(state)
        self._pass, self._real_before = None, 0


class _Pass:
    """A pass of a ResumableLoader over its sampler: where it began and the batches the loop
    received. A plain object, counted every batch (an attribute of the DataLoader itself would
    go through DataLoader.__setattr__, Python code, at every batch)."""

    __slots__ = ("epoch", "start", "delivered", "real_until")

    def __init__(self, epoch: int, start: int, real_until: int) -> None:
        self.epoch, self.start, self.delivered = epoch, start, 0
        self.real_until = real_until  # the sampler's positions below it hold real samples


class _IgnorePreemptionSignals:
    """A DataLoader ``worker_init_fn``: the worker ignores the preemption signals, then runs the
    user's own function. A class, not a closure: workers started by spawn receive it pickled."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)
