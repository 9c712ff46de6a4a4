"""The lobby: nodes meet on the rendezvous store before torchrun's own rendezvous, say who has
joined, and compare their settings (docs/launch-design.md)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from phalanx.console import format_table, say
from phalanx.errors import JoinTimeout, NodesDisagree, SettingsRefused
from phalanx.launch import name_lookup, network
from phalanx.launch.fingerprint import differing_settings
from phalanx.launch.node_setup import NodeSetup
from phalanx.launch.restarts import raise_if_signal
from phalanx.settings.values import Endpoint, parse_endpoint

PROGRESS_EVERY_S = 10.0
POLL_EVERY_S = 0.02  # store reads on an idle TCP connection are cheap; a late start is not
#: How often a node whose waiting connection failed looks for the lobby's outcome instead.
POLL_S = 0.5
#: How long the host keeps the store up after a mismatch so that every node can read why.
ABORT_GRACE_S = 5.0
STORE_READ_TIMEOUT_S = 60.0
#: At least this long for the store's first answer, even when the join deadline is nearer.
STORE_ANSWER_MIN_S = 2.0


#: Nodes the progress line names one by one; above, it counts them (each name is a store read).
NAMED_NODES = 8


def ring_after(index: int, count: int, watch: int) -> list[int]:
    """The ``watch`` nodes after node ``index`` in the ring of ``count`` nodes (never itself):
    those whose beats it watches (:mod:`phalanx.launch.liveness`)."""
    return [(index + step) % count for step in range(1, min(watch, count - 1) + 1)]


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the job's rendezvous store (libuv, as the store's host serves)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


def host_store(setup: NodeSetup, endpoint: Endpoint) -> Any:
    """The job's rendezvous store on the node that hosts it, multi-tenant: torchrun's c10d backend
    shares it. It listens on ``setup.store_address`` alone where the setup names one (the store has
    no authentication), else on every address."""
    from torch.distributed import TCPStore

    _allow_a_connection_per_node()
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


def _allow_a_connection_per_node() -> None:
    """Raises this process's limit of open files to the hard limit: the store holds up to two
    connections per node."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listen(address: str, port: int) -> tuple[int, int]:
    """A socket listening on ``address`` alone, for the store to own: its descriptor and port."""
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


class Meeting(NamedTuple):
    """What a node learns in the lobby."""

    #: The nodes that met (at least --nnodes' minimum; up to its maximum in an elastic job).
    count: int
    #: This node's place in the order of joining, from 0.
    index: int
    #: The labels of the next nodes in that order, as a ring (as many as ``join`` was asked for):
    #: the nodes this one watches (:mod:`phalanx.launch.liveness`).
    watched: list[str]


