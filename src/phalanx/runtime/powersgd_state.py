"""PowerSGD with a state that survives a checkpoint, and a resume that continues bit for bit.

torch's ``PowerSGDState`` keeps its memories per DDP bucket, but a DDP model made anew does not
have the buckets they were written for: a bucket in another layout re-enacts the saved buckets it
holds, or takes the memories moved by parameter (docs/runtime-design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

#: Plain all-reduce for the first steps, while DDP rebuilds its buckets: 2 is the smallest value torch accepts.
START_ITER = 2
Future = torch.futures.Future


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a bucket, as powerSGD_hook sees it."""

    name: str
    numel: int
    rows: int  # the gradient as a (rows, cols) matrix, as powerSGD_hook views it
    cols: int
    rank: int  # its approximation rank; 0 when it is sent uncompressed

    @property
    def shape(self) -> tuple[int, int]:
        """The gradient's (rows, cols) as a matrix."""
        return self.rows, self.cols


Layout = tuple[Slot, ...]


def bucket_layout(bucket: Any, names: dict[int, str], approximation_rank: int, min_compression_rate: float) -> Layout:
    """The bucket's parameters in buffer order (DDP lays a bucket's buffer out in this order)."""
    slots = []
    for parameter in bucket.parameters():
        rows = parameter.shape[0] if parameter.dim() else 1
        cols = parameter.numel() // rows
        rank = min(rows, cols, approximation_rank)
        compressed = powerSGD_hook._should_compress(rows, cols, rank, min_compression_rate)[0]
        slots.append(Slot(names[id(parameter)], parameter.numel(), rows, cols, rank if compressed else 0))
    return tuple(slots)


def _q_order(layout: Layout) -> list[Slot]:
    """Compressed matrices in Q-memory order: powerSGD_hook groups them by shape, in the order
    each shape first appears (batch_tensors_with_same_shape is off)."""
    groups: dict[tuple[int, int], list[Slot]] = {}
    for slot in layout:
        if slot.rank:
            groups.setdefault(slot.shape, []).append(slot)
    return [slot for group in groups.values() for slot in group]


def _numels(slots: Sequence[Slot]) -> list[int]:
    return [slot.numel for slot in slots]


def _pieces(flat: torch.Tensor, slots: Sequence[Slot], sizes: Sequence[int]) -> dict[str, torch.Tensor]:
    if flat.numel() != sum(sizes):
        raise RuntimeError(
            f"PowerSGD memory of {flat.numel()} values does not match its bucket layout ({sum(sizes)}): "
            f"torch {torch.__version__} lays it out differently from what phalanx expects"
        )
    return {slot.name: piece for slot, piece in zip(slots, flat.split(list(sizes)))}


class _SavedBucket:
    """A bucket in a saved layout, over a buffer of its own: what powerSGD_hook reads of a GradBucket."""

    def __init__(self, index: int, layout: Layout, buffer: torch.Tensor, last: bool) -> None:
        self._index, self._layout, self._buffer, self._last = index, layout, buffer, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        return [piece.view(slot.shape) for slot, piece in zip(self._layout, self._buffer.split(_numels(self._layout)))]


