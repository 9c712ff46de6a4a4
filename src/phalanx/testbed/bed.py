"""A test bed: K hosts on one Linux machine, each a network namespace on a shared bridge.

Host k has 10.<subnet>.0.<k> on ``eth0`` (and on ``eth1`` a ``data`` network, if asked), the
bridge 10.<subnet>.0.254, so this machine reaches every host. Links can be shaped and cut. Inside
a host, its own name resolves to 127.0.1.1: the /etc/hosts trap of many real clusters.
Everything a bed creates carries its name, and its state file is written first, so that
:func:`tear_down` removes a half-built bed, and nothing that is not a bed's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from phalanx.errors import PhalanxError, SettingsRefused

STATE_DIR = Path("/run/phalanx-testbed")
NETNS_ETC = Path("/etc/netns")
#: The bridge's own address on every bed: 10.<subnet>.0.254.
BRIDGE_HOST = 254
#: Interface names are at most 15 characters: "tb<bed>-br" and "tb<bed>-v<k>" must fit.
MAX_NAME = 8
#: The bed every verb means without --name.
DEFAULT_NAME = "phx"
#: A bed's networks: ``main`` (every bed's, eth0) and ``data`` (eth1, when the bed has it).
NETWORKS = ("main", "data")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_HOST = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class TestBedError(PhalanxError):
    """A command the bed ran failed; the message has the command and what it printed (exit code 1)."""

    __test__ = False


#: How tc writes each part of a link's shape (the flag's name), with an example.
SHAPING_GRAMMAR = {
    "rate": (re.compile(r"^\d+(\.\d+)?([kmg]?bit|[kmg]?bps)$"), "1gbit"),
    "delay": (re.compile(r"^\d+(\.\d+)?(us|ms|s)$"), "1ms"),
    "loss": (re.compile(r"^(100(\.0+)?|\d{1,2}(\.\d+)?)%$"), "0.1%"),
}


def check_shaping(part: str, value: str) -> str:
    """``--rate``, ``--delay`` or ``--loss`` as tc reads it; refused otherwise."""
    pattern, example = SHAPING_GRAMMAR[part]
    if not pattern.match(value):
        raise SettingsRefused(
            f"--{part} {value!r} is not written as tc reads it", hint=f"for example --{part} {example}"
        )
    return value


@dataclass(frozen=True)
class Shaping:
    """A link's shape: ``rate`` as tc writes it (``1gbit``), ``delay`` (``1ms``), ``loss`` (``0.1%``)."""

    rate: str | None = None
    delay: str | None = None
    loss: str | None = None

    def __bool__(self) -> bool:
        return any((self.rate, self.delay, self.loss))

    def __str__(self) -> str:
        return ", ".join(f"{part} {value}" for part, value in asdict(self).items() if value) or "unshaped"


