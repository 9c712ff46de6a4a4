"""Before the workers start, each node proves that its ring neighbours reach it where its workers
will listen (docs/launch-design.md)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NamedTuple

from phalanx.console import format_table
from phalanx.errors import JoinTimeout, PeersUnreachable, PhalanxError
from phalanx.launch import network
from phalanx.launch.restarts import raise_if_signal

#: How long one connect to a peer's listener may take before it counts as failed.
CONNECT_TIMEOUT_S = 3.0
#: The bound of the whole check from its start. The nodes met (in the lobby, or in a rendezvous
#: round) a moment before, so they post within a fraction of it; only a node that died meanwhile
#: makes the others wait it out.
CHECK_BOUND_S = 30.0
#: How long the store's host keeps the store up after a refusal, until every node read it.
READ_GRACE_S = 5.0
#: How often the store's host looks whether every node read the refusal.
POLL_S = 0.05
#: Failed connects the table shows, and unreachable nodes the first line names; more are counted.
TABLE_ROWS = 20
NAMED_NODES = 8


class Listener(NamedTuple):
    """Where a node's probe listener is: the node's place and label, the workers' interface, its
    address, and the listener's port (0: the node is not checked, or could not listen)."""

    index: int
    label: str
    interface: str
    address: str
    port: int

    @property
    def where(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def interface_variables(backend: str) -> list[str]:
    """The variables that name the interface the workers' sockets bind, in the order they are
    read: the backend's, then gloo's (phalanx's own groups, such as the checkpoint's, are gloo's
    also under nccl)."""
    gloo = network.INTERFACE_VARIABLE["gloo"]
    return list(dict.fromkeys([network.INTERFACE_VARIABLE.get(backend, gloo), gloo]))


def workers_interface(backend: str, environ: Mapping[str, str]) -> str | None:
    """The one interface the workers' sockets bind, from :func:`interface_variables` as phalanx
    set or kept them. None where none names a single interface of this host: a list
    (``eth0,eth1``), NCCL's ``^``/``=`` forms, a name this host lacks."""
    interfaces = network.local_interfaces()
    for variable in interface_variables(backend):
        value = environ.get(variable, "")
        if value and not any(mark in value for mark in ",^=") and value in interfaces:
            return value
    return None


def neighbours(index: int, count: int) -> list[int]:
    """The nodes node ``index`` of ``count`` connects to: the next and the previous in the ring
    (one node when there are two, none when alone)."""
    return sorted({(index + 1) % count, (index - 1) % count} - {index})


class Reachability:
    """One node's side of the check, on the lobby's ``store`` under ``prefix``.

    Args:
        store: the rendezvous store (a client of it).
        prefix: the check's keys' prefix: the job's (``phalanx/<id>/``), or an elastic job's
            round's.
        index: this node's place among the nodes checked: in the lobby's order of joining, or
            its node rank (GROUP_RANK) in the round.
        count: the nodes checked: the job's, or the round's.
        label: this node's label.
        interface: the interface the workers bind (:func:`workers_interface`); None: this node
            takes part, but is not checked.
        hosts_store: whether this node hosts the store (it keeps it up until all read a refusal).
    """

    def __init__(
        self, store: Any, prefix: str, index: int, count: int, label: str, interface: str | None,
        hosts_store: bool = False,
    ) -> None:  # fmt: skip
        self.store, self.index, self.count, self.hosts_store = store, index, count, hosts_store
        self.prefix = f"{prefix}reach/"
        found = network.local_interfaces().get(interface) if interface else None
        address = found.addresses[0] if found is not None and found.addresses else ""  # gloo's: the first
        self.me = Listener(index, label, interface or "", address, 0)
        self._socket: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._deadline = 0.0

    def check(self) -> None:
        """Listens, connects to the neighbours, posts the failures, reads the outcome: returns when
        every connect of every node succeeded, within about CHECK_BOUND_S. Raises
        :class:`PeersUnreachable` (on every node) when one failed, :class:`JoinTimeout` when a
        node's wait ended first or the store went away."""
        self._deadline = time.monotonic() + CHECK_BOUND_S
        try:
            outcome = self._run()
        except PhalanxError:
            raise
        except Exception as error:  # the store went away (its host ended)
            raise_if_signal(error)
            raise _stopped_answering(str(error) or type(error).__name__) from None
        finally:
            self._close()
        if "gave_up" in outcome:
            raise _stopped_answering(f"{outcome['gave_up']}'s wait ended first, {outcome['posted']} of "
                                     f"{self.count} nodes had checked their neighbours")  # fmt: skip
        if outcome:
            refusal = _refusal(outcome)
            with contextlib.suppress(Exception):  # best effort: the store's host may have left already
                self._until_all_read()
            raise refusal

    def _run(self) -> dict[str, Any]:
        failed = self._listen()
        if self.me.port:  # a node that cannot listen has its own row; one not checked connects to none
            failed = self._probe_neighbours()
            if failed is None:
                return self._give_up()
        self.store.set(f"{self.prefix}result/{self.index}", json.dumps(failed))
        if failed:
            self.store.add(self.prefix + "failed", len(failed))
        if self.store.add(self.prefix + "posted", 1) == self.count:
            return self._decide(self._outcome())
        if self._wait([self.prefix + "outcome"], self._deadline):
            return json.loads(self.store.get(self.prefix + "outcome"))
        return self._give_up()

    def _give_up(self) -> dict[str, Any]:
        return self._decide({"gave_up": self.me.label, "posted": self.store.add(self.prefix + "posted", 0)})

    # -- the listener ----------------------------------------------------------------------
    def _listen(self) -> list[dict[str, Any]]:
        """Listens where the workers will, and posts where; returns this node's own failure (a
        row of the table) when it cannot."""
        failure = self._open_listener() if self.me.interface else ""  # not checked: posted with port 0
        self.store.set(f"{self.prefix}listener/{self.index}", json.dumps(self.me._asdict()))
        if failure:
            return [{**self.me._asdict(), "from": self.me.label, "result": failure}]
        return []

    def _open_listener(self) -> str:
        """Listens on the workers' address; returns why it cannot, or ""."""
        if not self.me.address:
            return "cannot listen: the interface has no address"
        family = socket.AF_INET6 if ":" in self.me.address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.me.address, 0))
            listener.listen(socket.SOMAXCONN)
        except OSError as error:
            listener.close()
            return f"cannot listen: {error.strerror or error}"
        self._socket = listener
        self.me = self.me._replace(port=listener.getsockname()[1])
        self._accepting = threading.Thread(target=self._accept, name="phalanx-reach-listen", daemon=True)
        self._accepting.start()
        return ""

    def _accept(self) -> None:
        assert self._socket is not None
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # shut down by _close
                return
            connection.close()

    def _close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept, which a close alone does not
            self._socket.close()
        if self._accepting is not None:
            self._accepting.join(timeout=CONNECT_TIMEOUT_S)

    # -- the neighbours --------------------------------------------------------------------
    def _probe_neighbours(self) -> list[dict[str, Any]] | None:
        """This node's failed connects to its neighbours' listeners, as rows of the table; None
        when a neighbour did not post its listener in time (the connects must end by the deadline)."""
        targets = neighbours(self.index, self.count)
        if not targets:
            return []
        keys = [f"{self.prefix}listener/{target}" for target in targets]
        if not self._wait(keys, self._deadline - CONNECT_TIMEOUT_S):
            return None
        peers = [Listener(**json.loads(value)) for value in self.store.multi_get(keys)]
        peers = [peer for peer in peers if peer.port]  # one that could not listen said so itself
        if not peers:
            return []
        with ThreadPoolExecutor(max_workers=len(peers), thread_name_prefix="phalanx-reach") as pool:
            outcomes = list(pool.map(lambda peer: network.probe_tcp(peer.address, peer.port, CONNECT_TIMEOUT_S), peers))
        return [
            {**peer._asdict(), "from": self.me.label, "result": outcome.split(" (")[0]}  # the words, not the why
            for peer, outcome in zip(peers, outcomes)
            if not outcome.startswith("accepted")
        ]

    # -- the outcome -----------------------------------------------------------------------
    def _outcome(self) -> dict[str, Any]:
        """The outcome of the last node to post: {} when no connect failed, else the first
        TABLE_ROWS failures, their count and the unreachable nodes (in the lobby's order)."""
        if not self.store.add(self.prefix + "failed", 0):
            return {}
        keys = [f"{self.prefix}result/{index}" for index in range(self.count)]
        rows = sorted((row for value in self.store.multi_get(keys) for row in json.loads(value)),
                      key=lambda row: (row["index"], row["from"]))  # fmt: skip
        unreachable = list(dict.fromkeys(row["label"] for row in rows))
        return {"rows": rows[:TABLE_ROWS], "failed": len(rows), "nodes": unreachable}

    def _decide(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """Writes the outcome unless a node wrote one first; returns the one that holds."""
        return json.loads(self.store.compare_set(self.prefix + "outcome", "", json.dumps(outcome)))

    def _wait(self, keys: list[str], until: float) -> bool:
        """Whether ``keys`` were written before ``until`` (a monotonic time)."""
        try:
            self.store.wait(keys, timedelta(seconds=max(0.1, until - time.monotonic())))
            return True
        except Exception as error:  # torch raises its DistStoreError at the timeout
            raise_if_signal(error)
            if time.monotonic() < until:
                raise  # not the timeout: the store went away
            return False

    def _until_all_read(self) -> None:
        """The store's host keeps the store up until every node read the refusal (bounded)."""
        readers = self.store.add(self.prefix + "read", 1)
        until = time.monotonic() + READ_GRACE_S
        while self.hosts_store and readers < self.count and time.monotonic() < until:
            time.sleep(POLL_S)
            readers = self.store.add(self.prefix + "read", 0)


def _stopped_answering(said: str) -> JoinTimeout:
    return JoinTimeout(
        "the nodes stopped answering before their workers started, while they checked that their neighbours reach them",
        f"a node that joined the lobby died, or the store's host went away: {said.splitlines()[0]}.",
        "see the other nodes' output; then start every node again",
    )


def _refusal(outcome: dict[str, Any]) -> PeersUnreachable:
    rows, nodes = outcome["rows"], outcome["nodes"]
    table = format_table(
        ["node", "interface", "address", "from", "result"],
        [[row["label"], row["interface"] or "-", Listener(**{k: row[k] for k in Listener._fields}).where
          if row["port"] else row["address"] or "-", row["from"], row["result"]] for row in rows],
        indent="",
    )  # fmt: skip
    more = f"\n... and {outcome['failed'] - len(rows)} more failed connects" if outcome["failed"] > len(rows) else ""
    named = ", ".join(nodes[:NAMED_NODES]) + (
        f" and {len(nodes) - NAMED_NODES} more" if len(nodes) > NAMED_NODES else ""
    )
    whose = "its" if len(nodes) == 1 else "their"
    return PeersUnreachable(
        f"peers cannot reach {named} where {whose} workers will listen",
        f"{table}{more}\n(node: whose workers would listen at the address; from: the node that tried to connect.) "
        "gloo and NCCL connect every pair of workers; they would wait for these connections until the process "
        "group's timeout.",
        "every node must reach every other on the workers' interface (the decision block names it): name the "
        "interface on the network all nodes share with --interface IFNAME on every node (a GLOO_SOCKET_IFNAME or "
        "NCCL_SOCKET_IFNAME set in the environment is kept and overrides it), or open the network between them",
    )