class PowerSGD:
    """``powerSGD_hook`` (error feedback, warm start) with a checkpointable state; call it per bucket."""

    name = "powersgd"
    #: The steps before its timings mean anything: plain all-reduce until START_ITER, then the
    #: first compressed step, which allocates the memories and draws Q at random.
    warmup_steps = START_ITER + 1

    def __init__(self, names: dict[int, str], approximation_rank: int = 1) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=approximation_rank, start_powerSGD_iter=START_ITER
        )
        self._names = names  # id(parameter) -> its name in the model
        self._layouts: dict[int, Layout] = {}  # bucket index -> the layout its memories are in
        self._restored: set[int] = set()  # indices of layouts from a checkpoint that no bucket has had yet
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}  # name -> memories moving to another bucket

    def __call__(self, bucket: Any) -> Future[torch.Tensor]:
        index = bucket.index()
        layout = bucket_layout(
            bucket, self._names, self.state.matrix_approximation_rank, self.state.min_compression_rate
        )
        if self._layouts.get(index, layout) != layout:
            saved = self._restored_buckets_holding(layout)
            if saved:
                return self._reenact(bucket, layout, saved)
            # Buckets are handed over in index order, so the ones below this index are in their
            # layout of this step already (and may be in flight): move this and the later ones.
            self._waiting.update(self._lift(lambda other: other >= index))
        self._restored.discard(index)  # from here on, this index has the live layout
        if self._waiting:
            self._lay_out(index, layout, bucket.buffer())
        self._layouts[index] = layout
        return powerSGD_hook.powerSGD_hook(self.state, bucket)

    # -- a fresh DDP's first step over the saved buckets --------------------------------------

    def _restored_buckets_holding(self, layout: Layout) -> list[int]:
        """Restored buckets whose parameters together are exactly this bucket's, or []."""
        names = {slot.name for slot in layout}
        inside = [i for i in sorted(self._restored) if {s.name for s in self._layouts[i]} <= names]
        covered = [slot.name for i in inside for slot in self._layouts[i]]
        return inside if len(covered) == len(names) and set(covered) == names else []

    def _reenact(self, bucket: Any, layout: Layout, saved: list[int]) -> Future[torch.Tensor]:
        """One saved bucket after the other, each finished before the next starts (as
        GradientCompression.communicate does on gloo); one step after a resume: speed does not matter."""
        real = bucket.buffer()
        views = _pieces(real, layout, _numels(layout))
        for k, index in enumerate(saved):
            slots = self._layouts[index]
            buffer = torch.cat([views[slot.name] for slot in slots])  # fresh and aligned, in the saved order
            last = bucket.is_last() and k == len(saved) - 1
            result = powerSGD_hook.powerSGD_hook(self.state, _SavedBucket(index, slots, buffer, last)).wait()
            for slot, piece in zip(slots, result.split(_numels(slots))):
                views[slot.name].copy_(piece)
        done: Future[torch.Tensor] = torch.futures.Future()
        done.set_result(real)
        return done

    # -- moving memories by parameter ---------------------------------------------------------

    def _lift(self, which: Callable[[int], bool]) -> dict[str, dict[str, torch.Tensor]]:
        """Removes the memories of the buckets ``which(index)`` selects; returns them by parameter."""
        memories: dict[str, dict[str, torch.Tensor]] = {}
        for index in [index for index in self._layouts if which(index)]:
            layout = self._layouts.pop(index)
            self._restored.discard(index)
            if index in self.state.error_dict:
                for name, error in _pieces(self.state.error_dict.pop(index), layout, _numels(layout)).items():
                    memories.setdefault(name, {})["error"] = error
            if index in self.state.q_memory_dict:
                order = _q_order(layout)
                for name, q in _pieces(
                    self.state.q_memory_dict.pop(index), order, [s.cols * s.rank for s in order]
                ).items():
                    memories.setdefault(name, {})["q"] = q
            self.state.p_memory_dict.pop(index, None)
        return memories

    def _lay_out(self, index: int, layout: Layout, buffer: torch.Tensor) -> None:
        """Puts the waiting memories of this bucket's parameters into the bucket's layout."""
        waiting = [self._waiting.get(slot.name, {}) for slot in layout]
        if all("error" in memory for memory in waiting):
            self.state.error_dict[index] = torch.cat([memory["error"] for memory in waiting])
        order = _q_order(layout)
        if order and all("q" in self._waiting.get(slot.name, {}) for slot in order):
            self.state.q_memory_dict[index] = torch.cat([self._waiting[slot.name]["q"] for slot in order])
            self.state.p_memory_dict[index] = _p_memory(layout, buffer)
        for slot in layout:
            self._waiting.pop(slot.name, None)

    def release(self) -> None:
        """Drops the memories (auto chose another candidate)."""
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict, self._layouts,
                       self._restored, self._waiting):  # fmt: skip
            memory.clear()

    # -- checkpoints ------------------------------------------------------------------------------

    def shared_state(self) -> dict[str, Any]:
        """What every rank holds alike: step count, seed generator, layouts, warm-start Q."""
        kind, keys, position, has_gauss, cached = self.state.rng.get_state()
        return {
            "iter": self.state.iter,
            "rng": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],  # weights_only takes no numpy
            "layouts": {index: [list(astuple(slot)) for slot in layout] for index, layout in self._layouts.items()},
            "q": {index: q.clone() for index, q in self.state.q_memory_dict.items()},
            "numel_before": self.state.total_numel_before_compression,
            "numel_after": self.state.total_numel_after_compression,
        }

    def rank_state(self) -> dict[int, torch.Tensor]:
        """This rank's error-feedback residual per bucket."""
        return {index: error.clone() for index, error in self.state.error_dict.items()}

    def load(self, shared: dict[str, Any], errors: dict[int, torch.Tensor] | None, device: torch.device) -> None:
        """Restores a state; ``errors=None`` (another world size) restarts error feedback at zero."""
        import numpy

        kind, keys, position, has_gauss, cached = shared["rng"]
        self.state.rng.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached))
        self.state.iter = shared["iter"]
        self.state.total_numel_before_compression = shared["numel_before"]
        self.state.total_numel_after_compression = shared["numel_after"]
        self._waiting = {}
        self._layouts = {int(i): tuple(Slot(*slot) for slot in layout) for i, layout in shared["layouts"].items()}
        self._restored = set(self._layouts)
        self.state.q_memory_dict = {int(i): q.to(device) for i, q in shared["q"].items()}
        self.state.p_memory_dict = {i: _p_memory(self._layouts[i], q) for i, q in self.state.q_memory_dict.items()}
        self.state.error_dict = {int(i): error.to(device) for i, error in (errors or {}).items()}


def _p_memory(layout: Layout, like: torch.Tensor) -> torch.Tensor:
    """P is recomputed from Q before it is read: it only has to exist for Q to be reused."""
    return torch.zeros(sum(slot.rows * slot.rank for slot in _q_order(layout)), dtype=like.dtype, device=like.device)
