"""The doctor's networks probe: which pairs it measures, a real measurement over loopback, and
the verdict it draws. The test bed's two-network hosts run it for real (tests/netns/test_networks.py)."""

from __future__ import annotations

import socket

import pytest

from phalanx.diagnostics import networks
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
    monkeypatch.setattr(networks, "_attachable", lambda: [("127.0.0.0/8", "lo", "127.0.0.1", 0)])


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


def test_the_listeners_are_closed_when_the_block_ends(loopback_only) -> None:
    with responding() as [theirs]:
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((theirs.address, theirs.port), timeout=1).close()


def report_with(figures: list[dict], interfaces: tuple[str, str] = ("eth1", "eth1")) -> dict:
    """Two nodes whose workers use 10.1.0.0/24 (eth0), and a data network 10.2.0.0/24."""
    nodes = []
    for k, data_interface in enumerate(interfaces, 1):
        nodes.append({"label": f"10.1.0.{k}", "address": f"10.1.0.{k}", "networks": [
            {"network": "10.1.0.0/24", "interface": "eth0", "address": f"10.1.0.{k}", "port": 1, "speed_mbps": 0},
            {"network": "10.2.0.0/24", "interface": data_interface, "address": f"10.2.0.{k}", "port": 1,
             "speed_mbps": 0},
        ]})  # fmt: skip
    ranks = [{"rank": 0, "node": "10.1.0.1"}, {"rank": 1, "node": "10.1.0.2"}]
    return {"nodes": nodes, "ranks": ranks, "networks": figures, "settings": {"p2p_bytes": 2**24}}


def figure(network: str, gbit: float | None, error: str | None = None) -> dict:
    rate = None if gbit is None else gbit * 1e9 / 8
    return {"network": network, "source": 0, "target": 1, "source_interface": "eth0" if "1.0" in network else "eth1",
            "target_interface": "eth0" if "1.0" in network else "eth1", "latency_s": None if error else 1e-4,
            "bandwidth_bytes_per_s": rate, "error": error}  # fmt: skip


def test_a_faster_network_than_the_workers_one_is_a_warning_naming_the_interface() -> None:
    [finding] = network_findings(report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)]))
    assert finding.severity == "warning" and finding.topic == "faster-network"
    assert "10.1.0.0/24 (eth0)" in finding.what and "0.2 Gbit/s" in finding.what
    assert "10.2.0.0/24 (eth1) connects every node too and measures 9.5 Gbit/s" in finding.what
    assert finding.hint.startswith("start every node with --interface eth1")


def test_interfaces_named_differently_per_node_are_named_per_node() -> None:
    report = report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)], interfaces=("eth1", "ens5"))
    [finding] = network_findings(report)
    assert "--interface eth1 on node 10.1.0.1, --interface ens5 on node 10.1.0.2" in finding.hint


def test_a_network_no_faster_than_the_workers_one_says_nothing() -> None:
    assert network_findings(report_with([figure("10.1.0.0/24", 9.0), figure("10.2.0.0/24", 9.5)])) == []


def test_a_faster_network_that_misses_a_node_is_no_way_out() -> None:
    report = report_with([figure("10.1.0.0/24", 0.2), figure("10.2.0.0/24", 9.5)])
    report["nodes"].append({"label": "10.1.0.3", "address": "10.1.0.3", "networks": [
        {"network": "10.1.0.0/24", "interface": "eth0", "address": "10.1.0.3", "port": 1, "speed_mbps": 0}]})  # fmt: skip
    assert network_findings(report) == []


def test_a_network_that_connects_some_pairs_only_is_a_warning() -> None:
    report = report_with([figure("10.1.0.0/24", 9.0), figure("10.2.0.0/24", None, "no connection: timed out")])
    [finding] = network_findings(report)
    assert finding.topic == "network-unreachable"
    assert "10.2.0.0/24 10.1.0.1 -> 10.1.0.2: no connection: timed out" in finding.what
