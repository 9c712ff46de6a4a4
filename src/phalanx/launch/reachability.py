"""Before the workers start, each node proves that its peers reach it where its workers will listen.

gloo and NCCL connect the workers to each other on the address each node advertises (the one on
the interface of GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME), not on the rendezvous endpoint. On hosts
with several networks that address can be on a network some peers cannot reach, and then
``init_process_group`` hangs until its timeout, with no word of which host or network is at fault.

So, once the lobby met, each node listens on its advertised address and connects to the listeners
of its two ring neighbours and of the first node to join (in the lobby's order): a constant number
of connects per node, and every node is reached by at least two peers. Each node posts what it saw, and
every node waits for the word that all have posted. Should any connect have failed, every node
stops with the same table (node, interface, address, peer, result) instead of a hang.

Fixed-size jobs only: an elastic job's nodes come and go, and its world forms in torch's
rendezvous, after this.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NamedTuple

from phalanx.console import format_table
from phalanx.errors import JoinTimeout, PeersUnreachable
from phalanx.launch import network
from phalanx.launch.restarts import raise_if_signal

#: How long one connect to a peer's listener may take before it counts as failed.
CONNECT_TIMEOUT_S = 3.0
#: How long a node waits for every node's results once its own are posted: each node's connects
#: take at most CONNECT_TIMEOUT_S (they run side by side), so only a node that died is later.
ALL_POSTED_WAIT_S = 30.0
#: How often the store's host looks whether every node read the table before it stops.
POLL_S = 0.05
#: Failed connects the table shows; more are counted.
TABLE_ROWS = 20


class Listener(NamedTuple):
    """Where a node's probe listener is: its label, interface, advertised address and port."""

    label: str
    interface: str
    address: str
    port: int


def worker_address(interface: str, fallback: str) -> str:
    """The address gloo binds on ``interface``: its first (IPv4 first), else ``fallback``."""
    found = network.local_interfaces().get(interface)
    return found.addresses[0] if found is not None and found.addresses else fallback


def probed_by(index: int, count: int) -> list[int]:
    """The nodes node ``index`` of ``count`` connects to: its ring neighbours and node 0, the
    first to join (each once, never itself)."""
    targets = [(index + 1) % count, (index - 1) % count, 0]
    return [target for position, target in enumerate(targets) if target != index and target not in targets[:position]]


