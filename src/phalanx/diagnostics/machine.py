"""This machine's operating-system facts: host, network interfaces, InfiniBand, /dev/shm, limits.

Every reader is cheap (no subprocess; the lookups of the hostname and of an address's name wait
for the name server, the second at most :data:`~phalanx.launch.name_lookup.LIMIT_S`) and never
raises on a missing file: text the OS does not give is ``"unknown"``, a number ``None``. ``root`` is the folder /sys,
/proc, /etc and /dev are read under, so that tests can fake what this machine lacks.
"""

from __future__ import annotations

import ipaddress
import os
import platform
import resource
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from phalanx.launch import name_lookup, network

UNKNOWN = "unknown"

#: Prefixes of the variables that steer torch.distributed, its backends and phalanx.
VARIABLE_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "MASTER_", "PHALANX_", "PET_", "SLURM_", "SKYPILOT_")
#: torchrun's per-process variables, and the GPU mask, listed when set.
VARIABLE_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "JOB_COMPLETION_INDEX",
)


@dataclass(frozen=True)
class HostFacts:
    hostname: str
    fqdn: str
    #: What the hostname resolves to on this machine (IPv4 first); empty when it does not resolve.
    hostname_addresses: tuple[str, ...]
    #: The /etc/hosts trap: the hostname resolves to 127.0.0.1 or 127.0.1.1 (or ::1).
    hostname_is_loopback: bool
    os: str  # the distribution's PRETTY_NAME from /etc/os-release, e.g. "Debian GNU/Linux 12 (bookworm)"
    kernel: str  # e.g. "6.1.0-18-amd64"
    arch: str  # e.g. "x86_64"
    cpus: int | None  # logical CPUs of the machine
    cpus_usable: int | None  # those this process may run on (taskset, cgroup cpusets)
    memory_bytes: int | None
    python: str  # e.g. "3.11.9"
    python_implementation: str  # e.g. "CPython"
    python_executable: str
    #: Seconds a lookup of ``name_lookup_address``'s name takes, as torch's store client makes it
    #: (:mod:`phalanx.launch.name_lookup`).
    name_lookup_s: float
    #: This machine's address whose name was looked up: the hostname's, else an interface's.
    name_lookup_address: str


@dataclass(frozen=True)
class InterfaceFacts:
    name: str
    is_up: bool
    is_loopback: bool
    addresses: tuple[str, ...]  # IPv4 first, then IPv6 (link-local left out)
    mtu: int | None
    speed_mbps: int | None  # link speed in Mbit/s, None when the OS does not know (virtual links, down)


@dataclass(frozen=True)
class InfinibandPort:
    device: str  # e.g. "mlx5_0"
    port: int
    state: str  # e.g. "ACTIVE", "DOWN"
    phys_state: str  # e.g. "LinkUp", "Polling"
    rate: str  # e.g. "200 Gb/sec (4X HDR)"
    link_layer: str  # "InfiniBand", or "Ethernet" for RoCE


@dataclass(frozen=True)
class ShmFacts:
    path: str
    total_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True)
class LimitFacts:
    """Resource limits of this process; None means unlimited."""

    open_files_soft: int | None
    open_files_hard: int | None
    locked_memory_soft: int | None  # bytes; RDMA (InfiniBand, RoCE) pins its buffers
    locked_memory_hard: int | None


