"""The check that peers reach each node where its workers will listen, before the workers start.

The nodes are threads of this process; the store is a real TCPStore and the connects are real
TCP connects on this machine's loopback. A node that cannot be reached is made by posting a port
that nothing listens on (test_two_networks.py cuts a real second network in network namespaces).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from phalanx.errors import JoinTimeout, PeersUnreachable
from phalanx.launch import reachability
from phalanx.launch.reachability import Reachability, probed_by
from tests.unit.node_setups import CountingStore

PREFIX = "phalanx/reachtest/"


def test_each_node_connects_to_its_ring_neighbours_and_the_first_node_once():
    assert probed_by(0, 1) == []
    assert probed_by(0, 2) == [1] and probed_by(1, 2) == [0]
    assert probed_by(0, 3) == [1, 2] and probed_by(1, 3) == [2, 0] and probed_by(2, 3) == [0, 1]
    assert probed_by(5, 1024) == [6, 4, 0] and probed_by(1023, 1024) == [0, 1022]
    reached = {index: 0 for index in range(64)}
    for index in range(64):
        for target in probed_by(index, 64):
            reached[target] += 1
    assert min(reached.values()) >= 2 and reached[0] == 63  # and everyone reaches the first


class Unreachable(Reachability):
    """A node whose peers find nothing where it says its workers listen: it posts a port that
    was bound and closed, so that a connect there is refused."""

    def _listen(self) -> None:
        with socket.socket() as closed:
            closed.bind((self.me.address, 0))
            self.me = self.me._replace(port=closed.getsockname()[1])
        self.store.set(f"{self.prefix}listener/{self.index}", json.dumps(self.me._asdict()))


def check_all(nodes: int, kinds: dict[int, type[Reachability]], counts: dict[int, int] | None = None) -> dict:
    """Runs ``nodes`` nodes' checks side by side; returns each node's outcome (None or the error)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True, use_libuv=True)
    outcomes: dict[int, object] = {}

    def one(index: int) -> None:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
        store = CountingStore(client, counts, index) if counts is not None else client
        kind = kinds.get(index, Reachability)
        try:
            kind(store, PREFIX, index, nodes, f"node{index}", "lo", "127.0.0.1", hosts_store=index == 0).check()
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
    """Per node: its listener, its peers' listeners (one wait, one read), its results, two counters,
    one wait for everyone and one read of the failures: 8 operations (9 for the last to post), at 8
    nodes as at 64."""
    counts = {index: 0 for index in range(nodes)}
    started = time.monotonic()
    outcomes = check_all(nodes, {}, counts)
    assert outcomes == {index: None for index in range(nodes)}
    print(
        f"MEASURED: {nodes} nodes: {max(counts.values())} store operations per node, {time.monotonic() - started:.2f} s"
    )
    assert max(counts.values()) <= 9, counts


def test_a_node_its_peers_cannot_reach_stops_every_node_with_the_same_table():
    outcomes = check_all(4, {2: Unreachable})
    assert all(isinstance(outcome, PeersUnreachable) for outcome in outcomes.values()), outcomes
    texts = {str(outcome) for outcome in outcomes.values()}
    assert len(texts) == 1, texts  # every node says the same
    text = texts.pop()
    assert outcomes[0].exit_code == 2
    assert "peers cannot reach node2 where its workers will listen" in text, text
    header, *rows = [line.split() for line in text.splitlines() if line.lstrip().startswith(("node ", "node2 "))]
    assert header == ["node", "interface", "address", "peer", "result"], text
    assert sorted(row[3] for row in rows) == ["node1", "node3"], text  # its ring neighbours (node 0 probes 1 and 3)
    assert all(row[1] == "lo" and row[4:] == ["refused"] for row in rows), text
    assert "HINT: every node must reach every other on the interface phalanx picked" in text
    assert "--interface IFNAME" in text


def test_a_node_that_never_posts_is_said_within_the_bound(monkeypatch):
    """A node that met in the lobby and then died: the others do not wait past the bound."""
    monkeypatch.setattr(reachability, "ALL_POSTED_WAIT_S", 2.0)

    class Dead(Reachability):
        def check(self) -> None:
            raise RuntimeError("this node died after the lobby")

    started = time.monotonic()
    outcomes = check_all(3, {1: Dead})
    assert time.monotonic() - started < 2.0 + reachability.CONNECT_TIMEOUT_S + 5
    for index in (0, 2):
        assert isinstance(outcomes[index], JoinTimeout), outcomes
        assert "the nodes stopped answering before their workers started, while listening" in str(outcomes[index])
