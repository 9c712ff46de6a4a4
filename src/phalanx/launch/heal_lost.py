"""Heal mode's answer to a node that the liveness watch finds lost: the ranks heal instead of
stopping (docs/launch-design.md)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from phalanx.console import say
from phalanx.exit_codes import ExitCode
from phalanx.launch.keep_request import running
from phalanx.launch.liveness import silent_node
from phalanx.launch.lobby import store_client
from phalanx.launch.node_setup import NodeSetup
from phalanx.launch.restarts import raise_if_signal
from phalanx.settings.values import parse_endpoint
from phalanx.worker_env import heal_armed_of

#: On a node cut off from the store: how long its launcher waits for the store to answer again
#: before it ends. torch's agent on that node reads its rendezvous store on every look at its
#: workers, with a 60 s timeout: a longer cut ends the node there.
STORE_BACK_BOUND_S = 60.0


class LostNodeHeal:
    """What a node's launcher does in heal mode when a node is lost.

    Args:
        setup: this node's setup.
        keep_then_kill: the launcher's stop of processes (``processes, why, unless``): its ranks
            keep their state first, and ``unless()`` may spare them.
        keep_requests: this node's ranks' keep requests, in the latest start of the workers.
    """

    def __init__(self, setup: NodeSetup, keep_then_kill: Callable[..., None],
                 keep_requests: Callable[[], list[Path]]) -> None:  # fmt: skip
        self.setup, self.keep_then_kill, self.keep_requests = setup, keep_then_kill, keep_requests
        self._waited_for: dict[str, str] = {}  # node -> why, until it beats again
        self._elastic = setup.nnodes.is_elastic
        #: An elastic job's round: its world size, and each node's ranks (None: not known).
        self._round: tuple[int, dict[str, list[int]]] | None = None

    def enter_round(self, world_size: int, ranks_of_node: dict[str, list[int]] | None) -> None:
        """An elastic job's new rendezvous round: its world size and each node's ranks (a lost
        node's ranks leave the ranks' group, which goes on without them); None where they are
        not known (a lost node then stops the workers, as without heal mode)."""
        self._round = None if ranks_of_node is None else (world_size, ranks_of_node)

    def nodes_left(self, store: Any, start: str | None) -> list[str]:
        """The nodes of an elastic job's round whose ranks left the ranks' group, found lost by
        any node's launcher (from the group's members on the store; [] where none can have)."""
        if self._round is None or store is None or start is None:
            return []
        from phalanx.runtime.heal.generations import live_members  # (torch: at a node's loss only)

        world_size, ranks_of_node = self._round
        try:
            members = set(live_members(self._heal_store(store, start), world_size))
        except Exception as error:  # the store stopped answering: as if none left
            raise_if_signal(error)
            return []
        return [node for node, ranks in ranks_of_node.items() if not members.intersection(ranks)]

    def _nodes_of(self, ranks: list[int]) -> int:
        """The nodes of the round that hold any of ``ranks``."""
        assert self._round is not None
        return sum(1 for held in self._round[1].values() if set(held).intersection(ranks))

    def _heal_store(self, store: Any, start: str) -> Any:
        import torch.distributed as dist

        from phalanx.runtime.heal.generations import heal_prefix

        return dist.PrefixStore(heal_prefix(self.setup.rdzv_id, start), store)

    def instead(self, why: str, store_lost: bool, heard: bool, store: Any, start: str | None) -> bool:
        """Heals instead of stopping the workers, where the ranks can; a liveness verdict.

        Args:
            why, store_lost, heard: the verdict (:class:`phalanx.launch.liveness.Liveness`).
            store: the launch's store (None: none yet).
            start: the workers' latest start's name (``WorkerEnv.start_name``; None: not started).

        Returns:
            False where the ranks cannot heal, and the workers are then stopped as without heal
            mode: no generation of their group formed yet; a verdict heard from another node (a
            node that heals posts none: that one stopped its workers); on the cut-off node, a
            rank whose loop cannot heal yet, or no script left (they failed on their own: the
            store's host was killed, its sockets closed). In an elastic job also: fewer nodes
            than its minimum would be left, the round's nodes are not known, or this node is
            the one cut off (it stops, and joins again when launched again).
        """
        if heard:
            return False
        if store_lost:  # (an elastic job goes on without this node: it stops, and joins again later)
            return not self._elastic and self._end_the_cut_off_scripts(why)
        if store is None or start is None or (self._elastic and self._round is None):
            return False
        from phalanx.runtime.heal.generations import Leaving, open_for_a_lost_node

        node, leaving = silent_node(why), None
        if self._round is not None:
            world_size, ranks_of_node = self._round
            if node not in ranks_of_node:
                return False
            leaving = Leaving(
                world_size, ranks_of_node[node], lambda kept: self._nodes_of(kept) >= self.setup.nnodes_min
            )
        try:
            opened = open_for_a_lost_node(self._heal_store(store, start),
                                          f"the launcher of node {self.setup.node_label} ({why})", leaving)  # fmt: skip
        except Exception as error:  # the store stopped answering meanwhile
            raise_if_signal(error)
            return False
        if opened is None:  # (in an elastic job, also: fewer nodes than its minimum would be left)
            return False
        if leaving is not None:
            say(f"phalanx: PROBLEM: {self.setup.node_label}: {why}: it is lost (its machine down, or its network cut); "
                f"heal mode in an elastic job: the other nodes' ranks keep their processes and go on without its "
                f"rank(s) {', '.join(map(str, leaving.ranks))} (numbered as at the round's start) in generation "
                f"{opened} of their group\nHINT: once it is back, run the same command on it: it joins the job in the "
                "next rendezvous round (every worker restarts then, and the job goes on from its last step)")  # fmt: skip
            return True
        self._waited_for[node] = why
        say(f"phalanx: PROBLEM: {self.setup.node_label}: {why}: it is lost (its machine down, or its network cut); "
            f"heal mode: this node's ranks keep their processes and form generation {opened} of their group with the "
            "lost node's replacements, which its launcher starts once it is back, waiting for them as long as the "
            "group's timeout\nHINT: if that node does not come back, the ranks keep the state after their last step "
            "and the job ends (a restart would wait for that node): run the same command again once it is back")  # fmt: skip
        return True

    def back(self, node: str) -> None:
        """``node``, found lost, beats again: a restart would not wait for it."""
        self._waited_for.pop(node, None)

    def waited_for(self) -> str | None:
        """Why a node whose ranks the others wait for was found lost, while it has not beaten again."""
        found = list(self._waited_for.values())  # one call: the liveness thread may change it meanwhile
        return found[0] if found else None

    def _end_the_cut_off_scripts(self, why: str) -> bool:
        """On the node that lost the store: its scripts ended for replacements, unless the store
        answers again by then."""
        # the workers torch's agent started are the supervisors; each runs its script as a child
        scripts = [script for worker in psutil.Process().children() if running(worker)
                   for script in worker.children() if running(script)]  # fmt: skip
        if not scripts or not all(heal_armed_of(request).exists() for request in self.keep_requests()):
            return False
        scripts += [process for script in scripts for process in script.children(recursive=True)]
        say(f"phalanx: PROBLEM: {self.setup.node_label}: {why}: this node is cut off from the others, or the store's "
            "host is lost; heal mode: ending this node's scripts, whose replacements join the other ranks once the store "
            "answers again\nHINT: if the network does not come back, stop the job and run the same command on every "
            "node: a phalanx.Run script resumes after the last step its ranks kept")  # fmt: skip
        self.keep_then_kill(scripts, f"{why}, so its launcher ended this rank for a replacement",
                            unless=self._the_store_answers)  # fmt: skip
        self._wait_for_the_store()
        return True

    def _the_store_answers(self) -> bool:
        """Whether the store answers within a second: a cut that ended before this node's scripts
        were ended, whose ranks then heal with the others as they are."""
        if not self._store_answers_within(1.0):
            return False
        say(f"phalanx: {self.setup.node_label}: the store answers again: this node's ranks heal with the others as "
            "they are")  # fmt: skip
        return True

    def _wait_for_the_store(self) -> None:
        """Waits until the store answers again, at most :data:`STORE_BACK_BOUND_S`, else ends this
        process as without heal mode (the store's host may be down for good)."""
        if not self._store_answers_within(STORE_BACK_BOUND_S):
            say(f"phalanx: {self.setup.node_label}: the store's host {self.setup.rdzv_endpoint} did not answer for "
                f"{STORE_BACK_BOUND_S:g} s more: ending this node")  # fmt: skip
            sys.stdout.flush()
            os._exit(ExitCode.FAILED)
        say(f"phalanx: {self.setup.node_label}: the store answers again: this node's replacements join the other ranks")

    def _store_answers_within(self, seconds: float) -> bool:
        endpoint = parse_endpoint(self.setup.rdzv_endpoint)
        try:
            store_client(endpoint.host, endpoint.port, seconds)
        except Exception as error:
            raise_if_signal(error)
            return False
        return True
