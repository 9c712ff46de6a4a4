"""One all-reduce for the small sums several parts of a training loop need at the same step boundary.

A logging point's global loss (:meth:`GlobalMean.compute_async
<phalanx.runtime.metrics.GlobalMean.compute_async>`) and a preemption vote
(:meth:`PreemptionGuard.should_stop <phalanx.runtime.preemption.PreemptionGuard.should_stop>`)
each need a few numbers summed across the ranks; a tiny collective costs its round trip, not its
bytes. They add their vectors to a :class:`SharedReduction`, and :meth:`SharedReduction.start`
sums all of them (float64, on the context's device) in one all-reduce. Every rank adds vectors of
the same sizes, in the same order, between the same two starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext
from phalanx.runtime.heal.hook import PeerFailed, StepHealth


class SharedReduction:
    """The vectors added since the last :meth:`start`, summed across the ranks in one all-reduce.

    Args:
        context: the job (:func:`phalanx.init`).

    Example::

        shared = phalanx.SharedReduction(context)
        pending = losses.compute_async(shared=shared)  # a GlobalMean's totals
        part = shared.add(torch.tensor([1.0 if stop_here else 0.0]))  # and a vector of one's own
        shared.start()  # one all-reduce for both, which runs during the next step
        ...
        means, stops = pending.result(), part.wait()
    """

    def __init__(self, context: DistributedContext) -> None:
        self.context = context
        self._batch: _Batch | None = None  # what add() puts in the next all-reduce

    @property
    def pending(self) -> bool:
        """Whether anything was added since the last start: the next :meth:`start` is a collective."""
        return self._batch is not None

    def add(self, values: torch.Tensor) -> ReducedPart:
        """Adds ``values`` (flattened, as float64 on the context's device: a copy is reduced, not
        ``values`` itself) to the next all-reduce; the part returned reads its global sum.

        Args:
            values: a tensor of any shape and dtype; every rank adds one of the same size.

        Returns:
            A :class:`~phalanx.runtime.shared_reduction.ReducedPart`: its ``wait()`` gives the sum.
        """
        batch = self._batch = self._batch or _Batch()
        # non_blocking: from pageable host memory CUDA stages the copy at once, without waiting
        # for the work queued on the device, as a blocking copy would (a sync at every vote)
        vector = values.reshape(-1).to(dtype=torch.float64, device=self.context.device, non_blocking=True)
        return ReducedPart(batch, self, batch.append(vector), vector.numel())

    def start(self) -> None:
        """Starts the all-reduce of everything added since the last start (nothing to do when
        nothing was). Call it at the step boundary, after every part was added, so that it runs
        during the next step; a part read before its start starts it then, on every rank alike."""
        batch, self._batch = self._batch, None
        if batch is not None:
            healing = self.context.healing
            batch.start(self.context.is_distributed and dist.is_initialized(), healing.health if healing else None)


class ReducedPart:
    """One vector of a :class:`SharedReduction`: its sum over every rank, once reduced."""

    def __init__(self, batch: _Batch, owner: SharedReduction, offset: int, size: int) -> None:
        self._batch, self._owner, self._offset, self._size = batch, owner, offset, size

    def wait(self) -> torch.Tensor:
        """The global sum (a view of the reduced vector); waits for the all-reduce, which a
        reduction not started yet starts first (with every other part added since its last start)."""
        if self._batch.summed is None:
            self._owner.start()
        summed = self._batch.wait()
        return summed[self._offset : self._offset + self._size]


class _Batch:
    """The parts of one all-reduce: queued until it starts, then the summed vector."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._size = 0
        self.summed: torch.Tensor | None = None  # the concatenated parts, reduced in place once started
        self._work: Any = None
        self._health: StepHealth | None = None

    def append(self, vector: torch.Tensor) -> int:
        """Queues ``vector``; returns where it starts in the summed vector."""
        offset = self._size
        self._parts.append(vector)
        self._size += vector.numel()
        return offset

    def start(self, distributed: bool, health: StepHealth | None = None) -> None:
        """Concatenates the parts and starts their all-reduce (or keeps them as they are, alone).
        With ``health`` (heal mode), a failure ends the wait with :class:`PeerFailed`."""
        self.summed = torch.cat(self._parts)  # (a copy even of one part: the caller's tensor stays as it was)
        self._parts = []
        self._health = health
        if distributed:
            self._work = dist.all_reduce(self.summed, async_op=True)

    def wait(self) -> torch.Tensor:
        """The summed vector, once its all-reduce is done."""
        assert self.summed is not None  # started: ReducedPart.wait sees to it
        if self._work is not None:
            if self._health is None:
                self._work.wait()
            elif not self._health.wait([self._work]):
                raise PeerFailed(f"the step boundary's all-reduce failed: {self._health.failure}")
            self._work = None
        return self.summed
