"""torchrun's elastic agent, told not to restart workers whose failure a restart cannot mend, and
not to wait at its exit barrier for nodes that never come (docs/launch-design.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

#: (failures by global rank, restarts left) -> whether to restart the workers.
Judge = Callable[[dict[int, Any], int], bool]
#: (exit-barrier timeout, count of nodes waiting for a new round) -> whether every node's workers
#: finished (then torch's exit barrier runs, and passes at once).
Finished = Callable[[float, Callable[[], int]], bool]
#: Called after each rendezvous round, before the workers start: (the round's store, its times).
NewRound = Callable[[Any, "RoundTimes"], None]


class RoundTimes(NamedTuple):
    """When a rendezvous round began (Unix times): ``began``, its rendezvous; ``ended``, the start
    of the last look at the round before's workers (the look after which torch restarts them),
    None in the first round."""

    ended: float | None
    began: float


@contextlib.contextmanager
def restarts_only_when_they_can_help(judge: Judge, finished: Finished, new_round: NewRound) -> Iterator[None]:
    """Within, torch's launcher (``elastic_launch``) starts an agent that asks ``judge`` before
    each restart, ``finished`` at its exit barrier, and calls ``new_round`` after each rendezvous
    (by swapping the agent class in the launcher's module: phalanx runs one agent per process)."""
    from torch.distributed.launcher import api

    torch_agent = api.LocalElasticAgent

    class JudgedAgent(torch_agent):  # type: ignore[misc, valid-type]
        last_look: float | None = None

        def _rendezvous(self, worker_group: Any) -> None:
            # every round (the first, a restart's, a membership change's) comes through
            # here, and leaves the round's store (RendezvousInfo.store) in worker_group.store
            began = time.time()
            super()._rendezvous(worker_group)
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
