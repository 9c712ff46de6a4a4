"""The lobby on a real TCPStore over loopback: nodes are threads here, the sockets are real."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from torch.distributed import TCPStore

from phalanx.errors import JoinTimeout, NodesDisagree, SettingsRefused
from phalanx.launch.lobby import Lobby, Meeting, store_client
from phalanx.launch.node_setup import NodeSetup
from tests.unit.node_setups import CountingStore, free_port, node


def fingerprint(setup: NodeSetup, **changes) -> dict[str, str]:
    base = {"nnodes": "2", "nproc-per-node": str(setup.nproc_per_node), "backend": "gloo", "script": "train.py",
            "script sha256": "0" * 64, "phalanx": "0.1.0", "torch": "2.13.0"}  # fmt: skip
    return {**base, **changes}


def join_all(lobbies: list[Lobby], watch: int = 0, seconds: float = 30) -> list[object]:
    results: list[object] = [None] * len(lobbies)

    def join(i: int) -> None:
        try:
            results[i] = lobbies[i].join(watch)
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(lobbies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds)
    assert not any(t.is_alive() for t in threads), f"a lobby did not return within {seconds} s"
    return results


def test_nodes_that_agree_meet():
    port = free_port()
    setups = [node(0, port), node(1, port)]
    results = join_all([Lobby(p, fingerprint(p)) for p in setups], watch=2)
    assert all(isinstance(r, Meeting) and r.count == 2 for r in results), results
    assert sorted(r.index for r in results) == [0, 1]
    assert [r.watched for r in results] == [["node1"], ["node0"]]  # the other one: a ring of two


def test_the_one_node_of_many_that_differs_is_named_to_every_node():
    """Each node compares itself with the first that joined: equal to the first, all are equal. The
    one that differs is named, with what differs, to every node."""
    port = free_port()
    setups = [
        node(0, port, nnodes_min=6, nnodes_max=6),
        *(node(i, port, nnodes_min=6, nnodes_max=6) for i in range(1, 6)),
    ]
    prints = [fingerprint(setup) for setup in setups]
    prints[4] = fingerprint(setups[4], torch="2.12.0")
    results = join_all([Lobby(setup, fp) for setup, fp in zip(setups, prints)])
    for result in results:
        assert isinstance(result, NodesDisagree), result
        assert "torch" in result.why and "127.0.0.105 (node4)" in result.why and "2.12.0" in result.why, result.why


def test_every_node_stops_on_a_difference():
    port = free_port()
    setups = [node(0, port), node(1, port, nproc_per_node=2)]
    results = join_all([Lobby(p, fingerprint(p)) for p in setups])
    for result in results:
        assert isinstance(result, NodesDisagree), result
        assert "nproc-per-node" in result.why and "127.0.0.101 (node0)" in result.why and "127.0.0.102" in result.why


def test_nodes_with_different_heartbeat_timeouts_are_refused():
    """A node beating every 5 s (--heartbeat-timeout 30) would be lost at once to a watcher that
    allows 3 s: the bound is compared like the node count."""
    from phalanx.launch.fingerprint import node_fingerprint

    port = free_port()
    setups = [node(0, port), node(1, port, heartbeat_timeout=3.0)]
    results = join_all([Lobby(setup, node_fingerprint(setup)) for setup in setups])
    for result in results:
        assert isinstance(result, NodesDisagree), result
        header, row = result.why.splitlines()[:2]
        columns = re.split(r"  +", header.strip())
        values = dict(zip(columns, re.split(r"  +", row.strip())))
        assert values["setting"] == "heartbeat-timeout", result.why
        assert values["127.0.0.101 (node0)"] == "30" and values["127.0.0.102 (node1)"] == "3", result.why


def test_the_first_node_to_give_up_takes_the_others_with_it():
    """A job of 3 whose third node never comes: the node whose join timeout passes first decides
    that the job cannot form, and the other node that joined gives up with it, naming it."""
    port = free_port()
    setups = [node(0, port, nnodes_min=3, nnodes_max=3, join_timeout=1.0),
              node(1, port, nnodes_min=3, nnodes_max=3, join_timeout=30.0)]  # fmt: skip
    started = time.monotonic()
    results = join_all([Lobby(setup, fingerprint(setup)) for setup in setups])
    assert time.monotonic() - started < 10  # not node1's 30 s
    assert all(isinstance(result, JoinTimeout) and "only 2 of 3 nodes joined" in result.what for result in results)
    assert "node0's wait ended first" in results[1].why and "wait ended first" not in results[0].why


def test_a_node_that_differs_from_an_elastic_job_that_formed_stops_alone():
    """An elastic job (1 to 3 nodes) formed with its first node; a second node started with other
    settings stops itself, and the job's outcome stays: a third, agreeing node joins it."""
    port = free_port()
    first = node(0, port, nnodes_min=1, nnodes_max=3)
    host = Lobby(first, fingerprint(first))  # kept: the store goes down with its lobby
    [met] = join_all([host])
    assert isinstance(met, Meeting) and met.count == 1
    odd = node(1, port, nnodes_min=1, nnodes_max=3)
    [refused] = join_all([Lobby(odd, fingerprint(odd, torch="2.12.0"))])
    assert isinstance(refused, NodesDisagree) and "already runs with" in refused.what and "2.12.0" in refused.why
    late = node(2, port, nnodes_min=1, nnodes_max=3)
    [joined] = join_all([Lobby(late, fingerprint(late))])
    assert isinstance(joined, Meeting) and joined.count == 3