@dataclass(frozen=True)
class Host:
    """One host of a bed: its name, namespace, address, and the bridge's side of its link."""

    name: str
    namespace: str
    address: str
    port: str  # the bridge's side of the host's link
    #: The host's network interface, inside it.
    device: str = "eth0"
    #: The host's address on the data network, and the data bridge's side of its link (or None).
    data_address: str | None = None
    data_port: str | None = None

    def link(self, network: str) -> tuple[str, str, str]:
        """``network``'s interface inside the host, the bridge's side of its link, and its address."""
        if network == "main":
            return self.device, self.port, self.address
        if self.data_port is None or self.data_address is None:
            raise SettingsRefused(
                f"host {self.name} has no data network", "its bed was built without one.",
                "remove the bed (phalanx testbed down) and build it with a second one: phalanx testbed up --hosts K "
                "--data-network",
            )  # fmt: skip
        return "eth1", self.data_port, self.data_address

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs inside this host: its network, its /etc/hosts and
        /etc/resolv.conf.

        ``nsenter`` plus a private mount namespace, not ``ip netns exec``: that one also remounts
        /sys, which hides the cgroup mounts some daemons (slurmd) need.
        """
        folder = NETNS_ETC / self.namespace
        resolv = f"{{ [ ! -e /etc/resolv.conf ] || mount --bind {folder / 'resolv.conf'} /etc/resolv.conf; }}"
        script = f'mount --bind {folder / "hosts"} /etc/hosts && {resolv} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]  # fmt: skip


@dataclass
class TestBed:
    """A bed that exists: its hosts, and how each link is shaped and whether it is cut."""

    name: str
    subnet: int
    hosts: list[Host]
    #: Keyed by :func:`link_key`: ``h2`` for the main network, ``h2/data`` for the data network.
    shaping: dict[str, Shaping] = field(default_factory=dict)
    cut: list[str] = field(default_factory=list)
    #: The data network's subnet (10.<data_subnet>.0.0/24), or None when the bed has none.
    data_subnet: int | None = None
    #: Pairs of hosts whose packets to each other on a network are dropped (``["h1", "h2", "data"]``).
    pair_cuts: list[list[str]] = field(default_factory=list)

    __test__ = False  # not a pytest test class, despite the name

    @property
    def bridge(self) -> str:
        return f"{link_prefix(self.name)}br"

    @property
    def bridge_address(self) -> str:
        return f"10.{self.subnet}.0.{BRIDGE_HOST}"

    @property
    def data_bridge(self) -> str:
        return f"{link_prefix(self.name)}bd"

    @property
    def networks(self) -> list[str]:
        return ["main"] if self.data_subnet is None else ["main", "data"]

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(host.name for host in self.hosts)
        raise SettingsRefused(
            f"test bed {self.name!r} has no host {name!r}", f"its hosts: {known}", "pick one of those"
        )

    def shape(self, shaping: Shaping, hosts: Sequence[str] | None = None, network: str = "main") -> None:
        """Shapes the links of ``hosts`` (every host by default) on ``network``, both directions."""
        for name in hosts or [host.name for host in self.hosts]:
            host, key = self.host(name), link_key(name, network)
            host.link(network)  # refuses a network the bed lacks, before the link is touched
            try:
                _apply_shaping(host, shaping, network)
            except SettingsRefused:  # the link keeps the shaping it had, as the bed's state says
                _apply_shaping(host, self.shaping.get(key, Shaping()), network)
                raise
            self.shaping[key] = shaping
        self.save()

    def cut_link(self, name: str, network: str = "main") -> None:
        """Cuts a host off ``network``: its bridge port goes down, and packets to and from it vanish."""
        _ip("link", "set", self.host(name).link(network)[1], "down")
        if link_key(name, network) not in self.cut:
            self.cut.append(link_key(name, network))
        self.save()

    def restore_link(self, name: str, network: str = "main") -> None:
        """Reconnects a host that :meth:`cut_link` cut off."""
        _ip("link", "set", self.host(name).link(network)[1], "up")
        if link_key(name, network) in self.cut:
            self.cut.remove(link_key(name, network))
        self.save()

    def cut_between(self, first: str, second: str, network: str = "main") -> None:
        """Drops the packets between two hosts only on ``network`` (iptables in each host): each
        still reaches every other host, and the two reach each other on the bed's other network."""
        cut = self._between(first, second, network)
        if cut in self.pair_cuts:
            return  # cut already: a second rule would outlive the restore
        self._drop_between(cut, "-A")
        self.pair_cuts.append(cut)
        self.save()

    def restore_between(self, first: str, second: str, network: str = "main") -> None:
        """Lets through again what :meth:`cut_between` dropped."""
        cut = self._between(first, second, network)
        if cut in self.pair_cuts:
            self._drop_between(cut, "-D")
            self.pair_cuts.remove(cut)
        self.save()

    def _between(self, first: str, second: str, network: str) -> list[str]:
        check_network(network)
        if first == second:
            raise SettingsRefused(f"cannot cut {first} off from itself", hint="name two different hosts")
        for name in (first, second):
            self.host(name).link(network)  # refuses a host, or a network the bed lacks
        if shutil.which("iptables") is None:
            raise SettingsRefused(
                "a cut between two hosts needs iptables, which this machine lacks", "",
                "apt-get install iptables (make cluster-deps installs it)",
            )  # fmt: skip
        return [*sorted([first, second]), network]

    def _drop_between(self, cut: list[str], action: str) -> None:
        hosts = [self.host(name) for name in cut[:2]]
        addresses = [host.link(cut[2])[2] for host in hosts]
        for host, other in zip(hosts, reversed(addresses)):
            _run(["ip", "netns", "exec", host.namespace, "iptables", action, "OUTPUT", "-d", other, "-j", "DROP"])

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        temporary = state_file(self.name).with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=1))
        temporary.replace(state_file(self.name))

    @classmethod
    def load(cls, name: str) -> TestBed:
        try:
            data = json.loads(state_file(name).read_text())
        except FileNotFoundError:
            raise SettingsRefused(
                f"there is no test bed named {name!r}", "", "start one with: phalanx testbed up --hosts 2"
            ) from None
        hosts = [Host(**host) for host in data.pop("hosts")]
        shaping = {key: Shaping(**shape) for key, shape in data.pop("shaping").items()}
        return cls(hosts=hosts, shaping=shaping, **data)

    def processes(self, name: str) -> list[int]:
        """The processes running in a host's network namespace."""
        return namespace_pids(self.host(name).namespace)


