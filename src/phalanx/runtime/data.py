"""A distributed sampler that resumes mid-epoch at the exact next sample.

It shards exactly as ``torch.utils.data.DistributedSampler`` does (same permutation from
``seed + epoch``, same padding, same stride), so a job that switches to it sees the same data.
On top: the epoch advances by itself when an epoch is exhausted (no ``set_epoch`` to forget),
and :meth:`state_dict` / :meth:`load_state_dict` carry (epoch, position) through a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(
        self, dataset_length: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False,
    ) -> None:  # fmt: skip
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if dataset_length < 1:
            raise ValueError("the dataset is empty")
        self.dataset_length = dataset_length
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if drop_last and dataset_length % world_size:
            self.num_samples = math.ceil((dataset_length - world_size) / world_size)
        else:
            self.num_samples = math.ceil(dataset_length / world_size)
        self.total_size = self.num_samples * world_size
        self.epoch = 0
        self.position = 0  # samples of this epoch already handed out on this rank
        # This rank's positions below this hold real data; the padding (if any) comes after.
        self._real_positions = min(self.num_samples, max(0, math.ceil((dataset_length - rank) / world_size)))
        self._real_offset = 0  # real_handed_out minus the real samples below the current position
        self._remaining_at_start = self.num_samples

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

    def __iter__(self) -> Iterator[int]:
        indices = self._epoch_indices()
        self._remaining_at_start = self.num_samples - self.position
        while self.position < self.num_samples:  # per sample: only the position moves (it is resumed from)
            self.position += 1
            yield indices[self.position - 1]
        self.epoch += 1  # exhausted: the next pass is the next epoch, reshuffled
        self._move_to(0)

    @property
    def real_handed_out(self) -> int:
        """Real (not padding) samples handed out since this sampler was made; the difference
        across a batch is that batch's real count, also for the batch that ends an epoch."""
        return self._real_offset + min(self.position, self._real_positions)

    def _move_to(self, position: int) -> None:
        """Sets the position without handing anything out: real_handed_out keeps its value."""
        self._real_offset += min(self.position, self._real_positions) - min(position, self._real_positions)
        self.position = position

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
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["world_size"] != self.world_size or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's sampler was for world size {state['world_size']} and seed {state['seed']}; "
                f"this run has world size {self.world_size} and seed {self.seed}: resuming would not be exact"
            )
        self.epoch = state["epoch"]
        self._move_to(state["position"])
        self._remaining_at_start = self.num_samples - self.position