class Reachability:
    """One node's side of the check, on the lobby's ``store`` under ``prefix`` (``phalanx/<id>/``).

    Args:
        store: the rendezvous store (a client of it).
        prefix: the job's keys' prefix.
        index: this node's place in the lobby's order of joining.
        count: the job's node count.
        label, interface, address: this node's label, and the interface and address its workers use.
        hosts_store: whether this node hosts the store (it keeps it up until all read the outcome).
    """

    def __init__(
        self, store: Any, prefix: str, index: int, count: int, label: str, interface: str, address: str,
        hosts_store: bool = False,
    ) -> None:  # fmt: skip
        self.store, self.index, self.count, self.hosts_store = store, index, count, hosts_store
        self.prefix = f"{prefix}reach/"
        self.me = Listener(label, interface, worker_address(interface, address), 0)
        self._socket: socket.socket | None = None
        self._accepting: threading.Thread | None = None

    def check(self) -> None:
        """Listens, connects to the peers, posts the results, waits for everyone's; raises
        :class:`PeersUnreachable` (every node alike) when any connect failed. At most
        CONNECT_TIMEOUT_S plus ALL_POSTED_WAIT_S."""
        self._listen()
        try:
            failed = self._probe_peers()
            self.store.set(f"{self.prefix}result/{self.index}", json.dumps(failed))
            if failed:
                self.store.add(self.prefix + "failed", len(failed))
            if self.store.add(self.prefix + "posted", 1) == self.count:
                self.store.set(self.prefix + "all_posted", "1")
            self._wait_for_all()
            if self.store.add(self.prefix + "failed", 0):
                refusal = self._refusal()
                self._until_all_read()
                raise refusal
        finally:
            self._close()

    def _until_all_read(self) -> None:
        """The store's host keeps the store up until every node read the table (bounded)."""
        readers = self.store.add(self.prefix + "read", 1)
        until = time.monotonic() + ALL_POSTED_WAIT_S
        while self.hosts_store and readers < self.count and time.monotonic() < until:
            time.sleep(POLL_S)
            readers = self.store.add(self.prefix + "read", 0)

    # -- the listener ----------------------------------------------------------------------
    def _listen(self) -> None:
        family = socket.AF_INET6 if ":" in self.me.address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.me.address, 0))
            listener.listen(64)
        except OSError as error:
            listener.close()
            raise PeersUnreachable(
                f"{self.me.label} cannot listen on {self.me.address} ({self.me.interface}), where its workers would",
                f"binding a socket there failed: {error.strerror or error}.",
                "name the interface on the network the nodes share with --interface IFNAME (ip -br addr lists them)",
            ) from None
        self._socket = listener
        self.me = self.me._replace(port=listener.getsockname()[1])
        self._accepting = threading.Thread(target=self._accept, name="phalanx-reach-listen", daemon=True)
        self._accepting.start()
        self.store.set(f"{self.prefix}listener/{self.index}", json.dumps(self.me._asdict()))

    def _accept(self) -> None:
        assert self._socket is not None
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed by _close
                return
            connection.close()

    def _close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept, which a close alone does not
            self._socket.close()
        if self._accepting is not None:
            self._accepting.join(timeout=CONNECT_TIMEOUT_S)

    # -- the peers -------------------------------------------------------------------------
    def _probe_peers(self) -> list[dict[str, object]]:
        """The failed connects of this node to its peers' listeners, as table rows."""
        targets = probed_by(self.index, self.count)
        if not targets:
            return []
        peers = [Listener(**json.loads(value)) for value in self._listeners(targets)]
        with ThreadPoolExecutor(max_workers=len(peers), thread_name_prefix="phalanx-reach") as pool:
            outcomes = list(pool.map(lambda peer: network.probe_tcp(peer.address, peer.port, CONNECT_TIMEOUT_S), peers))
        return [
            {**peer._asdict(), "peer": self.me.label, "result": outcome.split(" (")[0]}  # the words, not the why
            for peer, outcome in zip(peers, outcomes)
            if not outcome.startswith("accepted")
        ]

    def _listeners(self, targets: list[int]) -> list[bytes]:
        keys = [f"{self.prefix}listener/{target}" for target in targets]
        self._wait(keys, "listening")
        return self.store.multi_get(keys)

    def _wait(self, keys: list[str], doing: str) -> None:
        """Waits for ``keys``, at most ALL_POSTED_WAIT_S; a node that stopped answering meanwhile
        (it died, or its host went away) is said, with how many got as far as ``doing``."""
        started = time.monotonic()
        try:
            self.store.wait(keys, timedelta(seconds=ALL_POSTED_WAIT_S))
        except Exception as error:
            raise_if_signal(error)
            raise JoinTimeout(
                f"the nodes stopped answering before their workers started, while {doing}",
                f"waited {time.monotonic() - started:.0f} s; a node that joined the lobby died, or its network went "
                f"down. It said: {(str(error) or type(error).__name__).splitlines()[0]}",
                "see the other nodes' output; then start every node again",
            ) from None

    def _wait_for_all(self) -> None:
        self._wait([self.prefix + "all_posted"], "they checked that their peers reach them")

    def _refusal(self) -> PeersUnreachable:
        keys = [f"{self.prefix}result/{index}" for index in range(self.count)]
        rows = [row for value in self.store.multi_get(keys) for row in json.loads(value)]
        shown = rows[:TABLE_ROWS]
        table = format_table(
            ["node", "interface", "address", "peer", "result"],
            [[row["label"], row["interface"], f"{row['address']}:{row['port']}", row["peer"], row["result"]]
             for row in shown],
            indent="",
        )  # fmt: skip
        more = f"\n... and {len(rows) - len(shown)} more" if len(rows) > len(shown) else ""
        nodes = sorted({str(row["label"]) for row in rows})
        whose = "its" if len(nodes) == 1 else "their"
        return PeersUnreachable(
            f"peers cannot reach {', '.join(nodes)} where {whose} workers will listen",
            f"{table}{more}\ngloo and NCCL connect every pair of workers; they would wait for these connections "
            "until the process group's timeout.",
            "every node must reach every other on the interface phalanx picked (the decision block names it); "
            "name the interface on the network all nodes share with --interface IFNAME on every node, "
            "or open the network between them",
        )