def state_file(name: str) -> Path:
    """Where a bed's hosts, shaping and cuts are kept; written before anything else is built."""
    return STATE_DIR / f"{name}.json"


def check_network(network: str) -> str:
    """``network`` if it is one a bed can have (:data:`NETWORKS`); refused otherwise."""
    if network not in NETWORKS:
        raise SettingsRefused(f"no network {network!r} in a test bed", f"a bed's networks: {', '.join(NETWORKS)}.",
                              "for example --network data")  # fmt: skip
    return network


def link_key(host: str, network: str) -> str:
    """How the bed's state names a host's link on ``network``: ``h2``, or ``h2/data``."""
    return host if check_network(network) == "main" else f"{host}/{network}"


def namespace_prefix(name: str) -> str:
    """Every namespace of a bed (and its /etc/netns folder) begins so: ``tb-<bed>-<host>``."""
    return f"tb-{name}-"


def link_prefix(name: str) -> str:
    """Every link of a bed begins so: ``tb<bed>-br`` (the bridge), ``tb<bed>-v<k>`` (host k's port),
    ``tb<bed>-bd`` and ``tb<bed>-d<k>`` (the data network's)."""
    return f"tb{name}-"


def check_can_build() -> None:
    """Refuses, saying why, where a bed cannot be built: not root, or no ``ip``/``nsenter``."""
    if os.geteuid() != 0:
        raise SettingsRefused(
            "a test bed needs root (network namespaces, a bridge and its links are the kernel's)",
            f"this process runs as uid {os.geteuid()}.",
            "run it with sudo, or as root in a container or VM",
        )
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        raise SettingsRefused(
            f"a test bed needs {', '.join(missing)}, which this machine lacks",
            "they come with iproute2 and util-linux.",
            "apt-get install iproute2 util-linux",
        )


def build(
    name: str, host_names: Sequence[str], *, shaping: Shaping = Shaping(), subnet: int | None = None,
    data_network: bool = False, names_on: str = "main",
) -> TestBed:  # fmt: skip
    """Creates a bed and saves its state; on any failure or interruption (SIGINT, SIGTERM), removes
    what it made.

    Args:
        name: the bed's name, 1 to 8 lower-case letters and digits.
        host_names: the hosts' names (``["h1", "h2"]``), at most 250.
        shaping: the shape of every link of the main network (the data network's are left unshaped).
        subnet: the second byte of the bed's 10.x.0.0/24 (default: the first one no route uses).
        data_network: give every host a second network, ``data`` (eth1, on the next free subnet).
        names_on: the network the hosts' names resolve to inside the hosts (``main`` or ``data``).

    Example:
        >>> bed = build("demo", ["h1", "h2"], shaping=Shaping(rate="1gbit"))  # doctest: +SKIP
        >>> subprocess.run(bed.host("h1").command(["ip", "-br", "addr"]))  # doctest: +SKIP
        >>> tear_down("demo")  # doctest: +SKIP
    """
    check_can_build()
    _check_names(name, host_names)
    if state_file(name).exists() or _namespaces_of(name):
        raise SettingsRefused(
            f"a test bed named {name!r} exists already",
            "its namespaces or its state file are still there.",
            f"use it, or remove it first: phalanx testbed down --name {name}",
        )
    if subnet is not None:
        _check_subnet(subnet)
    if check_network(names_on) == "data" and not data_network:
        raise SettingsRefused("--names-on data needs a data network", hint="add --data-network")
    subnet = subnet if subnet is not None else _free_subnet()
    data_subnet = _free_subnet(also_used={subnet}) if data_network else None
    bed = TestBed(name, subnet, [
        Host(host, f"{namespace_prefix(name)}{host}", f"10.{subnet}.0.{k}", f"{link_prefix(name)}v{k}",
             data_address=f"10.{data_subnet}.0.{k}" if data_network else None,
             data_port=f"{link_prefix(name)}d{k}" if data_network else None)
        for k, host in enumerate(host_names, 1)
    ], data_subnet=data_subnet)  # fmt: skip
    with _interruptible():
        try:
            bed.save()  # first: tear_down finds a half-built bed by it
            _add_bridge(bed.bridge, bed.bridge_address)
            if data_subnet is not None:
                _add_bridge(bed.data_bridge, f"10.{data_subnet}.0.{BRIDGE_HOST}")
            for host in bed.hosts:
                _add_host(bed, host, names_on)
            if shaping:
                bed.shape(shaping)
        except BaseException:
            tear_down(name)
            raise
    return bed


