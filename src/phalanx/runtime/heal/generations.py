"""The job's process group, formed again after each failure: one generation after another.

Generation 0 is the group the job started with; a survivor of a failure in generation ``g`` opens
generation ``g + 1`` on the job's store, and its members (a replacement among them) form it, each
on its own prefix of the store. Opening a generation ends the one before on every rank
(:meth:`Generations.watch`); docs/runtime-design.md has the details.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from phalanx.runtime.heal.hook import PeerFailed, StepHealth
from phalanx.worker_env import WorkerEnv

#: Keys under the job's heal prefix: the generation formed last, and "opened/G" once G is forming.
_LIVE, _OPENED = "live", "opened/"


def _proposed_key(generation: int) -> str:
    """The members proposed for a generation (by launchers that left lost nodes' ranks out)."""
    return f"g{generation}/members"


def _formed_key(generation: int) -> str:
    """The members a generation formed with, fixed once by the first rank that saw them all arrive."""
    return f"g{generation}/all"


def _arrived_key(generation: int, rank: int) -> str:
    """Rank ``rank`` of the start reached ``generation``."""
    return f"g{generation}/arrived/{rank}"


def _encode(members: list[int]) -> str:
    return ",".join(map(str, members))


def _decode(value: bytes | str) -> list[int]:
    text = value.decode() if isinstance(value, bytes) else value
    return [int(rank) for rank in text.split(",") if rank]


def _members_of(store: dist.Store, generation: int, world_size: int) -> list[int]:
    """The members of a generation that formed (generation 0's: every rank of the start)."""
    return _decode(store.get(_formed_key(generation))) if generation > 0 else list(range(world_size))


def heal_prefix(run_id: str, start: str) -> str:
    """The prefix of one start of the workers' heal keys on the launch's store: job ``run_id``
    (the rendezvous ID), start ``start`` (``WorkerEnv.start_name``, named alike on every node).
    A restart of every worker starts again at generation 0."""
    return f"phalanx/heal/{run_id}/{start}/"


def job_store(address: str | None, timeout_s: float) -> dist.Store:
    """A client of the launch's store at ``address`` (``host:port``; None: MASTER_ADDR:MASTER_PORT),
    under this start's :func:`heal_prefix`."""
    host, port = address.rsplit(":", 1) if address else (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    start = WorkerEnv.from_env(os.environ).start_name or "none"
    return dist.PrefixStore(heal_prefix(os.environ.get("TORCHELASTIC_RUN_ID", "none"), start), store)


class Leaving(NamedTuple):
    """The ranks of a lost node, which an elastic job's generation goes on without."""

    #: The ranks of the job's start.
    world_size: int
    #: The lost node's ranks.
    ranks: list[int]
    #: Whether the ranks left are enough to go on with (the job's minimum of nodes).
    enough: Callable[[list[int]], bool]


def open_for_a_lost_node(store: dist.Store, opener: str, leaving: Leaving | None = None) -> int | None:
    """Opens the generation after the live one for a node that another node's launcher found
    lost (heal mode): every rank's watch then ends its waits on the broken group, which a cut
    link would hold for the group's timeout, and the survivors form the next generation, which
    the lost node's replacements join once it is back, or, in an elastic job, without them.

    Args:
        store: the launch's store under this start's :func:`heal_prefix`.
        opener: who opened it and why, for the ranks' lines.
        leaving: an elastic job's: the lost node's ranks, which the generation goes on without
            (None: they are replaced).

    Returns:
        The generation opened (or opened already by a rank; the live one where the ranks
        ``leaving`` left it already), or None where no generation formed yet, or where the
        ranks left would be too few: the ranks cannot heal, and the launcher stops them instead.
    """
    live = live_generation(store)
    if live is None:
        return None
    while leaving is not None:
        while store.check([_formed_key(live + 1)]):  # fixed already, forming: the ranks leave it next
            live += 1
        members = _members_of(store, live, leaving.world_size)
        if not set(leaving.ranks).intersection(members):
            return live  # they left already (another launcher found the node lost first)
        if not _propose_without(store, live + 1, members, leaving):
            return None
        formed = _formed_key(live + 1)  # a rank may have fixed the generation's members meanwhile
        if not store.check([formed]) or not set(leaving.ranks).intersection(_decode(store.get(formed))):
            break
    store.compare_set(f"{_OPENED}{live + 1}", "", opener)
    return live + 1


def _propose_without(store: dist.Store, generation: int, members: list[int], leaving: Leaving) -> bool:
    """Proposes ``generation``'s members: those of the generation before (``members``) or what
    other launchers proposed already, without the ranks ``leaving`` (before the generation is
    opened: a rank that arrives reads them); False where those left would not be enough."""
    key = _proposed_key(generation)
    while True:
        current = store.get(key).decode() if store.check([key]) else ""
        kept = [rank for rank in (_decode(current) if current else members) if rank not in leaving.ranks]
        if not kept or not leaving.enough(kept):
            return False
        if store.compare_set(key, current, _encode(kept)).decode() == _encode(kept):
            return True


def live_members(store: dist.Store, world_size: int) -> list[int]:
    """The ranks of the start (of ``world_size``) in the generation the ranks formed last, less
    those a launcher proposed to leave out of the next (an elastic job's lost nodes)."""
    live = live_generation(store)
    if live is None:
        return list(range(world_size))
    proposed = _proposed_key(live + 1)
    return _decode(store.get(proposed)) if store.check([proposed]) else _members_of(store, live, world_size)


def live_generation(store: dist.Store) -> int | None:
    """The generation the ranks formed last on ``store`` (under this start's :func:`heal_prefix`),
    or None before they formed the first: they cannot heal yet."""
    return int(store.get(_LIVE)) if store.check([_LIVE]) else None


class Generations:
    """Forms the job's default process group generation after generation.

    Args:
        store: the job's heal store (:func:`job_store`).
        backend: the process group's backend.
        rank: this rank in the job's start (torch's RANK), the same in every generation.
        world_size: the ranks of the job's start (generation 0's).
        timeout_s: how long a generation may take to form (the replacement's start is in it).
    """

    #: Seconds between two looks at the store's key (and at ``stopping``) while waiting for one.
    LOOK_S = 0.2

    def __init__(self, store: dist.Store, backend: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.backend, self.start_rank = store, backend, rank
        #: The ranks of the start that form the current generation.
        self.members = list(range(world_size))
        self.timeout = timedelta(seconds=timeout_s)
        #: The generation this rank belongs to.
        self.current = 0
        #: The group the state of a heal goes over in the current generation (None in generation
        #: 0, which has no heal): a group of its own, see :mod:`.transfer`.
        self.transfer: dist.ProcessGroup | None = None
        #: Whether this rank was asked to stop (a signal): a wait for a generation ends then.
        self.stopping: Callable[[], bool] = lambda: False
        self._formed = threading.Condition()  # notified as each generation forms

    @property
    def rank(self) -> int:
        """This rank in the current generation: its place among the members."""
        return self.members.index(self.start_rank)

    @property
    def world_size(self) -> int:
        """The ranks of the current generation."""
        return len(self.members)

    def form_first(self) -> None:
        """The job's start: forms generation 0."""
        self._form(0)

    def next_after_failure(self) -> None:
        """A survivor: leaves the broken group, opens the next generation and forms it."""
        target = self.current + 1
        self.store.compare_set(f"{_OPENED}{target}", "", f"rank {self.start_rank}")
        self._leave()
        self._arrive(target)
        self._form(target)

    def join_as_replacement(self) -> None:
        """A replacement: forms the generation the survivors open after the live one."""
        live = int(self.store.get(_LIVE))
        self.members = _members_of(self.store, live, self.world_size)
        target = live + 1
        self._wait_for(f"{_OPENED}{target}", f"the surviving ranks to open generation {target} of the group")
        self._arrive(target)
        self._form(target)

    def _arrive(self, generation: int) -> None:
        """Waits until every member reached ``generation`` (before the backend's own rendezvous,
        which no signal interrupts), then takes its members: a rank left alone, or stopped, or
        left out (its node was found lost), learns it within a second. Each rank arrives under
        its own key, so a rank that arrives and dies, and its replacement, count once."""
        self.store.set(_arrived_key(generation, self.start_rank), "1")
        proposed, formed_key = _proposed_key(generation), _formed_key(generation)

        def check_member(members: list[int]) -> list[int]:
            if self.start_rank not in members:
                raise PeerFailed(f"this rank's node was found lost: generation {generation} of the group goes on "
                                 "without it")  # fmt: skip
            return members

        def formed() -> bool:
            if self.store.check([formed_key]):
                return True
            members = check_member(_decode(self.store.get(proposed)) if self.store.check([proposed]) else self.members)
            if not self.store.check([_arrived_key(generation, rank) for rank in members]):
                return False
            self.store.compare_set(formed_key, "", _encode(members))  # the first rank's fixes them
            return True

        self._wait_for(formed, f"every rank to reach generation {generation} of the group")
        self.members = check_member(_decode(self.store.get(formed_key)))

    def _wait_for(self, key: str | Callable[[], bool], what: str) -> None:
        """Waits for ``key`` on the store (or until it says True), looking at it (a blocking wait
        would hold off the signals that stop this rank, and warns at each timeout) until the
        generation's timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        done = key if callable(key) else lambda: self.store.check([key])
        while not done():
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
        """Starts this rank's watch on ``store`` (a client of its own: a wait blocks the client it
        runs on), which notes a failure when another rank opens the generation after this rank's."""
        threading.Thread(target=self._watch, args=(store, health), name="phalanx-heal-watch", daemon=True).start()

    def _watch(self, store: dist.Store, health: StepHealth) -> None:
        while True:
            current = self.current
            key = f"{_OPENED}{current + 1}"
            try:
                store.wait([key], timedelta(hours=1))  # returns at once when the key is set
            except dist.DistStoreError:
                continue  # no failure in an hour: wait again
            except Exception:
                return  # the store is gone (the launch ended): nothing to watch
            if self.current == current:
                health.note(_opened(store.get(key).decode(), current + 1))
            self.formed_after(current)

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


def _opened(opener: str, generation: int) -> PeerFailed:
    """The failure that ``opener`` (a rank, or a launcher that found a node lost) opening
    ``generation`` tells the other ranks of."""
    return PeerFailed(f"{opener} opened generation {generation} of the group: a peer failed")
