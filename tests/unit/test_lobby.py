"""The lobby on a real TCPStore over loopback: nodes are threads here, the sockets are real."""

from __future__ import annotations

import socket
import threading

import pytest

from phalanx.errors import JoinTimeout, NodesDisagree, SettingsRefused
from phalanx.launch.lobby import Lobby
from phalanx.launch.node_setup import NodeSetup
from tests.unit.node_setups import free_port, node


def fingerprint(setup: NodeSetup, **changes) -> dict[str, str]:
    base = {"nnodes": "2", "nproc-per-node": str(setup.nproc_per_node), "backend": "gloo", "script": "train.py",
            "script sha256": "0" * 64, "phalanx": "0.1.0", "torch": "2.13.0"}  # fmt: skip
    return {**base, **changes}


def join_all(lobbies: list[Lobby]) -> list[object]:
    results: list[object] = [None] * len(lobbies)

    def join(i: int) -> None:
        try:
            results[i] = lobbies[i].join()
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(lobbies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a lobby did not return within 30 s"
    return results


def test_nodes_that_agree_meet():
    port = free_port()
    setups = [node(0, port), node(1, port)]
    results = join_all([Lobby(p, fingerprint(p)) for p in setups])
    assert all(isinstance(r, list) and len(r) == 2 for r in results), results
    assert {fp["address"] for fp in results[0]} == {"127.0.0.101", "127.0.0.102"}


def test_every_node_stops_on_a_difference():
    port = free_port()
    setups = [node(0, port), node(1, port, nproc_per_node=2)]
    results = join_all([Lobby(p, fingerprint(p)) for p in setups])
    for result in results:
        assert isinstance(result, NodesDisagree), result
        assert "nproc-per-node" in result.why and "127.0.0.101 (node0)" in result.why and "127.0.0.102" in result.why


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