def test_a_job_of_a_fixed_size_refuses_a_node_too_many_and_an_elastic_job_takes_one_that_comes_back():
    """An elastic job's node that was lost joins again (the lobby counted it once already): torch's
    rendezvous admits at most MAX nodes to a round. A job of a fixed size has no place for it."""
    for nnodes, refused in ((2, True), (3, False)):
        port = free_port()
        setups = [node(index, port, nnodes_min=2, nnodes_max=nnodes) for index in range(nnodes)]
        lobbies = [Lobby(setup, fingerprint(setup)) for setup in setups]  # kept: the store goes down with the host's
        assert all(isinstance(met, Meeting) for met in join_all(lobbies))
        again = node(nnodes, port, nnodes_min=2, nnodes_max=nnodes)
        [result] = join_all([Lobby(again, fingerprint(again))])
        if refused:
            assert isinstance(result, NodesDisagree) and "one too many" in result.what, result
        else:
            assert isinstance(result, Meeting) and result.count == 3, result


def test_a_lonely_host_times_out_naming_who_joined():
    setup = node(0, free_port(), join_timeout=1.0)
    [result] = join_all([Lobby(setup, fingerprint(setup))])
    assert isinstance(result, JoinTimeout)
    assert "only 1 of 2 nodes joined" in result.what and "joined: 127.0.0.101 (node0)" in result.why
    assert "accepted" in result.why  # the direct connect reached the store


def test_a_node_without_its_host_times_out_with_the_connect_result():
    setup = node(1, free_port(), join_timeout=1.0)
    [result] = join_all([Lobby(setup, fingerprint(setup))])
    assert isinstance(result, JoinTimeout)
    assert "did not answer within 1 s" in result.what and "refused" in result.why


def test_the_host_port_already_taken():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        setup = node(0, taken.getsockname()[1])
        with pytest.raises(SettingsRefused, match="cannot listen on port"):
            Lobby(setup, fingerprint(setup)).join()


def test_progress_is_reported_while_waiting(monkeypatch, capsys):
    from phalanx.launch import lobby

    monkeypatch.setattr(lobby, "PROGRESS_EVERY_S", 0.3)
    setup = node(0, free_port(), join_timeout=1.5)
    join_all([Lobby(setup, fingerprint(setup))])
    err = capsys.readouterr().err
    assert "phalanx: waiting for nodes (" in err and "1 of 2 joined: 127.0.0.101" in err


@pytest.mark.parametrize("nodes", [8, 64])
def test_a_node_does_the_same_store_operations_to_meet_in_a_job_of_any_size(nodes, monkeypatch):
    """Each node takes its place, writes and compares its fingerprint (with the first node's), says
    it agrees, waits once for the word that the nodes met, and reads the two nodes it will watch:
    at most 11 store operations, at 8 nodes as at 64 (reading every node's fingerprint, as the
    lobby did, was 64 and more at 64 nodes, polled every 20 ms). The nodes are threads of this
    process; the store is real, and hosted by the test, so that every node's operations count."""
    from phalanx.launch import lobby

    monkeypatch.setattr(lobby, "PROGRESS_EVERY_S", 1000.0)  # a progress line reads the count: none here
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True, use_libuv=True)
    setups = [node(index, server.port, nnodes_min=nodes, nnodes_max=nodes, is_host=False, join_timeout=120.0)
              for index in range(nodes)]  # fmt: skip
    counts = {setup.node_label: 0 for setup in setups}

    def counted(me: str):
        return lambda host, port, timeout_s: CountingStore(store_client(host, port, timeout_s), counts, me)

    lobbies = [
        Lobby(setup, fingerprint(setup, nnodes=str(nodes)), connect=counted(setup.node_label)) for setup in setups
    ]
    results = join_all(lobbies, watch=2, seconds=120)
    assert all(isinstance(r, Meeting) and r.count == nodes and len(r.watched) == 2 for r in results), results
    order = {r.index: lobbies[i].setup.node_label for i, r in enumerate(results)}
    assert all(r.watched == [order[(r.index + 1) % nodes], order[(r.index + 2) % nodes]] for r in results)
    print(f"MEASURED: {nodes} nodes: store operations per node to meet, at most {max(counts.values())}")
    assert max(counts.values()) <= 11, counts
