"""Heal mode's collectives: a failure is noted, never raised mid-step, and ends every wait on the group.

gloo cannot abort a collective in progress, so no heal-mode wait blocks in the backend: each waits
on an event that the work's completion sets, and that a noted failure sets too.
"""

from __future__ import annotations

import itertools
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class PeerFailed(RuntimeError):
    """A collective of the job's group cannot complete: a rank failed (heal mode heals it)."""


def raised_by_a_collective(error: BaseException) -> bool:
    """Whether ``error`` came out of a torch.distributed collective (gloo says a peer's failure
    with a plain RuntimeError), rather than from this rank's own code (an out-of-memory error,
    a bug in a ``state_dict()``), which a heal would not mend."""
    if isinstance(error, (PeerFailed, dist.DistError)):
        return True
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return trace is not None and trace.tb_frame.f_globals.get("__name__") == dist.distributed_c10d.__name__


class StepHealth:
    """Whether the step in progress failed, and the waits on the group that a failure ends."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._on_failure: dict[int, Callable[[], None]] = {}  # the pending waits' ends, by token
        self._tokens = itertools.count()

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def note(self, error: BaseException) -> None:
        """A failure (from any thread): every wait on the group ends. The failure is kept for
        what it says, without its traceback, whose frames would hold the broken group's works."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error.with_traceback(None)
            ending, self._on_failure = self._on_failure, {}
        for end in ending.values():
            end()

    def clear(self) -> None:
        """A new generation of the group formed: the next step starts healthy."""
        with self._lock:
            self.failure = None

    def wait(self, works: Sequence[Any]) -> bool:
        """Waits for ``works`` (async collectives); False as soon as the step failed."""
        done = threading.Event()
        left = [len(works)]

        def one_done(future: torch.futures.Future[Any]) -> None:
            try:
                future.value()
            except Exception as error:
                self.note(error)
            with self._lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        token = self._until_failure(done.set)
        if token is None:
            return False
        for work in works:
            _future_of(work).add_done_callback(one_done)
        if works:
            done.wait()
        self._forget(token)
        return not self.failed

    def settle(self, result: torch.futures.Future[torch.Tensor], value: torch.Tensor) -> None:
        """Completes ``result`` with ``value`` unless it is complete already (from any thread)."""
        with self._lock:
            if not result.done():
                result.set_result(value)

    def _until_failure(self, end: Callable[[], None]) -> int | None:
        """Calls ``end`` at the next failure, until forgotten (its token returned); None, and
        nothing registered, if the step failed already."""
        with self._lock:
            if self.failure is not None:
                return None
            token = next(self._tokens)
            self._on_failure[token] = end
            return token

    def _forget(self, token: int) -> None:
        with self._lock:
            self._on_failure.pop(token, None)


def all_reduce_or_note(health, bucket):  # type: ignore[no-untyped-def]  # no annotations: DDP refuses a hook whose annotations are strings
    """A DDP communication hook: the bucket's mean over the job's current default group.

    A failure is noted in ``health`` and the bucket comes back as it was: the backward finishes,
    and the step's optimizer step is skipped. Once the step failed, no bucket is sent.
    """
    buffer = bucket.buffer()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    token = None
    if not health.failed:
        sent = buffer / dist.get_world_size()  # a copy: a work left behind never writes into DDP's bucket
        try:
            work = dist.all_reduce(sent, async_op=True)
        except Exception as error:  # the group is gone already
            health.note(error)
        else:
            token = health._until_failure(lambda: health.settle(result, buffer))
    if token is None:  # the step failed: the bucket comes back as it was
        result.set_result(buffer)
        return result

    def done(future: torch.futures.Future[list[torch.Tensor]]) -> None:
        try:
            future.value()
        except Exception as error:
            health.note(error)  # settles the result with the bucket as it was
            return
        health._forget(token)
        health.settle(result, sent)

    work.get_future().add_done_callback(done)
    return result


def share_buffers(module: torch.nn.Module, health: StepHealth) -> None:
    """Rank 0's buffers (BatchNorm's statistics) to every rank, as DDP's own broadcast gives them
    at a forward; a failure is noted, and the step goes on to be skipped."""
    if health.failed:
        return
    buffers = list(module.buffers())
    rank_0 = dist.get_rank() == 0
    copies = [buffer if rank_0 else torch.empty_like(buffer) for buffer in buffers]  # received into copies
    try:
        works = [dist.broadcast(copy, src=0, async_op=True) for copy in copies]
    except Exception as error:
        health.note(error)
        return
    if health.wait(works) and not rank_0:
        with torch.no_grad():
            for buffer, copy in zip(buffers, copies, strict=True):
                buffer.copy_(copy)


def skip_failed_steps(optimizer: torch.optim.Optimizer, health: StepHealth) -> None:
    """Makes ``optimizer.step()`` do nothing while the step in progress failed: its gradients
    are not the job's. The instance's ``step`` is wrapped as a bound method, as torch's LR
    schedulers wrap it (they read ``step.__func__``)."""
    step = optimizer.step

    def guarded(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if health.failed:
            return None
        return step(*args, **kwargs)

    optimizer.step = types.MethodType(guarded, optimizer)  # type: ignore[method-assign]


def _future_of(work: Any) -> torch.futures.Future[Any]:
    """A work's future. Gloo's sends and receives have none (torch 2.13): a thread waits for
    one instead (one whose peer died waits until the group's timeout, or ends with the process:
    a failed heal exits)."""
    try:
        return work.get_future()
    except RuntimeError:
        future: torch.futures.Future[Any] = torch.futures.Future()

        def wait_for_it() -> None:
            try:
                work.wait()
            except Exception as error:
                future.set_exception(error.with_traceback(None))  # (see StepHealth.note)
            else:
                future.set_result(None)

        threading.Thread(target=wait_for_it, name="phalanx-heal-transfer", daemon=True).start()
        return future