def read_text(path: Path) -> str | None:
    """A small sysfs/procfs file's stripped text, or None when it is missing or unreadable."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # missing, a permission, or a sysfs attribute the driver refuses (EINVAL)
        return None


def host_facts(root: Path = Path("/")) -> HostFacts:
    hostname = socket.gethostname()
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        usable = None
    addresses = resolve_addresses(hostname)
    lookup_address = _network_address(addresses)
    return HostFacts(
        hostname=hostname,
        fqdn=socket.getfqdn(hostname),
        hostname_addresses=addresses,
        hostname_is_loopback=any(ipaddress.ip_address(address).is_loopback for address in addresses),
        os=_os_name(root),
        kernel=platform.release() or UNKNOWN,
        arch=platform.machine() or UNKNOWN,
        cpus=os.cpu_count(),
        cpus_usable=usable,
        memory_bytes=psutil.virtual_memory().total,
        python=".".join(str(part) for part in sys.version_info[:3]),
        python_implementation=platform.python_implementation(),
        python_executable=sys.executable,
        name_lookup_s=name_lookup.lookup_s(lookup_address),
        name_lookup_address=lookup_address,
    )


def _network_address(hostname_addresses: tuple[str, ...]) -> str:
    """An address of this machine that its peers see: the hostname's, else the first up interface's;
    127.0.0.1 without one (many name servers answer for loopback addresses themselves)."""
    routable = [a for a in hostname_addresses if not ipaddress.ip_address(a).is_loopback]
    if not routable:
        routable = [address for interface in network.local_interfaces().values()
                    if interface.is_up and not interface.is_loopback
                    for address in interface.addresses if ":" not in address]  # fmt: skip
    return routable[0] if routable else "127.0.0.1"


def resolve_addresses(host: str) -> tuple[str, ...]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))  # unique, in resolver order
    return tuple(sorted(addresses, key=lambda address: ":" in address))  # IPv4 first, as torchrun picks


def _os_name(root: Path) -> str:
    for path in (root / "etc/os-release", root / "usr/lib/os-release"):
        for line in (read_text(path) or "").splitlines():
            key, _, value = line.partition("=")
            if key == "PRETTY_NAME" and value:
                return value.strip().strip("\"'")
    return platform.system() or UNKNOWN


def interface_facts(root: Path = Path("/")) -> list[InterfaceFacts]:
    interfaces = network.local_interfaces()
    stats = psutil.net_if_stats()  # read after: an interface without stats was removed in between
    facts = []
    for name, interface in sorted(interfaces.items()):
        stat = stats.get(name)
        if stat is None:
            continue
        flags = getattr(stat, "flags", "").split(",")  # psutil >= 5.9.3
        facts.append(
            InterfaceFacts(
                name=name,
                is_up=interface.is_up,
                is_loopback=interface.is_loopback or "loopback" in flags,
                addresses=interface.addresses,
                mtu=stat.mtu if stat.mtu > 0 else None,
                speed_mbps=_link_speed(root, name, stat.speed),
            )
        )
    return facts


def _link_speed(root: Path, name: str, psutil_speed: int) -> int | None:
    # sysfs says -1 (or refuses to answer) for links that are down or have no fixed speed (lo, veth).
    text = read_text(root / "sys/class/net" / name / "speed")
    if text is not None and text.lstrip("-").isdigit() and int(text) > 0:
        return int(text)
    return psutil_speed if psutil_speed > 0 else None


def infiniband_ports(root: Path = Path("/")) -> list[InfinibandPort]:
    """One entry per port of every RDMA device in /sys/class/infiniband (none without the drivers)."""
    base = root / "sys/class/infiniband"
    try:
        devices = sorted(base.iterdir())
    except OSError:
        return []
    ports = []
    for device in devices:
        try:
            numbered = [path for path in (device / "ports").iterdir() if path.name.isdigit()]
            port_dirs = sorted(numbered, key=lambda path: int(path.name))
        except OSError:
            port_dirs = []
        for port in port_dirs:
            ports.append(
                InfinibandPort(
                    device=device.name,
                    port=int(port.name),
                    state=_sysfs_state(read_text(port / "state")),
                    phys_state=_sysfs_state(read_text(port / "phys_state")),
                    rate=read_text(port / "rate") or UNKNOWN,
                    link_layer=read_text(port / "link_layer") or UNKNOWN,
                )
            )
    return ports


def _sysfs_state(text: str | None) -> str:
    # The kernel writes "4: ACTIVE" and "5: LinkUp"; the number only repeats the word.
    if not text:
        return UNKNOWN
    return text.partition(":")[2].strip() or text


def shm_facts(root: Path = Path("/")) -> ShmFacts:
    path = root / "dev/shm"
    try:
        stat = os.statvfs(path)
    except OSError:
        return ShmFacts(str(path), None, None)
    return ShmFacts(str(path), stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize)


def limit_facts() -> LimitFacts:
    pairs = [resource.getrlimit(which) for which in (resource.RLIMIT_NOFILE, resource.RLIMIT_MEMLOCK)]
    return LimitFacts(*(None if limit == resource.RLIM_INFINITY else limit for pair in pairs for limit in pair))


def distributed_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The set variables that steer torch.distributed, NCCL, Gloo and phalanx, sorted by name."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(VARIABLE_PREFIXES) or name in VARIABLE_NAMES
    }
