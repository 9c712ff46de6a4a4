"""The lobby: nodes meet on the rendezvous store before torchrun's own rendezvous.

It gives a multi-node start the two things torchrun lacks: a word every ~10 s about who has
joined (and, on timeout, what a direct connect to the endpoint says), and a comparison of every
node's launch settings that stops all nodes with a table instead of forming a wrong world.

The host node creates the store as torchrun's c10d backend would (``multi_tenant=True``), so
the backend reuses this very server: one port, no window in which it is closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from phalanx.console import format_table, say
from phalanx.errors import JoinTimeout, NodesDisagree, SettingsRefused
from phalanx.launch import network
from phalanx.launch.fingerprint import differing_settings
from phalanx.launch.node_setup import NodeSetup
from phalanx.settings.values import Endpoint, parse_endpoint

PROGRESS_EVERY_S = 10.0
POLL_EVERY_S = 0.02  # store reads on an idle TCP connection are cheap; a late start is not
#: How long the host keeps the store up after a mismatch so that every node can read why.
ABORT_GRACE_S = 5.0
STORE_READ_TIMEOUT_S = 60.0
#: At least this long for the store's first answer, even when the join deadline is nearer.
STORE_ANSWER_MIN_S = 2.0


def host_store(setup: NodeSetup, endpoint: Endpoint) -> Any:
    """The job's rendezvous store on the node that hosts it (its ``port``: the endpoint's, or the
    one the system picked for port 0). torchrun's c10d backend then makes its own store on the same
    port, multi-tenant, and so shares this one.

    It listens on ``setup.store_address`` alone where the setup names one (torch's TCPStore would
    otherwise listen on every address of the host: it has no authentication), else everywhere."""
    from torch.distributed import TCPStore

    listening = None
    try:
        listening, port = _listen(setup.store_address, endpoint.port) if setup.store_address else (None, endpoint.port)
        store = TCPStore(
            endpoint.host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=STORE_READ_TIMEOUT_S), use_libuv=True,
            **({"master_listen_fd": listening} if listening is not None else {}),
        )  # fmt: skip
    except (RuntimeError, OSError) as error:  # torch raises DistNetworkError, a RuntimeError, on bind
        if listening is not None:
            with contextlib.suppress(OSError):
                os.close(listening)
        raise SettingsRefused(
            f"this host owns the endpoint {endpoint}, but cannot listen on port {endpoint.port}",
            f"{error}".splitlines()[0],
            "another job (or an old one still running) holds that port: stop it, or pick another port "
            "in --rdzv-endpoint on every node",
        ) from None
    return store


def _listen(address: str, port: int) -> tuple[int, int]:
    """A socket listening on ``address`` alone, to hand to the store as its own: its descriptor
    and its port."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds its own
        listening.bind((address, port))
        listening.listen(socket.SOMAXCONN)
        port = listening.getsockname()[1]
    except OSError:
        listening.close()
        raise
    return listening.detach(), port  # the store owns it from here


