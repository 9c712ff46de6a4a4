"""The check that peers reach each node where its workers will listen, before the workers start.

The nodes are threads of this process; the store is a real TCPStore and the connects are real
TCP connects on this machine's loopback. A node that cannot be reached is made by posting a port
that is bound but not listening (tests/netns/test_networks.py cuts a real second network in
network namespaces).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from phalanx.errors import JoinTimeout, PeersUnreachable
from phalanx.launch import reachability
from phalanx.launch.reachability import Reachability, neighbours, workers_interface
from tests.unit.node_setups import CountingStore

PREFIX = "phalanx/reachtest/"


def test_each_node_connects_to_its_two_neighbours_in_the_ring():
    assert neighbours(0, 1) == []
    assert neighbours(0, 2) == [1] and neighbours(1, 2) == [0]
    assert neighbours(0, 3) == [1, 2] and neighbours(1, 3) == [0, 2] and neighbours(2, 3) == [0, 1]
    assert neighbours(5, 1024) == [4, 6] and neighbours(1023, 1024) == [0, 1022]
    reached = {index: 0 for index in range(64)}
    for index in range(64):
        for target in neighbours(index, 64):
            reached[target] += 1
    assert set(reached.values()) == {2}  # every node by its two neighbours, none more


def test_the_interface_checked_is_the_one_the_backend_binds():
    assert workers_interface("gloo", {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "nope0"}) == "lo"
    assert workers_interface("nccl", {"GLOO_SOCKET_IFNAME": "nope0", "NCCL_SOCKET_IFNAME": "lo"}) == "lo"
    for value in ("lo,eth0", "^docker", "=lo", "nope0", ""):  # no single interface of this host
        assert workers_interface("gloo", {"GLOO_SOCKET_IFNAME": value}) is None, value
        assert workers_interface("nccl", {"NCCL_SOCKET_IFNAME": value}) is None, value


class Unreachable(Reachability):
    """A node whose peers find nothing where it says its workers listen: its socket is bound but
    not listening, so that a connect there is refused (and the port stays its own)."""

    def _listen(self) -> list:
        self._socket = socket.socket()
        self._socket.bind((self.me.address, 0))
        self.me = self.me._replace(port=self._socket.getsockname()[1])
        self.store.set(f"{self.prefix}listener/{self.index}", json.dumps(self.me._asdict()))
        return []


class NoAddress(Reachability):
    """A node whose workers' interface has no address: it cannot listen, and says so itself."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.me = self.me._replace(address="")


class NotChecked(Reachability):
    """A node whose interface variable names no single interface (``eth0,eth1``): it takes part."""

    def __init__(self, store, prefix, index, count, label, _interface, hosts_store=False) -> None:
        super().__init__(store, prefix, index, count, label, None, hosts_store)


def check_all(nodes: int, kinds: dict[int, type[Reachability]], counts: dict[int, int] | None = None) -> dict:
    """Runs ``nodes`` nodes' checks side by side; returns each node's outcome (None or the error)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True, use_libuv=True)
    outcomes: dict[int, object] = {}

    def one(index: int) -> None:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
        store = CountingStore(client, counts, index) if counts is not None else client
        kind = kinds.get(index, Reachability)
        try:
            kind(store, PREFIX, index, nodes, f"node{index}", "lo", hosts_store=index == 0).check()
            outcomes[index] = None
        except Exception as error:  # the outcome under test
            outcomes[index] = error

    threads = [threading.Thread(target=one, args=(index,)) for index in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


@pytest.mark.parametrize("nodes", [8, 64])
def test_nodes_that_reach_each_other_pass_in_a_constant_number_of_store_operations(nodes):
    """Per node: its listener, its neighbours' listeners (one wait, one read), its result, a count,
    one wait for the outcome and its read: 7 operations; the last to post reads the failures' count
    and writes the outcome instead of waiting for it: 7 too. At 8 nodes as at 64."""
    counts = {index: 0 for index in range(nodes)}
    started = time.monotonic()
    outcomes = check_all(nodes, {}, counts)
    assert outcomes == {index: None for index in range(nodes)}
    print(
        f"MEASURED: {nodes} nodes: {max(counts.values())} store operations per node, {time.monotonic() - started:.2f} s"
    )
    assert set(counts.values()) == {7}, counts


def test_a_node_its_peers_cannot_reach_stops_every_node_with_the_same_table():
    outcomes = check_all(4, {2: Unreachable})
    assert all(isinstance(outcome, PeersUnreachable) for outcome in outcomes.values()), outcomes
    texts = {str(outcome) for outcome in outcomes.values()}
    assert len(texts) == 1, texts  # every node says the same
    text = texts.pop()
    assert outcomes[0].exit_code == 2
    assert "peers cannot reach node2 where its workers will listen" in text, text
    header, *rows = [line.split() for line in text.splitlines() if line.lstrip().startswith(("node ", "node2 "))]
    assert header == ["node", "interface", "address", "from", "result"], text
    assert sorted(row[3] for row in rows) == ["node1", "node3"], text  # its ring neighbours
    assert all(row[1] == "lo" and row[4:] == ["refused"] for row in rows), text
    assert "HINT: every node must reach every other on the workers' interface" in text
    assert "--interface IFNAME" in text


def test_a_node_that_cannot_listen_is_a_row_of_the_table_every_node_prints():
    outcomes = check_all(3, {1: NoAddress})
    assert all(isinstance(outcome, PeersUnreachable) for outcome in outcomes.values()), outcomes
    assert len({str(outcome) for outcome in outcomes.values()}) == 1
    rows = [line.split() for line in str(outcomes[0]).splitlines() if "cannot listen" in line]
    assert rows == [["node1", "lo", "-", "node1", "cannot", "listen:", "the", "interface", "has", "no", "address"]]


def test_a_node_whose_interface_is_not_one_takes_part_unchecked_and_the_job_goes_on():
    assert check_all(3, {1: NotChecked}) == {0: None, 1: None, 2: None}


class DiesBeforeListening(Reachability):
    def check(self) -> None:
        raise RuntimeError("this node died after the lobby")


class DiesAfterListening(Reachability):
    """Listens (its neighbours' connects succeed), then never posts its result."""

    def check(self) -> None:
        self._listen()
        LEFT_OPEN.append(self)


LEFT_OPEN: list[Reachability] = []


@pytest.mark.parametrize("kind", [DiesBeforeListening, DiesAfterListening])
def test_a_node_that_dies_after_the_lobby_ends_every_node_s_wait_within_the_bound(monkeypatch, kind):
    monkeypatch.setattr(reachability, "CHECK_BOUND_S", 5.0)
    started = time.monotonic()
    try:
        outcomes = check_all(3, {1: kind})
    finally:
        for node in LEFT_OPEN:
            node._close()
    assert time.monotonic() - started < 5.0 + reachability.CONNECT_TIMEOUT_S + 5
    said = {str(outcomes[index]) for index in (0, 2)}
    assert len(said) == 1, said  # both obey the one outcome
    for index in (0, 2):
        assert isinstance(outcomes[index], JoinTimeout) and outcomes[index].exit_code == 3, outcomes
    text = said.pop()
    assert "the nodes stopped answering before their workers started" in text, text
    assert re.search(r"node[02]'s wait ended first, \d of 3 nodes had checked their neighbours", text), text
