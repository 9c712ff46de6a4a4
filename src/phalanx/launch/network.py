"""Which local address and interface reach the rendezvous endpoint, and whether this host is it:
asked of the kernel, not guessed from the hostname."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psutil

from phalanx.console import say
from phalanx.errors import JoinTimeout, SettingsRefused
from phalanx.settings.values import Endpoint

#: The variable that names the interface the workers bind, per backend.
INTERFACE_VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
INTERFACE_VARIABLES = tuple(INTERFACE_VARIABLE.values())


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]  # IPv4 first, then IPv6 (link-local left out)
    is_up: bool
    #: The link's speed in Mb/s as the kernel reports it (0: unknown).
    speed_mbps: int = 0
    #: A software interface (a bridge, veth, tun, docker0...) rather than a network card, a bond
    #: of cards or a VLAN on one: its speed says nothing of a network's.
    is_virtual: bool = False
    #: Its IPv4 addresses with their subnet's prefix length, such as ``10.1.0.2/24``.
    networks: tuple[str, ...] = ()

    @property
    def is_loopback(self) -> bool:
        return any(ipaddress.ip_address(address).is_loopback for address in self.addresses)


@dataclass(frozen=True)
class NetworkChoice:
    """What this node uses: who hosts the store, the address it advertises, its interface."""

    endpoint: Endpoint  # as given, port resolved
    endpoint_ip: str
    is_host: bool
    local_addr: str
    interface: str
    reason: str  # one phrase: why this address and interface
    #: Where the store listens when this node hosts it: that one address, or None for every address.
    store_address: str | None = None
    #: The loopback address this host's name resolves to (the /etc/hosts trap), or None.
    hostname_loopback: str | None = None


def local_interfaces() -> dict[str, Interface]:
    stats = psutil.net_if_stats()
    interfaces = {}
    for name, entries in psutil.net_if_addrs().items():
        v4_entries = [entry for entry in entries if entry.family == socket.AF_INET]
        v4 = [entry.address for entry in v4_entries]
        networks = tuple(str(ipaddress.ip_interface(f"{e.address}/{e.netmask or '32'}")) for e in v4_entries)
        v6 = [
            entry.address.split("%")[0]
            for entry in entries
            if entry.family == socket.AF_INET6 and not ipaddress.ip_address(entry.address.split("%")[0]).is_link_local
        ]
        up = stats[name].isup if name in stats else False
        speed = max(stats[name].speed, 0) if name in stats else 0
        interfaces[name] = Interface(name, tuple(v4 + v6), up, speed, _is_virtual(name), networks)
    return interfaces


def _is_virtual(name: str) -> bool:
    """Whether the kernel lists ``name`` as a software interface that is no bond or VLAN (those
    are virtual in sysfs too, but carry a card's traffic)."""
    if not Path(f"/sys/devices/virtual/net/{name}").exists():
        return False
    return not (Path(f"/sys/class/net/{name}/bonding").exists() or Path(f"/proc/net/vlan/{name}").exists())


def faster_interface(chosen: str, interfaces: dict[str, Interface]) -> Interface | None:
    """The fastest up, addressed, non-loopback network card (or bond, or VLAN) that is faster than
    ``chosen`` (both speeds known), or None: a data network beside the one that routes to the
    endpoint. Software interfaces are left out: a bridge reports its fastest port's speed."""
    slow = interfaces.get(chosen)
    if slow is None or slow.speed_mbps <= 0:
        return None
    faster = [i for i in interfaces.values()
              if i.is_up and i.addresses and not i.is_loopback and not i.is_virtual and i.speed_mbps > slow.speed_mbps]  # fmt: skip
    return max(faster, key=lambda interface: interface.speed_mbps, default=None)


def speed_text(mbps: int | None) -> str:
    """``100 Gbit/s``, ``1 Gbit/s``, ``100 Mbit/s``; ``unknown`` for None or 0."""
    if not mbps:  # None, or the 0 of an interface whose speed the kernel does not know
        return "unknown"
    return f"{mbps / 1000:g} Gbit/s" if mbps >= 1000 else f"{mbps} Mbit/s"


def interface_owning(address: str, interfaces: dict[str, Interface]) -> Interface | None:
    wanted = ipaddress.ip_address(address)
    for interface in interfaces.values():
        if any(ipaddress.ip_address(own) == wanted for own in interface.addresses):
            return interface
    if wanted.is_loopback:  # all of 127.0.0.0/8 is routed to the loopback interface on Linux
        return next((interface for interface in interfaces.values() if interface.is_loopback), None)
    return None


#: While a host name does not resolve yet (Kubernetes adds a pod's name once it is scheduled),
#: how often to try again, and to say so.
RESOLVE_RETRY_S = 1.0
RESOLVE_PROGRESS_EVERY_S = 10.0


def resolve_host(host: str, *, wait_s: float = 0.0, what: str | None = None, needed: str | None = None) -> str:
    """The host's address, IPv4 preferred. Refused at once when it does not resolve, unless
    ``wait_s``: then tried again every second (a join timeout after that). ``what`` names the host
    in a refusal (default: the --rdzv-endpoint flag), ``needed`` why its address is needed
    (default: every node looks up the endpoint's name)."""
    started = time.monotonic()
    next_word = started + RESOLVE_PROGRESS_EVERY_S
    while True:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            break
        except socket.gaierror as error:
            waited = time.monotonic() - started
            if waited >= wait_s:
                _refuse_unresolved(what or f"--rdzv-endpoint host {host!r}", error.strerror, wait_s, needed)
            if time.monotonic() >= next_word:
                say(f"phalanx: waiting for the endpoint's name {host!r} to resolve ({waited:.0f} s of {wait_s:g}): "
                    f"{error.strerror}")  # fmt: skip
                next_word += RESOLVE_PROGRESS_EVERY_S
            time.sleep(RESOLVE_RETRY_S)
    addresses = [info[4][0] for info in infos]
    return next((a for a in addresses if ":" not in a), addresses[0])


def _refuse_unresolved(what: str, why: str, waited_s: float, needed: str | None) -> NoReturn:
    if waited_s > 0:
        raise JoinTimeout(
            f"{what} did not resolve within {waited_s:g} s ({why})",
            "phalanx waited since the name may appear late: on Kubernetes a pod's DNS name appears once the pod "
            "is scheduled, so the first pod may be pending, or its headless Service missing.",
            "on Kubernetes, check the first pod (kubectl get pods) and that the Service exists with "
            "publishNotReadyAddresses: true; elsewhere, check the name; raise --join-timeout if nodes start slowly",
        )
    if needed is not None:
        raise SettingsRefused(f"{what} does not resolve to an address ({why})", needed,
                              "add the nodes' names to /etc/hosts or DNS, or name the interface with --interface IFNAME")  # fmt: skip
    raise SettingsRefused(
        f"{what} does not resolve to an address ({why})",
        "every node must be able to look up the endpoint's name.",
        "use the main node's IP address, or add the name to /etc/hosts or DNS",
    )


def route_source_address(ip: str, port: int) -> str:
    """The local address the kernel would use to reach ``ip`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port))
        return probe.getsockname()[0]


def hostname_loopback_address() -> str | None:
    """The trap: the loopback address this host's name resolves to, or None when it does not."""
    try:
        address = socket.gethostbyname(socket.gethostname())
        return address if ipaddress.ip_address(address).is_loopback else None
    except (OSError, ValueError):
        return None


def choose(
    endpoint: Endpoint,
    interface_name: str | None = None,
    *,
    multi_node: bool = True,
    node_rank: int | None = None,
    peers: Sequence[str] = (),
    resolve_wait_s: float = 0.0,
    origin: str | None = None,
    allow_public: bool = False,
) -> NetworkChoice:
    """Decides for a real node (not simulated) how it reaches ``endpoint``, where the store
    listens if this node hosts it, and whether its hostname resolves to loopback.

    ``node_rank``, where a cluster environment gives it with the endpoint, decides who hosts the
    store (node 0), which advertises the address that routes to node 1 (``peers``: every node's
    host in rank order) where the endpoint's name resolves to loopback there. ``origin`` says where
    the endpoint came from, for messages. A globally routable endpoint is refused unless
    ``allow_public``: the store has no authentication.
    """
    choice = _route(endpoint, interface_name, multi_node, node_rank, peers, resolve_wait_s, origin, allow_public)
    return dataclasses.replace(
        choice, store_address=_store_address(choice, multi_node), hostname_loopback=hostname_loopback_address()
    )


def _store_address(choice: NetworkChoice, multi_node: bool) -> str | None:
    """Where the host node's store listens: the endpoint's address when this host owns it; every
    address when the endpoint resolves to loopback here (with several nodes) or to an address this
    host does not have (a Kubernetes Service's, a NAT's): the other nodes then dial another one."""
    if not choice.is_host or (multi_node and ipaddress.ip_address(choice.endpoint_ip).is_loopback):
        return None
    owner = interface_owning(choice.endpoint_ip, local_interfaces())
    return choice.endpoint_ip if owner is not None else None  # a service's or a NAT's address: not bindable here


def _route(
    endpoint: Endpoint, interface_name: str | None, multi_node: bool, node_rank: int | None, peers: Sequence[str],
    resolve_wait_s: float, origin: str | None, allow_public: bool,
) -> NetworkChoice:  # fmt: skip
    """Who hosts the store, the address this node advertises and its interface (see :func:`choose`)."""
    interfaces = local_interfaces()
    if interface_name is not None and multi_node and _named_interface(interface_name, interfaces).is_loopback:
        raise SettingsRefused(
            f"--interface {interface_name} is the loopback interface, but the job has several nodes",
            "the address it would advertise (127.0.0.1) means each node itself to the others, so they never meet.",
            "name the interface on the network the nodes share (ip -br addr lists them), or drop --interface",
        )
    named = f"the endpoint {endpoint} ({origin})" if origin else f"--rdzv-endpoint {endpoint}"
    endpoint_ip = resolve_host(endpoint.host, wait_s=resolve_wait_s, what=f"{named}: the host {endpoint.host!r}")
    if ipaddress.ip_address(endpoint_ip).is_global and not allow_public:
        raise SettingsRefused(
            f"{named}: {endpoint_ip} is a globally routable address",
            "the rendezvous store (torch's TCPStore) has no authentication: anyone on the internet who reaches "
            f"port {endpoint.port} could join the job, read its settings or end it.",
            "use the nodes' private network address (10.x, 172.16-31.x, 192.168.x), or, behind a firewall that "
            "admits only the nodes, allow it with --allow-public-endpoint",
        )
    if multi_node and node_rank == 0:
        return _choose_as_node_zero(endpoint, endpoint_ip, interface_name, interfaces, peers)
    if multi_node and ipaddress.ip_address(endpoint_ip).is_loopback:
        raise SettingsRefused(
            f"{named}: on this host {endpoint.host!r} resolves to {endpoint_ip}, a loopback address",
            "many systems map their own hostname to 127.0.0.1 or 127.0.1.1 in /etc/hosts, so the other nodes "
            "could never reach the store through it.",
            "give the main node's IP address on the network the nodes share (ip -br addr shows it)",
        )
    owner = interface_owning(endpoint_ip, interfaces)
    if interface_name is not None:
        interface = _named_interface(interface_name, interfaces)
        local_addr = endpoint_ip if owner is not None else interface.addresses[0]
        return NetworkChoice(endpoint, endpoint_ip, owner is not None, local_addr, interface.name, "--interface given")
    if owner is not None:
        return NetworkChoice(
            endpoint, endpoint_ip, True, endpoint_ip, owner.name, "the endpoint is this host's address"
        )
    local_addr, via = _routed_address(endpoint_ip, endpoint.port, interfaces, named)
    return NetworkChoice(
        endpoint, endpoint_ip, False, local_addr, via.name, f"the route to {endpoint_ip} leaves through {via.name}"
    )


def _routed_address(ip: str, port: int, interfaces: dict[str, Interface], what: str) -> tuple[str, Interface]:
    """The source address of the route to ``ip``, and the interface that owns it."""
    try:
        local_addr = route_source_address(ip, port)
    except OSError as error:
        raise SettingsRefused(
            f"{what}: this host has no route to {ip} ({error.strerror})",
            "the kernel's routing table has no way to reach that address from here.",
            "check the address, or pick the interface on the nodes' shared network with --interface IFNAME",
        ) from None
    owner = interface_owning(local_addr, interfaces)
    if owner is None:
        raise SettingsRefused(
            f"the route to {ip} leaves from {local_addr}, which no interface of this host owns",
            "phalanx cannot tell which interface GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME should name.",
            "name it with --interface IFNAME",
        )
    return local_addr, owner


def _choose_as_node_zero(
    endpoint: Endpoint, endpoint_ip: str, interface_name: str | None, interfaces: dict[str, Interface],
    peers: Sequence[str],
) -> NetworkChoice:  # fmt: skip
    owner = interface_owning(endpoint_ip, interfaces)
    if interface_name is not None:
        interface = _named_interface(interface_name, interfaces)
        return NetworkChoice(endpoint, endpoint_ip, True, interface.addresses[0], interface.name, "--interface given")
    if owner is not None and not owner.is_loopback:
        return NetworkChoice(endpoint, endpoint_ip, True, endpoint_ip, owner.name, "node 0, and the address is its own")
    where = ("a loopback address" if ipaddress.ip_address(endpoint_ip).is_loopback
             else "an address this host does not own")  # fmt: skip
    peer = peers[1] if len(peers) > 1 else None
    if peer is not None:
        peer_ip = resolve_host(
            peer, what=f"node 1's host name {peer!r} (the second of the cluster's nodes)",
            needed=f"this is node 0, which hosts the store at {endpoint}, but {endpoint.host!r} resolves to "
            f"{endpoint_ip} here, {where}: phalanx finds the address to advertise from the route to node 1, which "
            "needs node 1's address.",
        )  # fmt: skip
        local_addr, via = _routed_address(peer_ip, endpoint.port, interfaces, f"the route to node 1 ({peer})")
        if not via.is_loopback:
            trap = f"{endpoint.host!r} resolves to {endpoint_ip} here"
            return NetworkChoice(
                endpoint, endpoint_ip, True, local_addr, via.name,
                f"node 0; {trap}, so it advertises the address that routes to node 1 ({peer})",
            )  # fmt: skip
    raise SettingsRefused(
        f"this is node 0, which hosts the store at {endpoint}, but {endpoint.host!r} resolves to {endpoint_ip} here, "
        f"{where}",
        "phalanx advertises this host's address on the network the nodes share, and cannot tell which one that is "
        "(the environment lists no other node to route towards).",
        "name the interface on that network with --interface IFNAME (ip -br addr lists them)",
    )


def _named_interface(name: str, interfaces: dict[str, Interface]) -> Interface:
    interface = interfaces.get(name)
    listing = ", ".join(f"{i.name} ({', '.join(i.addresses) or 'no address'})" for i in interfaces.values())
    if interface is None:
        raise SettingsRefused(
            f"--interface {name}: this host has no network interface of that name",
            f"it has: {listing}",
            "pick one of those (the one on the network the nodes share), or drop --interface to let phalanx choose",
        )
    if not interface.addresses or not interface.is_up:
        state = "is down" if not interface.is_up else "has no IP address"
        raise SettingsRefused(
            f"--interface {name} {state}",
            f"workers cannot talk through it. This host has: {listing}",
            "bring it up (ip link set dev IFNAME up) or pick another interface",
        )
    return interface


def check_interface(name: str) -> Interface:
    return _named_interface(name, local_interfaces())


def probe_tcp(host: str, port: int, timeout: float = 3.0) -> str:
    """A direct TCP connect to the endpoint, described in words: 'accepted', 'refused', ..."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "accepted (something listens there)"
    except TimeoutError:
        return f"timed out after {timeout:g} s (a firewall may drop the packets, or the host is down)"
    except ConnectionRefusedError:
        return "refused (the host is up, but nothing listens on that port yet)"
    except OSError as error:
        if error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"no route to host ({error.strerror})"
        return error.strerror or str(error)


def check_port_free(ip: str, port: int, what: str, *, nodes: str = "on every node") -> None:
    """Refuses a port this host must listen on that something else holds, naming the holder.
    ``nodes`` says where the other port must be given (simulated nodes: one command)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no obstacle
        try:
            probe.bind(("" if family == socket.AF_INET else "::", port))
            return
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return  # not ours to judge (no permission for a low port...): the store says it
    raise SettingsRefused(
        f"{what}: port {port} on this host is taken{_holder(port)}",
        "this host hosts the rendezvous store, which must listen on that port.",
        f"stop what holds it (an earlier job still running?), or pick another port in --rdzv-endpoint {nodes}",
    )


def _holder(port: int) -> str:
    try:
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
                if connection.pid is None:
                    return " (by a process of another user)"
                process = psutil.Process(connection.pid)
                command = " ".join(" ".join(process.cmdline()).split())  # one line
                return f" (by process {connection.pid}: {command[:116] + ' ...' if len(command) > 120 else command})"
    except (psutil.Error, OSError):
        pass
    return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
