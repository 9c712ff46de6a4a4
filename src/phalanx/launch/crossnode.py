"""What the node agents of one job tell each other on the rendezvous store, and the waits that
read it: keys of the whole job, and keys of one rendezvous round (docs/launch-design.md). Every
post is best effort: the store goes down with the node that hosts it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from phalanx.console import say
from phalanx.launch import failure
from phalanx.launch.restarts import raise_if_signal

#: How long the node that holds rank 0 waits for every node's row of the rank table.
GATHER_TIMEOUT_S = 30.0
#: How long a node waits for the other nodes' failure reports before naming the root cause.
FAILURE_GATHER_S = 3.0
#: How long a node whose workers failed looks for another node's word that the job ends instead
#: of restarting (agents look at their workers every 0.1 s, so it comes within a fraction of this).
ENDS_WORD_WAIT_S = 1.0
#: After this long waiting for the other nodes' workers, a node whose workers finished says so (once).
SAY_WAITING_AFTER_S = 2.0


def posted(store: Any, prefix: str, name: str) -> list[str]:
    """The lines the nodes appended to the store's key ``prefix + name``."""
    key = f"{prefix}{name}"
    return store.get(key).decode().splitlines() if store.check([key]) else []


class CrossNode:
    """One node's side of the protocol: it posts and reads under ``prefix`` for the job, and under
    the round's own prefix.

    Args:
        store: the rendezvous store, or None (a job of one node: nobody to tell).
        prefix: the job's keys' prefix (``phalanx/<rdzv id>/``).
        node: this node's label.
    """

    def __init__(self, store: Any, prefix: str, node: str) -> None:
        self.store, self.prefix, self.node = store, prefix, node
        self.round_prefix = f"{prefix}round/none/"

    def enter_round(self, name: str) -> None:
        """From now on, what this node posts and reads about the workers is round ``name``'s."""
        self.round_prefix = f"{self.prefix}round/{name}/"

    # -- posts -------------------------------------------------------------------------------
    def post_failures(self, found: list[failure.RankFailure]) -> None:
        """For the other nodes: one whose workers finished stops waiting, the failed ones name the root cause."""
        line = json.dumps([dataclasses.asdict(f) for f in found]) + "\n"
        self._best_effort(lambda: self.store.append(f"{self.round_prefix}failures", line))

    def post_finished(self) -> None:
        """That this node's workers finished: its name (read by the liveness watch and the failed
        nodes) and the count (read by the waiting nodes each poll: one number at any size)."""
        self.store.append(f"{self.round_prefix}finished", f"{self.node}\n")
        self.store.add(f"{self.round_prefix}finished_count", 1)

    def post_end_of_job(self, why: str) -> None:
        """That the job ends: without it the other nodes restart, and find the rendezvous closed."""
        self._best_effort(lambda: self.store.set(f"{self.round_prefix}ends", why))

    def post_ended(self) -> None:
        """That this node's agent ends: its silence from now on is no loss."""
        self._best_effort(lambda: self.store.append(f"{self.prefix}ended", f"{self.node}\n"))

    def post_lost(self, why: str) -> None:
        """The liveness watch's verdict, which the other nodes print before their root cause."""
        self._best_effort(lambda: self.store.append(f"{self.prefix}lost", f"{self.node}: {why}\n"))

    def _best_effort(self, post: Callable[[], object]) -> None:
        if self.store is None:
            return
        try:
            post()
        except Exception as error:  # the store may be gone with its host (a signal still goes through)
            raise_if_signal(error)

    # -- reads -------------------------------------------------------------------------------
    def posted(self, name: str) -> list[str]:
        """The lines the nodes of this round appended to the key ``name``."""
        return posted(self.store, self.round_prefix, name)

    def ended_nodes(self, store: Any) -> set[str]:
        """The nodes that said their workers finished or failed, or that they ended, read on
        ``store`` (the liveness watch reads over a connection of its own)."""
        this_round = self.round_prefix  # once: the workers' thread may enter the next round meanwhile
        said = set(posted(store, this_round, "finished")) | set(posted(store, self.prefix, "ended"))
        failed = {item["node"] for line in posted(store, this_round, "failures") for item in json.loads(line)}
        return said | failed

    def failures(self) -> list[failure.RankFailure]:
        return [failure.RankFailure.from_dict(item) for line in self.posted("failures") for item in json.loads(line)]

    def every_node_ended(self, nodes: int) -> bool:
        """Whether every one of ``nodes`` posted that its workers finished, or its failure report."""
        return len(self.posted("finished")) + len(self.posted("failures")) >= nodes

    def lost_verdicts(self, store: Any = None) -> list[str]:
        """What the nodes' liveness watches posted: "NODE: node X sent no sign of life for 30 s",
        read on ``store`` (default this node's; the liveness watch reads over its own)."""
        store = self.store if store is None else store
        if store is None:
            return []
        try:
            return posted(store, self.prefix, "lost")
        except Exception as error:
            raise_if_signal(error)
            return []

    def whose_failure(self) -> str:
        failed = self.failures()
        cause = failure.root_cause(failed)
        return f"{cause.node if cause else 'another node'}'s workers failed: {failure.in_one_line(failed)}"

    # -- waits -------------------------------------------------------------------------------
    def end_of_job_posted(self) -> str | None:
        """Another node's word that the job ends, or that its workers finished (they cannot join a
        restart: it would wait for them in vain), waiting briefly for it; or None."""
        if self.store is None:
            return None
        ends, deadline = f"{self.round_prefix}ends", time.monotonic() + ENDS_WORD_WAIT_S
        try:
            while not self.store.check([ends]):
                finished = self.posted("finished")
                if finished:
                    return f"the workers of {', '.join(finished)} already finished and cannot join a restart"
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
            return self.store.get(ends).decode()
        except Exception as error:
            raise_if_signal(error)
            return None

    def workers_finished(self, timeout: float, nodes_waiting: Callable[[], int], nodes: int, is_host: bool,
                         left: bool = False) -> bool:  # fmt: skip
        """Tells the other nodes that this node's workers finished, and waits up to ``timeout`` s
        until every one of ``nodes`` has (True: torch's exit barrier then passes at once). False
        when a node's workers failed or a node waits to restart them (it never comes to the
        barrier); the store's host (``is_host``) stays until the failed nodes could read the
        reports. Where a node ``left`` the round (heal mode, elastic), torch's barrier would wait
        for it: False once every one of ``nodes`` finished, the store's host staying until all read it."""
        if self.store is None:
            return True  # a single node: torch's barrier waits for nobody else
        started = time.monotonic()
        deadline, said_waiting = started + timeout, False
        try:
            self.post_finished()
            failures = f"{self.round_prefix}failures"
            while time.monotonic() < deadline:
                if not said_waiting and time.monotonic() - started >= SAY_WAITING_AFTER_S:
                    said_waiting = True
                    say(f"phalanx: {self.node}: its workers finished; waiting up to {timeout:g} s for the other "
                        "nodes' workers to finish")  # fmt: skip
                failed = self.store.check([failures])
                if failed or nodes_waiting() > 0:
                    why = (self.whose_failure() if failed else
                           "another node waits to restart the workers, and these cannot join it")  # fmt: skip
                    say(f"phalanx: {self.node}: its workers finished; exiting without waiting for the other nodes, "
                        f"since {why}")  # fmt: skip
                    if is_host:
                        self._keep_store_up(deadline, nodes_waiting, nodes)
                    return False
                if self.store.add(f"{self.round_prefix}finished_count", 0) >= nodes:
                    return not left or self._leave_without_torchs_barrier(deadline, nodes, is_host)
                time.sleep(0.1)
        except Exception as error:
            raise_if_signal(error)
            return True
        say(f"phalanx: {self.node}: its workers finished; the other nodes' workers did not finish within "
            f"{timeout:g} s, exiting without them")  # fmt: skip
        return False

    def _leave_without_torchs_barrier(self, deadline: float, nodes: int, is_host: bool) -> bool:
        """Every node that finished counts itself out; the store's host waits until all did."""
        key = f"{self.round_prefix}out_count"
        self.store.add(key, 1)
        while is_host and self.store.add(key, 0) < nodes and time.monotonic() < deadline:
            time.sleep(0.1)
        return False

    def _keep_store_up(self, deadline: float, nodes_waiting: Callable[[], int], nodes: int) -> None:
        """Until every node finished or posted its failures (and had the time to read the others'),
        since the store goes down with this process."""
        while time.monotonic() < deadline and nodes_waiting() == 0:  # one that waits to restart never posts
            if self.every_node_ended(nodes):
                time.sleep(FAILURE_GATHER_S)
                return
            time.sleep(0.1)

    def failures_of_other_nodes(self, found: list[failure.RankFailure], nodes: int) -> list[failure.RankFailure]:
        """Best effort: the other nodes' failure reports (this node's is posted), waiting briefly."""
        if self.store is None:
            return []
        try:
            deadline = time.monotonic() + FAILURE_GATHER_S
            while time.monotonic() < deadline and not self.every_node_ended(nodes):
                time.sleep(0.1)
            mine = {(f.node, f.rank) for f in found}
            return [f for f in self.failures() if (f.node, f.rank) not in mine]
        except Exception as error:
            raise_if_signal(error)
            return []