class Lobby:
    def __init__(self, setup: NodeSetup, fingerprint: dict[str, str], *, clock: Callable[[], float] = time.monotonic):
        self.setup = setup
        self.fingerprint = {"address": setup.local_addr, "label": setup.node_label, **fingerprint}
        self.endpoint = parse_endpoint(setup.rdzv_endpoint)
        self.clock = clock
        self.store: Any = None
        self.prefix = f"phalanx/{setup.rdzv_id}/"
        self._next_progress = 0.0

    # -- the store -------------------------------------------------------------------------
    def connect(self, deadline: float) -> None:
        from torch.distributed import TCPStore

        if self.setup.is_host:
            self.store = host_store(self.setup, self.endpoint)
            return
        self._wait_until_reachable(deadline)
        timeout = timedelta(seconds=STORE_READ_TIMEOUT_S)
        self.store = self._store_client(lambda: TCPStore(self.endpoint.host, self.endpoint.port, is_master=False,
                                                         timeout=timeout, use_libuv=True), deadline)  # fmt: skip

    def _store_client(self, connect: Callable[[], Any], deadline: float) -> Any:
        """The store client, within the join deadline. torch's client waits for its first answer
        without a bound: a port that accepts but is no store (an HTTP server, another service)
        would hold this node past --join-timeout, and one that answers garbage ends it with a page
        of C++ frames. The client is made in a thread of its own (torch releases the GIL while it
        waits), and whatever keeps it from answering as a store is refused here, in one message."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["store"] = connect()
            except Exception as error:
                outcome["error"] = error

        thread = threading.Thread(target=run, name="phalanx-store-connect", daemon=True)
        thread.start()
        waited = max(STORE_ANSWER_MIN_S, deadline - self.clock())
        thread.join(waited)
        if "store" in outcome:
            return outcome["store"]
        hint = (f"check that --rdzv-endpoint names the main node and a port its phalanx run listens on; on the main "
                f"node, `ss -ltnp 'sport = :{self.endpoint.port}'` shows what holds the port")  # fmt: skip
        error = outcome.get("error")
        if error is not None:  # an answer torch could not take, or a store that went away
            raise JoinTimeout(
                f"torch's store client could not use the endpoint {self.endpoint}",
                f"it said: {(str(error) or type(error).__name__).splitlines()[0]}. Either the main node's store went "
                "away, or another service holds that port.",
                hint,
            )
        raise JoinTimeout(
            f"something listens at the endpoint {self.endpoint}, but it is not a rendezvous store",
            f"it accepts connections, but gave torch's store client no store's answer in {waited:.0f} s (torch's "
            "retries, if any, are above). Another service may hold that port (an HTTP server, a database, a store of "
            "another tool).",
            hint,
        )

    def _wait_until_reachable(self, deadline: float) -> None:
        started = self.clock()
        self._next_progress = started + PROGRESS_EVERY_S
        while True:
            outcome = network.probe_tcp(
                self.endpoint.host, self.endpoint.port, timeout=min(2.0, self.setup.join_timeout)
            )
            if outcome.startswith("accepted"):
                return
            now = self.clock()
            if now >= deadline:
                raise JoinTimeout(
                    f"the endpoint {self.endpoint} did not answer within {self.setup.join_timeout:g} s",
                    f"a direct TCP connect from {self.setup.local_addr} to it: {outcome}.",
                    "start the main node (the one that owns that address) first or at the same time; check that "
                    f"port {self.endpoint.port} is open in its firewall and that the address is right",
                )
            if now >= self._next_progress:
                say(f"phalanx: waiting for the endpoint {self.endpoint} ({now - started:.0f} s): connect {outcome}")
                self._next_progress = now + PROGRESS_EVERY_S
            time.sleep(POLL_EVERY_S)  # the host may be a moment behind: poll often, report rarely

    # -- joining ---------------------------------------------------------------------------
    def join(self) -> list[dict[str, str]]:
        """Registers this node, then waits for the others; returns every node's fingerprint."""
        deadline = self.clock() + self.setup.join_timeout
        self.connect(deadline)
        index = self.store.add(self.prefix + "joined", 1) - 1
        if index >= self.setup.nnodes_max:
            raise NodesDisagree(
                f"job '{self.setup.rdzv_id}' already has its {self.setup.nnodes_max} nodes; this one would be one too many",
                f"{index + 1} nodes have tried to join the endpoint {self.endpoint}.",
                "give this node's job another --rdzv-id, or raise --nnodes on every node",
            )
        self.store.set(self._node_key(index), json.dumps(self.fingerprint))
        return self._wait_for_nodes(deadline)

    def _node_key(self, index: int) -> str:
        return f"{self.prefix}node/{index}"

    def _wait_for_nodes(self, deadline: float) -> list[dict[str, str]]:
        started = self.clock()
        self._next_progress = started + PROGRESS_EVERY_S
        seen: list[dict[str, str]] = []
        while True:
            self._raise_if_aborted()
            seen = self._read_joined(seen)
            mismatch = differing_settings(seen)
            if mismatch:
                self._abort(seen, mismatch)
            if len(seen) >= self.setup.nnodes_min:
                return seen
            now = self.clock()
            if now >= deadline:
                self._raise_join_timeout(seen)
            if now >= self._next_progress:
                names = ", ".join(fp["address"] for fp in seen)
                say(
                    f"phalanx: waiting for nodes ({now - started:.0f} s of {self.setup.join_timeout:g}): "
                    f"{len(seen)} of {self.setup.nnodes_min} joined: {names}"
                )
                self._next_progress = now + PROGRESS_EVERY_S
            time.sleep(POLL_EVERY_S)

    def _read_joined(self, seen: list[dict[str, str]]) -> list[dict[str, str]]:
        count = min(self.store.add(self.prefix + "joined", 0), self.setup.nnodes_max)
        fingerprints = list(seen)
        for index in range(len(seen), count):
            key = self._node_key(index)
            if not self.store.check([key]):
                break  # joined a moment ago, fingerprint not written yet: read it next round
            fingerprints.append(json.loads(self.store.get(key)))
        return fingerprints

    def _raise_join_timeout(self, seen: list[dict[str, str]]) -> None:
        probe = network.probe_tcp(self.endpoint.host, self.endpoint.port)
        joined = ", ".join(f"{fp['address']} ({fp['label']})" for fp in seen) or "none"
        raise JoinTimeout(
            f"only {len(seen)} of {self.setup.nnodes_min} nodes joined job '{self.setup.rdzv_id}' at {self.endpoint} "
            f"within {self.setup.join_timeout:g} s",
            f"joined: {joined}. A direct TCP connect from this node to the endpoint: {probe}.",
            f"start the same command ({self.setup.command_name}) on the missing nodes; they must reach "
            f"{self.endpoint} (try `nc -zv {self.endpoint.host} {self.endpoint.port}` there). "
            "Raise --join-timeout if nodes start slowly",
        )

    # -- disagreement ----------------------------------------------------------------------
    def _abort(self, fingerprints: list[dict[str, str]], mismatch: list[str]) -> None:
        report = {"fingerprints": fingerprints, "mismatch": mismatch}
        self.store.compare_set(self.prefix + "abort", "", json.dumps(report))
        self._raise_if_aborted()

    def _raise_if_aborted(self) -> None:
        key = self.prefix + "abort"
        if not self.store.check([key]):
            return
        report = json.loads(self.store.get(key))
        readers = self.store.add(self.prefix + "abort_seen", 1)
        if self.setup.is_host:  # keep the store up until every node has read why (bounded)
            until = self.clock() + ABORT_GRACE_S
            while readers < self.store.add(self.prefix + "joined", 0) and self.clock() < until:
                time.sleep(POLL_EVERY_S)
                readers = self.store.add(self.prefix + "abort_seen", 0)
        raise NodesDisagree(
            f"the nodes of job '{self.setup.rdzv_id}' were started with different settings; every node stops",
            mismatch_table(report["fingerprints"], report["mismatch"]),
            "start every node with the same phalanx command, the same script file and the same "
            "phalanx and torch versions",
        )


def mismatch_table(fingerprints: list[dict[str, str]], mismatch: list[str]) -> str:
    headers = ["setting", *(f"{fp['address']} ({fp['label']})" for fp in fingerprints)]
    rows = [[key, *(_short(fp.get(key, "(not set)")) for fp in fingerprints)] for key in mismatch]
    return format_table(headers, rows).lstrip()


def _short(value: str) -> str:
    return value[:12] + "..." if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else value
