"""The job's process group, formed again after each failure: one generation after another.

Generation 0 is the group the job started with. A survivor of a failure in generation ``g``
opens generation ``g + 1`` on the job's store and forms it; a replacement rank waits for the
newest generation opened after the one it replaces died in, and forms it too. Each generation's
group rendezvouses on its own prefix of the store, so no key of a broken group is read again.

A generation opened ends the one before on every rank: each rank's watch (:class:`OpenedWatch`)
waits on the store for the next generation's key and, when another rank opens it, notes the
failure, which ends any wait of this rank on the old group (:mod:`.hook`). A rank waiting for a
peer that already left learns it so, whatever the backend can tell it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from phalanx.runtime.heal.hook import PeerFailed, StepHealth
from phalanx.worker_env import WorkerEnv

#: Keys under the job's heal prefix: the generation formed last, and "opened/G" once G is forming.
_LIVE, _OPENED = "live", "opened/"


def heal_prefix(run_id: str, attempt: int) -> str:
    """The prefix of one start of the workers' heal keys on the launch's store: job ``run_id``
    (the rendezvous ID), start ``attempt`` (counted alike on every node). A restart of every
    worker starts again at generation 0."""
    return f"phalanx/heal/{run_id}/{attempt}/"


def job_store(address: str | None, timeout_s: float) -> dist.Store:
    """A client of the launch's store at ``address`` (``host:port``; None: MASTER_ADDR:MASTER_PORT),
    under this start's :func:`heal_prefix`."""
    host, port = address.rsplit(":", 1) if address else (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    attempt = WorkerEnv.from_env(os.environ).attempt or 0
    return dist.PrefixStore(heal_prefix(os.environ.get("TORCHELASTIC_RUN_ID", "none"), attempt), store)


def open_for_a_lost_node(store: dist.Store, opener: str) -> int | None:
    """Opens the generation after the live one for a node that another node's launcher found
    lost (heal mode): every rank's watch then ends its waits on the broken group, which a cut
    link would hold for the group's timeout, and the survivors form the next generation, which
    the lost node's replacements join once it is back.

    Args:
        store: the launch's store under this start's :func:`heal_prefix`.
        opener: who opened it and why, for the ranks' lines.

    Returns:
        The generation opened (or opened already by a rank), or None where no generation formed
        yet: the ranks cannot heal, and the launcher stops them instead.
    """
    live = live_generation(store)
    if live is None:
        return None
    store.compare_set(f"{_OPENED}{live + 1}", "", opener)
    return live + 1


def live_generation(store: dist.Store) -> int | None:
    """The generation the ranks formed last on ``store`` (under this start's :func:`heal_prefix`),
    or None before they formed the first: they cannot heal yet."""
    return int(store.get(_LIVE)) if store.check([_LIVE]) else None


class Generations:
    """Forms the job's default process group generation after generation.

    Args:
        store: the job's heal store (:func:`job_store`).
        backend: the process group's backend.
        rank: this rank, the same in every generation.
        world_size: the ranks of every generation.
        timeout_s: how long a generation may take to form (the replacement's start is in it).
    """

    #: Seconds between two looks at the store's key (and at ``stopping``) while waiting for one.
    LOOK_S = 0.2

    def __init__(self, store: dist.Store, backend: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.backend, self.rank, self.world_size = store, backend, rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        #: The generation this rank belongs to.
        self.current = 0
        #: The group the state of a heal goes over in the current generation (None in generation
        #: 0, which has no heal): a group of its own, see :mod:`.transfer`.
        self.transfer: dist.ProcessGroup | None = None
        #: Whether this rank was asked to stop (a signal): a wait for a generation ends then.
        self.stopping: Callable[[], bool] = lambda: False
        self._formed = threading.Condition()  # notified as each generation forms

    def form_first(self) -> None:
        """The job's start: forms generation 0."""
        self._form(0)

    def next_after_failure(self) -> int:
        """A survivor: leaves the broken group, opens the next generation and forms it."""
        target = self.current + 1
        self.store.set(f"{_OPENED}{target}", f"rank {self.rank}")
        self._leave()
        self._arrive(target)
        self._form(target)
        return target

    def join_as_replacement(self) -> int:
        """A replacement: forms the generation the survivors open after the live one."""
        live = int(self.store.get(_LIVE))
        target = live + 1
        self._wait_for(f"{_OPENED}{target}", f"the surviving ranks to open generation {target} of the group")
        self._arrive(target)
        self._form(target)
        return target

    def _arrive(self, generation: int) -> None:
        """Waits until every rank reached ``generation`` (before the backend's own rendezvous,
        which no signal interrupts): a rank left alone, or stopped, learns it within a second."""
        if self.store.add(f"g{generation}/arrived", 1) == self.world_size:
            self.store.set(f"g{generation}/all", "1")
        self._wait_for(f"g{generation}/all", f"every rank to reach generation {generation} of the group")

    def _wait_for(self, key: str, what: str) -> None:
        """Waits for ``key`` on the store, looking at it (a blocking wait would hold off the
        signals that stop this rank, and warns at each timeout) until the generation's timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([key]):
            if self.stopping():
                raise PeerFailed(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise PeerFailed(f"waited {self.timeout.total_seconds():g} s for {what}")
            time.sleep(self.LOOK_S)

    def _leave(self) -> None:
        if dist.is_initialized():
            from phalanx.runtime.context import destroy_process_group  # (the context imports this module)

            destroy_process_group()
        self.transfer = None

    def _form(self, generation: int) -> None:
        prefix = dist.PrefixStore(f"g{generation}/", self.store)
        dist.init_process_group(self.backend, store=prefix, rank=self.rank, world_size=self.world_size,
                                timeout=self.timeout)  # fmt: skip
        # Made by every rank right after the default group, before any other of the generation's.
        self.transfer = dist.new_group(backend="gloo", timeout=self.timeout) if generation > 0 else None
        with self._formed:
            self.current = generation
            self._formed.notify_all()
        # Every rank says it, whichever of them dies next: no rank writes generation g + 1 before
        # every rank formed it, which each does only after writing g.
        self.store.set(_LIVE, str(generation))

    def watch(self, store: dist.Store, health: StepHealth) -> None:
        """Starts this rank's :class:`OpenedWatch` on ``store`` (a client of its own: a wait
        blocks the client it runs on)."""
        threading.Thread(target=OpenedWatch(self, store, health).run, name="phalanx-heal-watch", daemon=True).start()

    def note_if_next_opened(self, health: StepHealth) -> None:
        """Notes a failure in ``health`` if another rank opened the generation after this rank's
        already (its watch may have noted it before this rank's step was cleared)."""
        key = f"{_OPENED}{self.current + 1}"
        if self.store.check([key]):
            health.note(_opened(self.store.get(key).decode(), self.current + 1))

    def formed_after(self, generation: int) -> None:
        """Waits until this rank formed a generation after ``generation``."""
        with self._formed:
            self._formed.wait_for(lambda: self.current > generation)


class OpenedWatch:
    """Notes a failure when another rank opens the generation after this rank's."""

    #: Seconds of one wait on the store (it returns at once when the key is set).
    WAIT_S = 3600.0

    def __init__(self, generations: Generations, store: dist.Store, health: StepHealth) -> None:
        self.generations, self.store, self.health = generations, store, health

    def run(self) -> None:
        while True:
            current = self.generations.current
            key = f"{_OPENED}{current + 1}"
            try:
                self.store.wait([key], timedelta(seconds=self.WAIT_S))
            except dist.DistStoreError:
                continue  # no failure in an hour: wait again
            except Exception:
                return  # the store is gone (the launch ended): nothing to watch
            if self.generations.current == current:
                self.health.note(_opened(self.store.get(key).decode(), current + 1))
            self.generations.formed_after(current)


def _opened(opener: str, generation: int) -> PeerFailed:
    """The failure that ``opener`` (a rank, or a launcher that found a node lost) opening
    ``generation`` tells the other ranks of."""
    return PeerFailed(f"{opener} opened generation {generation} of the group: a peer failed")
