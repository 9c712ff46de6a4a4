"""Every network two nodes share, measured on its own: `phalanx doctor`'s networks table.

The workers' process group runs over one interface, the one that routes to the rendezvous
endpoint unless --interface names another. A host with a management network and a data network
has a second network the job could use, and nothing measures it. The process group cannot be
moved to another interface once made, so this measures over plain TCP: every node's lead rank
listens on each of its IPv4 addresses; for each pair of leads and each subnet both have an
address on, the lower lead connects from its own address on that subnet to the other's, and
times round trips and a transfer, one pair and network at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from phalanx.diagnostics.probes import one_way
from phalanx.launch.network import local_interfaces

#: Round trips per latency figure; the median is reported.
ROUNDS = 8
#: Transfers per bandwidth figure, at most; the median is reported.
TRANSFERS = 3
#: How long a peer may take to accept a connection: a LAN answers in milliseconds, and every
#: network no pair can reach costs this for each pair, one after the other.
CONNECT_TIMEOUT_S = 1.0
#: How long one measurement (one pair on one network) may take in all, so that the ranks waiting
#: at its barrier stay far from the stall watchdog's bound: a transfer that has not ended by then
#: is stopped, and the figure is that of the transfers that ended, if any.
MEASURE_BOUND_S = 30.0
#: The largest transfer timed (--p2p-size may be larger): 16 MiB at 10 Mbit/s is 13 s.
MAX_MESSAGE_BYTES = 16 * 2**20
_HEADER = struct.Struct("!Q")  # the bytes that follow; 0 asks for a bare reply (a round trip)
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Attachment:
    """One node's address on one network, and where its lead listens there."""

    network: str  # the subnet, such as "10.1.0.0/24"
    interface: str
    address: str
    port: int
    speed_mbps: int  # as the kernel reports it; 0 unknown


@dataclass(frozen=True)
class NetworkFigure:
    """One network measured between two node leads (global ranks), or why it could not be."""

    network: str
    source: int
    target: int
    source_interface: str
    target_interface: str
    latency_s: float | None = None  # half the median round trip
    bandwidth_bytes_per_s: float | None = None  # None: unreachable, or too short to time
    error: str | None = None


def _attachable(prefer: str | None) -> list[tuple[str, str, str, int]]:
    """(network, interface, address, speed) of this host's up IPv4 addresses, one per subnet
    (``prefer`` where it is one of them: the address the workers use). Loopback, link-local and
    public addresses are left out: the probe's listeners have no authentication."""
    found: dict[str, tuple[str, str, str, int]] = {}
    for interface in local_interfaces().values():
        if not interface.is_up:
            continue
        for network in interface.networks:
            address = ipaddress.ip_interface(network)
            if address.is_loopback or address.is_link_local or address.ip.is_global:
                continue
            if str(address.network) not in found or str(address.ip) == prefer:
                found[str(address.network)] = (str(address.network), interface.name, str(address.ip),
                                               interface.speed_mbps)  # fmt: skip
    return list(found.values())