@contextlib.contextmanager
def test_bed(
    name: str, host_names: Sequence[str], *, shaping: Shaping = Shaping(), data_network: bool = False,
    names_on: str = "main",
) -> Iterator[TestBed]:  # fmt: skip
    """A bed for the duration of a ``with`` block, removed afterwards whatever happens (the
    arguments are :func:`build`'s)."""
    bed = build(name, host_names, shaping=shaping, data_network=data_network, names_on=names_on)
    try:
        yield bed
    finally:
        tear_down(name)


test_bed.__test__ = False  # type: ignore[attr-defined]


def tear_down(name: str) -> list[str]:
    """Removes everything a bed named ``name`` made, also half-built: kills its hosts' processes,
    then deletes its namespaces, links, hosts files and state. Returns what it removed."""
    if not state_file(name).exists():
        return []  # not a bed of ours (its state is written before anything is built): touch nothing
    removed = []
    for namespace in _namespaces_of(name):
        _kill_processes(namespace)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        removed.append(f"namespace {namespace}")
    for link in _links_of(name):
        subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        removed.append(f"link {link}")
    for folder in NETNS_ETC.glob(f"{namespace_prefix(name)}*") if NETNS_ETC.is_dir() else ():
        shutil.rmtree(folder, ignore_errors=True)
    state_file(name).unlink(missing_ok=True)
    return removed


def beds() -> list[str]:
    """The names of the beds on this machine (by their state files)."""
    return sorted(path.stem for path in STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TestBedError(
            f"the test bed's command `{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}",
            "the kernel refused a namespace, link or queue the bed needs.",
            "phalanx testbed down removes what was built; check that this machine allows network namespaces",
        )


def _add_bridge(bridge: str, address: str) -> None:
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{address}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")


def _add_host(bed: TestBed, host: Host, names_on: str) -> None:
    _ip("netns", "add", host.namespace)
    _ip("-n", host.namespace, "link", "set", "lo", "up")
    for network in bed.networks:
        bridge = bed.bridge if network == "main" else bed.data_bridge
        device, port, address = host.link(network)
        _ip("link", "add", port, "type", "veth", "peer", "name", device, "netns", host.namespace)
        _ip("link", "set", port, "master", bridge)
        _ip("link", "set", port, "up")
        _ip("-n", host.namespace, "addr", "add", f"{address}/24", "dev", device)
        _ip("-n", host.namespace, "link", "set", device, "up")
    _ip("-n", host.namespace, "route", "add", "default", "via", bed.bridge_address)
    folder = NETNS_ETC / host.namespace
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"127.0.0.1 localhost {socket.gethostname()}", f"127.0.1.1 {host.name}"]
    lines += [f"{other.link(names_on)[2]} {other.name}" for other in bed.hosts if other is not host]
    (folder / "hosts").write_text("\n".join(lines) + "\n")
    # The machine's name server is out of a host's reach: each lookup of a name the hosts file
    # lacks (c10d's reverse lookup of a peer's IPv4-mapped address) would wait out glibc's
    # timeout, 10 s. The host's own loopback refuses at once, as a reachable name server answers.
    (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def _apply_shaping(host: Host, shaping: Shaping, network: str = "main") -> None:
    """tbf for the rate; netem, where the kernel has it, for delay and loss. Both directions: the
    host's interface sends, its bridge port sends towards it."""
    inside, port, _ = host.link(network)
    for device, namespace in ((inside, host.namespace), (port, None)):
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, timeout=10)
        if not shaping:
            continue
        if shaping.delay or shaping.loss:
            netem = ["netem", *(["delay", shaping.delay] if shaping.delay else []),
                     *(["loss", shaping.loss] if shaping.loss else []),
                     *(["rate", shaping.rate] if shaping.rate else [])]  # fmt: skip
            done = subprocess.run([*prefix, "tc", "qdisc", "add", "dev", device, "root", *netem], capture_output=True,
                                  text=True, timeout=10)  # fmt: skip
            if done.returncode != 0:
                raise SettingsRefused(
                    f"this kernel cannot add delay or loss to a link (tc's netem: {done.stderr.strip()})",
                    "delay and loss need the sch_netem module; a rate alone needs only tbf.",
                    "load it (modprobe sch_netem), or shape the rate alone (--rate)",
                )
        else:
            _run([*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", shaping.rate or "",
                  "burst", "256kb", "latency", "50ms"])  # fmt: skip


