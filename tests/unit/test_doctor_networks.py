"""The doctor's networks probe: which pairs it measures, a real measurement over loopback, and
the verdict it draws. The test bed's two-network hosts run it for real (tests/netns/test_networks.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from phalanx.diagnostics import networks
from phalanx.diagnostics.doctor_report import _networks_table
from phalanx.diagnostics.networks import Attachment, measure, pairs_to_measure, responding
from phalanx.diagnostics.verdict import network_findings


def at(network: str, address: str, interface: str = "eth0", port: int = 1) -> Attachment:
    return Attachment(network, interface, address, port, 0)


def test_every_pair_is_measured_on_each_network_both_are_on_and_only_there() -> None:
    main, data = "10.1.0.0/24", "10.2.0.0/24"
    attached = {
        0: [at(main, "10.1.0.1"), at(data, "10.2.0.1", "eth1")],
        2: [at(main, "10.1.0.2"), at(data, "10.2.0.2", "eth1")],
        4: [at(main, "10.1.0.3")],  # no data network on this node
    }
    plan = [(source, target, mine.network) for source, target, mine, _ in pairs_to_measure(attached)]
    assert plan == [(0, 2, main), (0, 2, data), (0, 4, main), (2, 4, main)]


def test_simulated_nodes_on_one_host_have_nothing_to_measure() -> None:
    same = [at("10.1.0.0/24", "10.1.0.1")]
    assert pairs_to_measure({0: same, 1: same, 2: same}) == []


@pytest.fixture
def loopback_only(monkeypatch):
    """This host's attachable addresses, as a host with one network on loopback would list them:
    the real interface list has no second host to measure against."""
    monkeypatch.setattr(networks, "_attachable", lambda prefer: [("127.0.0.0/8", "lo", "127.0.0.1", 0)])


def test_a_measurement_over_a_real_connection_gives_latency_and_bandwidth(loopback_only) -> None:
    with responding() as [theirs]:
        mine = Attachment(theirs.network, "lo", "127.0.0.1", 0, 0)
        figure = measure(0, 1, mine, theirs, 4 * 2**20)
    assert figure.error is None, figure
    assert 0 < figure.latency_s < 0.1
    assert figure.bandwidth_bytes_per_s is not None and figure.bandwidth_bytes_per_s > 1e6


def test_a_network_without_a_listener_is_reported_unreachable_not_raised() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    theirs = at("127.0.0.0/8", "127.0.0.1", "lo", port)
    figure = measure(0, 1, at("127.0.0.0/8", "127.0.0.1", "lo", 0), theirs, 2**20)
    assert figure.bandwidth_bytes_per_s is None and figure.latency_s is None
    assert figure.error == f"no connection to 127.0.0.1 in {networks.CONNECT_TIMEOUT_S:g} s: Connection refused"


def test_a_peer_that_accepts_and_never_answers_is_bounded(monkeypatch) -> None:
    """A listener whose host stopped reading (a stalled peer, an MTU black hole): the measurement
    ends at its bound with what happened, instead of holding every rank at the barrier."""
    monkeypatch.setattr(networks, "MEASURE_BOUND_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        theirs = at("127.0.0.0/8", "127.0.0.1", "lo", silent.getsockname()[1])
        started = time.monotonic()
        figure = measure(0, 1, at("127.0.0.0/8", "127.0.0.1", "lo", 0), theirs, 2**20)
    assert time.monotonic() - started < 3.0
    assert figure.error == "connected to 127.0.0.1, then timed out during its round trips", figure


def test_the_listeners_and_their_threads_end_with_the_block(loopback_only) -> None:
    with responding() as [theirs]:
        held = socket.create_connection((theirs.address, theirs.port), timeout=1)  # a connection still served
        time.sleep(0.2)  # accepted by now (a listener backlog would keep it anyway)
    with held, pytest.raises(ConnectionRefusedError):
        socket.create_connection((theirs.address, theirs.port), timeout=1).close()
    assert not [t for t in threading.enumerate() if t.name.startswith("doctor-networks-")]


def test_one_address_per_subnet_is_listened_on_the_workers_one_first(monkeypatch) -> None:
    """A node with a second address on a subnet (a VIP, two cards) is measured once there, from the
    address its workers use; public and link-local addresses are left out."""
    from phalanx.launch.network import Interface

    found = {"eth0": Interface("eth0", (), True, 1000, networks=("10.1.0.11/24", "10.1.0.1/24", "8.8.4.4/24")),
             "eth1": Interface("eth1", (), True, 0, networks=("169.254.3.3/16",)),
             "eth2": Interface("eth2", (), False, 0, networks=("10.9.0.1/24",))}  # fmt: skip
    monkeypatch.setattr(networks, "local_interfaces", lambda: found)
    assert networks._attachable("10.1.0.1") == [("10.1.0.0/24", "eth0", "10.1.0.1", 1000)]
    assert networks._attachable(None) == [("10.1.0.0/24", "eth0", "10.1.0.11", 1000)]


def report_with(figures: list[dict], interfaces: tuple[str, ...] = ("eth1", "eth1"), links_gbit: float = 0.2) -> dict:
    """Nodes whose workers use 10.1.0.0/24 (eth0), and a data network 10.2.0.0/24; the process
    group's own link measured at ``links_gbit``."""
    nodes = []
    for k, data_interface in enumerate(interfaces, 1):
        nodes.append({"label": f"10.1.0.{k}", "address": f"10.1.0.{k}", "ranks": [k - 1], "networks": [
            {"network": "10.1.0.0/24", "interface": "eth0", "address": f"10.1.0.{k}", "port": 1, "speed_mbps": 0},
            {"network": "10.2.0.0/24", "interface": data_interface, "address": f"10.2.0.{k}", "port": 1,
             "speed_mbps": 0},
        ]})  # fmt: skip
    ranks = [{"rank": k, "node": f"10.1.0.{k + 1}"} for k in range(len(interfaces))]
    links = [{"source": 0, "target": 1, "latency_s": 1e-4, "bandwidth_bytes_per_s": links_gbit * 1e9 / 8}]
    return {"nodes": nodes, "ranks": ranks, "networks": figures, "links": links, "simulated": False,
            "settings": {"p2p_bytes": 2**24}}  # fmt: skip