def _read_exactly(connection: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the connection; a peer that closes first is a ConnectionError."""
    got = 0
    while got < len(view):
        read = connection.recv_into(view[got:])
        if read == 0:
            raise ConnectionError("the peer closed the connection")
        got += read


def _read_header(connection: socket.socket) -> int:
    header = bytearray(_HEADER.size)
    _read_exactly(connection, memoryview(header))
    return _HEADER.unpack(header)[0]


class Responder:
    """The listening side: one thread per address, answering each request with one byte."""

    def __init__(self) -> None:
        self.attachments: list[Attachment] = []
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._serving: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self, prefer: str | None = None) -> list[Attachment]:
        """Listens on this host's addresses; the ones it could not listen on are left out (and all
        of them where the interfaces could not be read: the table then has no row for this node,
        and every rank still goes on to the same barriers)."""
        try:
            attachable = _attachable(prefer)
        except Exception:  # the other ranks wait at the gather that follows: never raise here
            return []
        for network, interface, address, speed in attachable:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind((address, 0))
                listener.listen(4)
            except OSError:
                listener.close()
                continue
            self._listeners.append(listener)
            self.attachments.append(Attachment(network, interface, address, listener.getsockname()[1], speed))
            thread = threading.Thread(
                target=self._serve, args=(listener,), name=f"doctor-networks-{address}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self.attachments

    def _serve(self, listener: socket.socket) -> None:
        buffer = memoryview(bytearray(_CHUNK))
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                self._serving.add(connection)
            with connection, contextlib.suppress(OSError):
                connection.settimeout(MEASURE_BOUND_S)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    size = _read_header(connection)
                    while size:
                        step = min(size, _CHUNK)
                        _read_exactly(connection, buffer[:step])
                        size -= step
                    connection.sendall(b"\x01")
            with self._lock:
                self._serving.discard(connection)

    def stop(self) -> None:
        """Closes the listeners and the connections still served; the threads end at once."""
        with self._lock:
            open_sockets = [*self._listeners, *self._serving]
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for listener in self._listeners:
            listener.close()
        for thread in self._threads:
            thread.join(timeout=1.0)


@contextlib.contextmanager
def responding(prefer: str | None = None) -> Iterator[list[Attachment]]:
    """This node's attachments (``prefer``: the workers' address), answered while the block runs."""
    responder = Responder()
    try:
        yield responder.start(prefer)
    finally:
        responder.stop()


def pairs_to_measure(attached: dict[int, list[Attachment]]) -> list[tuple[int, int, Attachment, Attachment]]:
    """(source lead, target lead, the source's and the target's attachment) for every pair of
    leads and every network both are on, in one order every rank computes alike. Two leads with
    the same address on a network are one host (simulated nodes): nothing to measure there."""
    leads = sorted(attached)
    plan = []
    for i, source in enumerate(leads):
        for target in leads[i + 1 :]:
            theirs = {attachment.network: attachment for attachment in attached[target]}
            own_addresses = {attachment.address for attachment in attached[source]}
            for mine in attached[source]:
                other = theirs.get(mine.network)
                if other is not None and other.address not in own_addresses:
                    plan.append((source, target, mine, other))
    return plan


def measure(source: int, target: int, mine: Attachment, theirs: Attachment, message_bytes: int) -> NetworkFigure:
    """Round trips and one-way transfers from ``mine`` to ``theirs``, over that network only,
    within :data:`MEASURE_BOUND_S`. Never raises: what went wrong is the figure's ``error``."""
    figure = NetworkFigure(mine.network, source, target, mine.interface, theirs.interface)
    deadline = time.monotonic() + MEASURE_BOUND_S
    size = min(message_bytes, MAX_MESSAGE_BYTES)
    payload = bytes(min(size, _CHUNK))
    round_trips: list[float] = []
    transfers: list[float] = []
    try:
        connection = socket.create_connection(
            (theirs.address, theirs.port), timeout=CONNECT_TIMEOUT_S, source_address=(mine.address, 0)
        )
    except Exception as error:
        return dataclasses.replace(
            figure, error=f"no connection to {theirs.address} in {CONNECT_TIMEOUT_S:g} s: {_reason(error)}"
        )
    try:
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(ROUNDS):
                round_trips.append(_timed(lambda: _send(connection, payload, 0, deadline)))
            for _ in range(TRANSFERS):
                transfers.append(_timed(lambda: _send(connection, payload, size, deadline)))
    except Exception as error:  # a figure with its error: the others wait at the barrier
        if not transfers:
            stage = "its round trips" if len(round_trips) < ROUNDS else "the first transfer"
            return dataclasses.replace(
                figure, error=f"connected to {theirs.address}, then {_reason(error)} during {stage}"
            )
    latency, bandwidth = one_way(round_trips, transfers, size)
    return dataclasses.replace(figure, latency_s=latency, bandwidth_bytes_per_s=bandwidth)


def _reason(error: Exception) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    return (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__


def _timed(action: Callable[[], None]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _send(connection: socket.socket, chunk: bytes, size: int, deadline: float) -> None:
    """``size`` bytes (``chunk`` again and again), then the one-byte reply (0: a round trip); a
    TimeoutError once ``deadline`` passes, whichever call it passes in."""

    def until_deadline() -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        connection.settimeout(left)

    until_deadline()
    connection.sendall(_HEADER.pack(size))
    left = size
    while left:
        step = min(left, len(chunk))
        until_deadline()
        connection.sendall(memoryview(chunk)[:step])
        left -= step
    until_deadline()
    _read_exactly(connection, memoryview(bytearray(1)))