def _namespaces_of(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith(namespace_prefix(name))]


def _links_of(name: str) -> list[str]:
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10)
    names = [line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines() if ":" in line]
    return [link for link in names if link.startswith(link_prefix(name))]


def namespace_pids(namespace: str) -> list[int]:
    """The processes in a network namespace (zombies left to an init that never reaps them aside)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    return [int(pid) for pid in listed.stdout.split()]


def _kill_processes(namespace: str) -> None:
    for pid in namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while namespace_pids(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)


def _free_subnet(also_used: Collection[int] = ()) -> int:
    used = _used_subnets() | set(also_used)
    for subnet in range(200, 250):
        if subnet not in used:
            return subnet
    raise SettingsRefused(
        "no free 10.x.0.0/24 subnet among 10.200 to 10.249", "routes or other beds use all of them.",
        "remove beds you no longer need (phalanx testbed down --name NAME), or give --subnet N",
    )  # fmt: skip


def _check_subnet(subnet: int) -> None:
    if not 0 <= subnet <= 255:
        raise SettingsRefused(
            f"--subnet {subnet}: the second byte of 10.x.0.0 is 0 to 255", hint="for example --subnet 200"
        )
    if subnet in _used_subnets():
        raise SettingsRefused(
            f"--subnet {subnet}: 10.{subnet}.0.0/24 is in use here (a route or another bed)",
            "two networks with the same addresses would make the hosts unreachable.",
            "pick another, or leave --subnet out to take the first free one",
        )


def _used_subnets() -> set[int]:
    """The 10.x.0.0/24 subnets routes or beds use (a bed's from its state: it may not be built yet)."""
    listed = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, timeout=10)
    used = {int(m.group(1)) for m in re.finditer(r"\b10\.(\d+)\.", listed.stdout)}
    for name in beds():
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(state_file(name).read_text())
            used |= {data["subnet"], data["data_subnet"]} - {None}
    return used


def check_name(name: str) -> str:
    """A bed's name, as ``--name`` of every verb takes it; refused unless it can prefix its interfaces."""
    if not _NAME.match(name):
        raise SettingsRefused(
            f"test bed name {name!r}: 1 to {MAX_NAME} lower-case letters and digits, starting with a letter",
            "the name prefixes every interface of the bed, and Linux allows 15 characters per interface name.",
            f"for example --name {DEFAULT_NAME}",
        )
    return name


def _check_names(name: str, host_names: Sequence[str]) -> None:
    check_name(name)
    if not 1 <= len(host_names) <= 250:
        raise SettingsRefused(
            f"a test bed of {len(host_names)} hosts", "it has room for 1 to 250.", "for example --hosts 2"
        )
    bad = [host for host in host_names if not _HOST.match(host)]
    if bad or len(set(host_names)) != len(host_names):
        raise SettingsRefused(
            f"test bed host names {', '.join(bad) or 'repeat'}",
            "each is a lower-case host name, used once.",
            "for example h1,h2",
        )


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt within, so a bed half-built when its builder is stopped is removed."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