def figure(network: str, gbit: float | None, error: str | None = None, pair: tuple[int, int] = (0, 1)) -> dict:
    rate = None if gbit is None else gbit * 1e9 / 8
    interface = "eth0" if network.startswith("10.1.") else "eth1"
    return {"network": network, "source": pair[0], "target": pair[1], "source_interface": interface,
            "target_interface": interface, "latency_s": None if error else 1e-4, "bandwidth_bytes_per_s": rate,
            "error": error}  # fmt: skip


def test_a_faster_network_than_the_workers_one_is_a_warning_naming_the_interface() -> None:
    report = report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)])
    [finding] = network_findings(report)
    assert finding.severity == "warning" and finding.topic == "faster-network"
    assert "10.1.0.0/24 (eth0)" in finding.what and "0.2 Gbit/s" in finding.what
    assert "10.2.0.0/24 (eth1) connects every node too and measures 9.5 Gbit/s" in finding.what
    assert finding.hint.startswith("start every node with --interface eth1")
    table = _networks_table(report)
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["10.1.0.0/24", "*"], ["10.2.0.0/24", "10.1.0.1"]], table
    assert rows[0][-1] == "0.2" and rows[1][-1] == "9.5", table


def test_interfaces_named_differently_per_node_are_named_per_node() -> None:
    report = report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)], interfaces=("eth1", "ens5"))
    [finding] = network_findings(report)
    assert "--interface eth1 on node 10.1.0.1, --interface ens5 on node 10.1.0.2" in finding.hint


@pytest.mark.parametrize("data_gbit", [0.28, 0.2, 0.1])  # 1.4 times the workers' network, as fast, slower
def test_a_network_less_than_half_again_as_fast_says_nothing(data_gbit) -> None:
    assert network_findings(report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", data_gbit)])) == []


def test_no_tcp_network_is_named_faster_than_a_process_group_that_runs_faster_than_tcp() -> None:
    """NCCL over InfiniBand: the socket interface carries only NCCL's bootstrap, and the group's
    links measure far above any TCP figure; IPoIB's TCP beating eth0's is no reason to move."""
    report = report_with([figure("10.1.0.0/24", 20.0), figure("10.2.0.0/24", 40.0)], links_gbit=180.0)
    assert network_findings(report) == []


def test_a_faster_network_that_misses_a_node_is_no_way_out() -> None:
    report = report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)])
    report["nodes"].append({"label": "10.1.0.3", "address": "10.1.0.3", "ranks": [2], "networks": [
        {"network": "10.1.0.0/24", "interface": "eth0", "address": "10.1.0.3", "port": 1, "speed_mbps": 0}]})  # fmt: skip
    assert network_findings(report) == []


def test_a_network_that_connects_some_pairs_only_is_a_warning() -> None:
    report = report_with([figure("10.1.0.0/24", 9.0, pair=pair) for pair in ((0, 1), (0, 2), (1, 2))]
                         + [figure("10.2.0.0/24", 9.0, pair=(0, 1)), figure("10.2.0.0/24", 9.0, pair=(0, 2)),
                            figure("10.2.0.0/24", None, "no connection to 10.2.0.3 in 1 s: timed out", (1, 2))],
                         interfaces=("eth1", "eth1", "eth1"))  # fmt: skip
    [finding] = network_findings(report)
    assert finding.topic == "network-unreachable"
    assert finding.what == ("10.2.0.0/24: 1 of 3 pairs of nodes could not use it: 10.1.0.2 -> 10.1.0.3: "
                            "no connection to 10.2.0.3 in 1 s: timed out")  # fmt: skip
    assert "firewall" in finding.hint


def test_a_network_no_pair_reaches_is_normal_and_says_nothing() -> None:
    """A firewalled management network: not the workers', and no pair uses it."""
    report = report_with([figure("10.1.0.0/24", 9.0), figure("10.2.0.0/24", None, "no connection: timed out")])
    assert network_findings(report) == []


def test_transfers_that_stall_on_the_workers_network_point_at_the_mtu() -> None:
    stalled = "connected to 10.1.0.2, then timed out during the first transfer"
    [finding] = network_findings(report_with([figure("10.1.0.0/24", None, stalled), figure("10.2.0.0/24", 9.5)]))
    assert finding.what.startswith("10.1.0.0/24 (the workers' network): 1 of 1 pairs"), finding.what
    assert "MTU" in finding.hint
