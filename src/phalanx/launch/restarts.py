"""torchrun's elastic agent, told not to restart workers whose failure a restart cannot mend.

With ``--max-restarts N`` torchrun restarts the workers after any failure, up to N times. After a
refusal of the settings (exit 2 in phalanx's terms) that means the same refusal N more times, and
the same wait for every start; after a stop for preemption (exit 75) it means training again on
a machine that is being taken away, until the scheduler kills it without a checkpoint. And it
restarts in silence: the console shows the new round, not which rank failed before it.

When a node's workers finish, torchrun's agent waits up to 5 minutes (its exit barrier) for
every other node's workers to finish too. A node whose workers failed never comes, nor does one
that waits in the rendezvous to restart them (the finished node will not join it). The subclass
asks ``finished`` instead, which tells the other nodes (so that none restarts for nothing:
``judge``) and returns as soon as they all finished, or one of them failed or waits to restart.

torch's launcher has no setting for either, so the agent it starts is a subclass of its own
(:class:`torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent`) that asks
before each restart and at the exit barrier, and hands each rendezvous round's store and times
to ``new_round`` (what the nodes tell each other holds for one round: :mod:`.rounds`). Everything
else (rendezvous, worker processes, logs, signals) is torch's.

The launcher finds the agent class as a name in its own module, which is swapped for the
subclass while phalanx's one agent per process starts. The alternative, building the agent as
torch's ``launch_agent`` does, would copy that function's body, which changes with every release
(from 2.8 to 2.14: a health-check server, a shutdown timeout, NUMA options, virtual local ranks):
more of torch's internals to follow, not fewer. The name is in phalanx.torch_compat's canary.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

#: Takes the failures torchrun collected (global rank -> ProcessFailure) and the restarts left;
#: returns whether to restart the workers, as torchrun would, or to end the job with the failure.
Judge = Callable[[dict[int, Any], int], bool]
#: Called when this node's workers finished, with torch's exit-barrier timeout in seconds and the
#: rendezvous's count of nodes waiting for a new round; returns whether every node's workers
#: finished (then torch's exit barrier runs, and passes at once).
Finished = Callable[[float, Callable[[], int]], bool]
#: Called after each rendezvous round, before the workers start, with the round's store and its
#: :class:`RoundTimes`.
NewRound = Callable[[Any, "RoundTimes"], None]


class RoundTimes(NamedTuple):
    """When a rendezvous round began (Unix times): ``began``, its rendezvous; ``ended``, the start
    of the last look at the workers of the round before, None in the first round. torch decides to
    restart them right after a look: one that found a worker failed (and stopped the others), or
    found a node waiting to join (then it stops them)."""

    ended: float | None
    began: float


@contextlib.contextmanager
def restarts_only_when_they_can_help(
    judge: Judge, finished: Finished, new_round: NewRound | None = None
) -> Iterator[None]:
    """Within, torch's launcher (``elastic_launch``) starts an agent that asks ``judge`` about the
    failures of every round that failed while restarts are left, and ends the job instead of
    restarting when it says no; when its workers finished, it asks ``finished``; after each
    rendezvous, it calls ``new_round`` with the round's store and :class:`RoundTimes`. It swaps the
    agent class that the launcher looks up in its module for the duration: phalanx runs one
    agent per process, so nothing else sees it."""
    from torch.distributed.launcher import api

    torch_agent = api.LocalElasticAgent

    class JudgedAgent(torch_agent):  # type: ignore[misc, valid-type]
        last_look: float | None = None

        def _rendezvous(self, worker_group: Any) -> None:
            # every round (the first, a restart's, a membership change's) comes through
            # here, and leaves the round's store (RendezvousInfo.store) in worker_group.store
            began = time.time()
            super()._rendezvous(worker_group)
            if new_round is not None:
                new_round(worker_group.store, RoundTimes(self.last_look, began))

        def _monitor_workers(self, worker_group: Any) -> Any:
            looked = time.time()  # a look that finds a worker failed also stops the others
            result = super()._monitor_workers(worker_group)
            self.last_look = looked
            # _invoke_run restarts a failed group while _remaining_restarts > 0, else returns the failure
            if result.is_failed():
                remaining = self._remaining_restarts
                if remaining > 0 and not _asks_restart(judge, result.failures, remaining):
                    self._remaining_restarts = 0
            return result

        def _exit_barrier(self) -> None:
            if finished(self._exit_barrier_timeout, self._worker_group.spec.rdzv_handler.num_nodes_waiting):
                super()._exit_barrier()

    api.LocalElasticAgent = JudgedAgent
    try:
        yield
    finally:
        api.LocalElasticAgent = torch_agent


def _asks_restart(judge: Judge, failures: dict[int, Any], remaining: int) -> bool:
    try:
        return judge(failures, remaining)
    except Exception as error:
        raise_if_signal(error)
        return True


def raise_if_signal(error: Exception) -> None:
    """torch's agent turns SIGTERM and SIGINT into an exception (``SignalException``, an
    ``Exception``) raised wherever it is waiting: a best-effort ``except Exception`` must let it
    through, or the agent goes on instead of stopping its workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if isinstance(error, SignalException):
        raise error