class NodeBoard:
    """One value per node of a rendezvous round, posted on the store under the round's prefix, and
    gathered by one node: the rank table's rows, the start's phases.

    Args:
        store: the rendezvous store.
        prefix: the round's prefix (:attr:`CrossNode.round_prefix`).
        topic: what the values are, a key's last part but one (``rank_table``).
    """

    def __init__(self, store: Any, prefix: str, topic: str) -> None:
        self.store, self.prefix, self.topic = store, prefix, topic

    def _key(self, node: int) -> str:
        return f"{self.prefix}{self.topic}/{node}"

    def post(self, node: int, value: dict[str, Any]) -> None:
        self.store.set(self._key(node), json.dumps(value))

    def gather(self, nodes: int, timeout: float = GATHER_TIMEOUT_S) -> list[dict[str, Any]] | None:
        """Every node's value, in node order, once all ``nodes`` posted; None after ``timeout``.
        One store operation a poll, however many nodes."""
        keys = [self._key(node) for node in range(nodes)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return [json.loads(value) for value in self.store.multi_get(keys)]

    def posted(self, nodes: int) -> list[dict[str, Any]]:
        """The values of the nodes (of ``nodes``) that posted theirs."""
        keys = [key for key in (self._key(node) for node in range(nodes)) if self.store.check([key])]
        return [json.loads(value) for value in self.store.multi_get(keys)] if keys else []
