"""The node agents' liveness watch (phalanx.launch.liveness) on a real TCPStore, with beats of
0.1 s: a node that stops beating is lost, one that said it ended is not, and a store that stops
answering is its host lost.

A node is lost after 2 s without a beat here: 20 missed beats, as the real bound's 30 s are six,
so that a thread the loaded machine does not run for a while is not taken for a lost node."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from phalanx.launch.liveness import Liveness

PREFIX = "phalanx/job/"
BEAT_S, LOST_AFTER_S = 0.1, 2.0


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5),
                      use_libuv=True)  # fmt: skip
    yield server
    del server


class Watch:
    """A Liveness for one node; ``lost`` is set with its reason when it declares one lost."""

    def __init__(self, port: int, me: str, nodes: list[str], ended: set[str] | None = None) -> None:
        self.why: list[str] = []
        self.lost = threading.Event()
        self.liveness = Liveness("127.0.0.1", port, PREFIX, me, nodes, ended=lambda _store: ended or set(),
                                 on_lost=self._on_lost, beat_s=BEAT_S, lost_after_s=LOST_AFTER_S)  # fmt: skip
        self.liveness.start()

    def _on_lost(self, why: str, store_lost: bool) -> None:
        self.why.append(why)
        self.store_lost = store_lost
        self.lost.set()


def test_a_node_that_stops_beating_is_lost_within_the_bound_and_named(store):
    a, b = Watch(store.port, "a", ["a", "b"]), Watch(store.port, "b", ["a", "b"])
    try:
        time.sleep(LOST_AFTER_S + 5 * BEAT_S)
        assert not a.lost.is_set() and not b.lost.is_set()  # both beat: nobody is lost
        stopped = time.monotonic()
        b.liveness.stop()
        assert a.lost.wait(timeout=LOST_AFTER_S + 10)
        # not at its next look: b's last beat may have come a while before it stopped, if the
        # machine left b's thread waiting, hence half the bound
        assert LOST_AFTER_S / 2 <= time.monotonic() - stopped
        assert a.why[0].startswith("node b sent no sign of life for ") and not a.store_lost
    finally:
        a.liveness.stop()
        b.liveness.stop()


def test_a_node_that_said_it_ended_is_not_lost(store):
    a = Watch(store.port, "a", ["a", "b"], ended={"b"})  # b never beats: its workers finished
    try:
        assert not a.lost.wait(timeout=LOST_AFTER_S + 5 * BEAT_S)
    finally:
        a.liveness.stop()


def test_a_store_that_stops_answering_is_its_host_lost():
    """A listener that accepts and never answers: the store's host as a cut link leaves it."""
    silent = socket.create_server(("127.0.0.1", 0))
    a = Watch(silent.getsockname()[1], "a", ["a", "b"])
    try:
        assert a.lost.wait(timeout=LOST_AFTER_S + 4 * BEAT_S + 10)
        assert a.why[0].startswith("the store's host 127.0.0.1 did not answer for ") and a.store_lost
    finally:
        a.liveness.stop()
        silent.close()
