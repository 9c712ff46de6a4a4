"""Every network two nodes share, measured on its own: `phalanx doctor`'s networks table.

The process group runs over one interface, so the others a job could use (a data network beside
the management one) are measured over plain TCP: every node's lead listens on one private IPv4
address per subnet (the workers' where it is one), and for each pair of leads and each subnet both are on, the lower lead times round
trips and transfers to the other, one pair and network at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from phalanx.diagnostics.probes import ROUNDS, TRANSFERS, one_way
from phalanx.launch.network import local_interfaces

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


def _serve(listener: socket.socket, serving: set[socket.socket], lock: threading.Lock) -> None:
    """Answers each request on the listener's connections with one byte, until it is closed."""
    buffer = memoryview(bytearray(_CHUNK))
    header = memoryview(bytearray(_HEADER.size))
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return  # closed as the block of responding() ends
        with lock:
            serving.add(connection)
        with connection, contextlib.suppress(OSError):
            connection.settimeout(MEASURE_BOUND_S)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                _read_exactly(connection, header)
                (size,) = _HEADER.unpack(header)
                while size:
                    step = min(size, _CHUNK)
                    _read_exactly(connection, buffer[:step])
                    size -= step
                connection.sendall(b"\x01")
        with lock:
            serving.discard(connection)


@contextlib.contextmanager
def responding(prefer: str | None = None) -> Iterator[list[Attachment]]:
    """This node's attachments (``prefer``: the workers' address), each answered by a thread of
    its own while the block runs. An address it cannot listen on is left out, and all of them
    where the interfaces cannot be read: every rank still goes on to the same barriers."""
    listeners: list[socket.socket] = []
    attachments: list[Attachment] = []
    threads: list[threading.Thread] = []
    serving: set[socket.socket] = set()
    lock = threading.Lock()
    try:
        attachable = _attachable(prefer)
    except Exception:  # the other ranks wait at the gather that follows: never raise here
        attachable = []
    try:
        for network, interface, address, speed in attachable:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind((address, 0))
                listener.listen(4)
            except OSError:
                listener.close()
                continue
            listeners.append(listener)
            attachments.append(Attachment(network, interface, address, listener.getsockname()[1], speed))
            thread = threading.Thread(
                target=_serve, args=(listener, serving, lock), name=f"doctor-networks-{address}", daemon=True
            )
            thread.start()
            threads.append(thread)
        yield attachments
    finally:  # the listeners and the connections still served close: the threads end at once
        with lock:
            open_sockets = [*listeners, *serving]
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for listener in listeners:
            listener.close()
        for thread in threads:
            thread.join(timeout=1.0)


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
                round_trips.append(_send(connection, payload, 0, deadline))
            for _ in range(TRANSFERS):
                transfers.append(_send(connection, payload, size, deadline))
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


def _send(connection: socket.socket, chunk: bytes, size: int, deadline: float) -> float:
    """Seconds to send ``size`` bytes (``chunk`` again and again) and get the one-byte reply (0: a
    round trip); a TimeoutError once ``deadline`` passes, whichever call it passes in."""

    def until_deadline() -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        connection.settimeout(left)

    started = time.perf_counter()
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
    return time.perf_counter() - started