class Lobby:
    """The lobby of one node: it takes a place, compares its fingerprint with the first node's, and
    waits for the word that enough nodes agreed (docs/launch-design.md)."""

    def __init__(
        self, setup: NodeSetup, fingerprint: dict[str, str], *,
        connect: Callable[[str, int, float], Any] = store_client,
    ) -> None:  # fmt: skip
        self.setup = setup
        self.fingerprint = {"address": setup.local_addr, "label": setup.node_label, **fingerprint}
        self.endpoint = parse_endpoint(setup.rdzv_endpoint)
        self.connect_client = connect
        self.store: Any = None
        self.prefix = f"phalanx/{setup.rdzv_id}/"
        self._started = self._next_progress = 0.0

    # -- the store -------------------------------------------------------------------------
    def connect(self, deadline: float) -> None:
        if self.setup.is_host:
            self.store = host_store(self.setup, self.endpoint)
            return
        self._wait_until_reachable(deadline)
        self.store = self._store_client(
            lambda: self.connect_client(self.endpoint.host, self.endpoint.port, STORE_READ_TIMEOUT_S), deadline
        )

    def _store_client(self, connect: Callable[[], Any], deadline: float) -> Any:
        """The store client, within the join deadline: made in a thread of its own, since torch's
        client waits for its first answer without a bound (a port that accepts but is no store);
        whatever keeps it from answering as a store is refused in one message."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["store"] = connect()
            except Exception as error:
                outcome["error"] = error

        thread = threading.Thread(target=run, name="phalanx-store-connect", daemon=True)
        thread.start()
        lookups = name_lookup.Lookups(self.setup.local_addr, count=1)  # what the client waits for before it asks
        waited = max(STORE_ANSWER_MIN_S, deadline - time.monotonic())
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
        if lookups.running():  # started with the client's connect, and waiting still: so is the client
            address = self.setup.local_addr
            raise JoinTimeout(
                f"torch's store client had no answer from the endpoint {self.endpoint} in {waited:.0f} s: this "
                "node's name server did not answer either",
                f"a lookup of the name of {address}, started with the client, still waits for it; {name_lookup.WHY}",
                name_lookup.hint(address),
            )
        raise JoinTimeout(
            f"something listens at the endpoint {self.endpoint}, but it is not a rendezvous store",
            f"it accepts connections, but gave torch's store client no store's answer in {waited:.0f} s (torch's "
            "retries, if any, are above). Another service may hold that port (an HTTP server, a database, a store of "
            "another tool).",
            hint,
        )

    def _wait_until_reachable(self, deadline: float) -> None:
        started = time.monotonic()
        self._next_progress = started + PROGRESS_EVERY_S
        while True:
            outcome = network.probe_tcp(
                self.endpoint.host, self.endpoint.port, timeout=min(2.0, self.setup.join_timeout)
            )
            if outcome.startswith("accepted"):
                return
            now = time.monotonic()
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
    def join(self, watch: int = 0) -> Meeting:
        """Registers this node, compares it with the first, then waits for the lobby's outcome.

        The outcome is one key, written once (the first write wins) and obeyed by every node:
        ``met`` by the node whose agreement completed --nnodes' minimum, ``abort:<report>`` by a
        node that differs from the first, ``gave_up:<node>`` by the first node whose join timeout
        passed (the job cannot form: every node that joined gives up with it).

        Args:
            watch: how many of the next nodes in the order of joining the meeting names.
        """
        self._started = time.monotonic()
        deadline = self._started + self.setup.join_timeout
        self.connect(deadline)
        self._next_progress = time.monotonic() + PROGRESS_EVERY_S
        index = self.store.add(self.prefix + "joined", 1) - 1
        # An elastic job takes a node that comes back, or a spare: torch's rendezvous admits at
        # most MAX nodes to a round, and the others wait for a place.
        if index >= self.setup.nnodes_max and not self.setup.nnodes.is_elastic:
            raise NodesDisagree(
                f"job '{self.setup.rdzv_id}' already has its {self.setup.nnodes_max} nodes; this one would be one too many",
                f"{index + 1} nodes have tried to join the endpoint {self.endpoint}.",
                "give this node's job another --rdzv-id, or raise --nnodes on every node",
            )
        self.store.set(self._node_key(index), json.dumps(self.fingerprint))
        first = self.fingerprint if index == 0 else self._fingerprint_of(0)
        mismatch = differing_settings([first, self.fingerprint])
        if mismatch:
            report = json.dumps({"fingerprints": [first, self.fingerprint], "mismatch": mismatch})
            outcome = self._decide("abort:" + report)
            if outcome == "met":  # an elastic job that formed without this node: it alone stops
                raise self._disagreement(json.loads(report), alone=True)
        elif self.store.add(self.prefix + "agreed", 1) == self.setup.nnodes_min:
            self._decide("met")
        outcome = self._wait_for_outcome(deadline)
        if outcome != "met":
            self._end_of_lobby(outcome)
        count = min(self.store.add(self.prefix + "joined", 0), self.setup.nnodes_max)
        return Meeting(
            count, index, [self._fingerprint_of(other)["label"] for other in ring_after(index, count, watch)]
        )

    @property
    def _outcome_key(self) -> str:
        return self.prefix + "outcome"

    def _node_key(self, index: int) -> str:
        return f"{self.prefix}node/{index}"

    def _fingerprint_of(self, index: int) -> dict[str, str]:
        """Node ``index``'s fingerprint: it wrote it just after taking its place (a get waits for it)."""
        return json.loads(self.store.get(self._node_key(index)))

    def _decide(self, outcome: str) -> str:
        """Writes the lobby's outcome unless a node wrote one first; returns the one that holds."""
        return self.store.compare_set(self._outcome_key, "", outcome).decode()

    def _wait_for_outcome(self, deadline: float) -> str:
        """Waits for the lobby's outcome, saying every PROGRESS_EVERY_S how many nodes joined; at
        the deadline, decides that this node gives up (unless an outcome came first). One blocking
        wait on a connection of its own, not a poll; should that connection fail, it polls."""
        waited, failed = threading.Event(), threading.Event()

        def wait() -> None:
            try:
                waiter = self.connect_client(self.endpoint.host, self.endpoint.port, STORE_READ_TIMEOUT_S)
                waiter.wait(
                    [self._outcome_key], timedelta(seconds=max(0.1, deadline - time.monotonic()) + STORE_ANSWER_MIN_S)
                )
            except Exception:  # the deadline passed with no outcome, or the connection failed: polled below
                failed.set()
            waited.set()

        thread = threading.Thread(target=wait, name="phalanx-lobby-wait", daemon=True)
        thread.start()
        try:
            while not (waited.is_set() and not failed.is_set()):
                now = time.monotonic()
                if now >= deadline:
                    return self._decide(f"gave_up:{self.setup.node_label}")
                if failed.is_set() and self.store.check([self._outcome_key]):
                    break
                if now >= self._next_progress:
                    self._say_progress()
                    self._next_progress = now + PROGRESS_EVERY_S
                waited.wait(timeout=min(POLL_S, max(0.0, min(self._next_progress, deadline) - now)))
            return self.store.get(self._outcome_key).decode()
        except Exception as error:  # the store went away with its host
            raise_if_signal(error)
            raise JoinTimeout(
                f"the rendezvous store at {self.endpoint} went away while the nodes met",
                f"it said: {(str(error) or type(error).__name__).splitlines()[0]}. Its host's phalanx run ended "
                "(its own output says why), or its machine or network is down.",
                "see the first node's output; then start every node again",
            ) from None
        finally:
            thread.join(timeout=STORE_ANSWER_MIN_S)  # it ends with its wait: at the outcome or the deadline

    def _say_progress(self) -> None:
        joined = min(self.store.add(self.prefix + "joined", 0), self.setup.nnodes_max)
        waited = time.monotonic() - self._started
        names = f": {', '.join(fp['address'] for fp in self._joined(joined))}" if joined <= NAMED_NODES else ""
        say(f"phalanx: waiting for nodes ({waited:.0f} s of {self.setup.join_timeout:g}): "
            f"{joined} of {self.setup.nnodes_min} joined{names}")  # fmt: skip

    def _joined(self, count: int) -> list[dict[str, str]]:
        """The fingerprints of the first ``count`` nodes that joined and wrote theirs."""
        keys = [self._node_key(index) for index in range(count)]
        written = [key for key in keys if self.store.check([key])]
        return [json.loads(value) for value in self.store.multi_get(written)] if written else []

    def _raise_join_timeout(self, gave_up_first: str) -> None:
        seen = self._joined(min(self.store.add(self.prefix + "joined", 0), self.setup.nnodes_max))
        probe = network.probe_tcp(self.endpoint.host, self.endpoint.port)
        joined = ", ".join(f"{fp['address']} ({fp['label']})" for fp in seen) or "none"
        first = "" if gave_up_first == self.setup.node_label else (
            f"{gave_up_first}'s wait ended first, and the nodes that joined gave up with it. ")  # fmt: skip
        raise JoinTimeout(
            f"only {len(seen)} of {self.setup.nnodes_min} nodes joined job '{self.setup.rdzv_id}' at {self.endpoint} "
            f"within {self.setup.join_timeout:g} s",
            f"{first}joined: {joined}. A direct TCP connect from this node to the endpoint: {probe}.",
            f"start the same command ({self.setup.command_name}) on the missing nodes; they must reach "
            f"{self.endpoint} (try `nc -zv {self.endpoint.host} {self.endpoint.port}` there). "
            "Raise --join-timeout if nodes start slowly",
        )

    # -- an outcome other than met ----------------------------------------------------------
    def _end_of_lobby(self, outcome: str) -> None:
        """Raises the refusal every node gives for ``outcome`` (abort or gave_up). The store's host
        first keeps the store up until every node that joined has read it (bounded): so each node
        reads what its refusal names before it says it has read it."""
        kind, _, detail = outcome.partition(":")
        try:
            if kind == "abort":
                raise self._disagreement(json.loads(detail), alone=False)
            self._raise_join_timeout(gave_up_first=detail)
        except (NodesDisagree, JoinTimeout) as refusal:
            readers = self.store.add(self.prefix + "outcome_seen", 1)
            if self.setup.is_host:
                until = time.monotonic() + ABORT_GRACE_S
                while readers < self.store.add(self.prefix + "joined", 0) and time.monotonic() < until:
                    time.sleep(POLL_EVERY_S)
                    readers = self.store.add(self.prefix + "outcome_seen", 0)
            raise refusal from None

    def _disagreement(self, report: dict[str, Any], alone: bool) -> NodesDisagree:
        what = (f"this node's settings differ from those job '{self.setup.rdzv_id}' already runs with; it stops"
                if alone else
                f"the nodes of job '{self.setup.rdzv_id}' were started with different settings; every node stops")  # fmt: skip
        return NodesDisagree(
            what,
            mismatch_table(report["fingerprints"], report["mismatch"]),
            "start every node with the same phalanx command, the same script file and the same "
            "phalanx and torch versions",
        )


def mismatch_table(fingerprints: list[dict[str, str]], mismatch: list[str]) -> str:
    headers = ["setting", *(f"{fp['address']} ({fp['label']})" for fp in fingerprints)]
    rows = [[key, *(_short(fp.get(key, "(not set)")) for fp in fingerprints)] for key in mismatch]
    return format_table(headers, rows, indent="")


def _short(value: str) -> str:
    return value[:12] + "..." if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else value
