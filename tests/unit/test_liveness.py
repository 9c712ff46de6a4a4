"""The node agents' liveness watch (phalanx.launch.liveness) on a real TCPStore, with beats of
0.1 s: a node that stops beating is lost, one that said it ended is not, and a store that stops
answering is its host lost.

A node is lost after 2 s without a beat here: 20 missed beats, as the real bound's 30 s are six,
so that a thread the loaded machine does not run for a while is not taken for a lost node."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from phalanx.launch.crossnode import CrossNode
from phalanx.launch.liveness import Liveness

PREFIX = "phalanx/job/"
BEAT_S, LOST_AFTER_S = 0.1, 2.0
#: The keys a node reads to learn who ended (phalanx.launch.crossnode).
WHO_ENDED = ("finished", "ended", "failures")


class OperationsByKind:
    """A node's store client that counts its operations by kind, in one place, so that any two
    counts are at most a beat apart: its beats, its reads of who ended, and the rest."""

    def __init__(self, store: Any, me: str) -> None:
        # every kind counted from the start: a copy never meets a key added meanwhile
        self.store, self.me, self.kinds = store, me, Counter({"beat": 0, "who ended": 0, "watch": 0})

    def __getattr__(self, name: str) -> object:
        operation = getattr(self.store, name)

        def counted(*args: Any) -> object:
            self.kinds[self._kind(name, args)] += 1
            return operation(*args)

        return counted

    def _kind(self, name: str, args: tuple) -> str:
        if name == "add" and args == (f"{PREFIX}alive/{self.me}", 1):
            return "beat"
        if name == "check" and args[0][0].endswith(WHO_ENDED):
            return "who ended"
        return "watch"


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5),
                      use_libuv=True)  # fmt: skip
    yield server
    del server


class Watch:
    """A Liveness for one node; ``lost`` is set with its reason when it declares one lost."""

    def __init__(self, port: int, me: str, watched: list[str], ended: set[str] | None = None,
                 verdicts: list[str] | None = None, keep_watching: bool = False) -> None:  # fmt: skip
        self.why: list[str] = []
        self.lost = threading.Event()
        self.liveness = Liveness("127.0.0.1", port, PREFIX, me, watched, ended=lambda _store: ended or set(),
                                 verdicts=lambda _store: verdicts or [], on_lost=self._on_lost, beat_s=BEAT_S,
                                 lost_after_s=LOST_AFTER_S, keep_watching=keep_watching)  # fmt: skip
        self.liveness.start()

    def _on_lost(self, why: str, store_lost: bool, _heard: bool) -> None:
        self.why.append(why)
        self.store_lost = store_lost
        self.lost.set()


def test_a_node_that_stops_beating_is_lost_within_the_bound_and_named(store):
    a, b = Watch(store.port, "a", ["b"]), Watch(store.port, "b", ["a"])
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
    a = Watch(store.port, "a", ["b"], ended={"b"})  # b never beats: its workers finished
    try:
        assert not a.lost.wait(timeout=LOST_AFTER_S + 5 * BEAT_S)
    finally:
        a.liveness.stop()


def test_a_store_that_stops_answering_is_its_host_lost():
    """A listener that accepts and never answers: the store's host as a cut link leaves it."""
    silent = socket.create_server(("127.0.0.1", 0))
    a = Watch(silent.getsockname()[1], "a", ["b"])
    try:
        assert a.lost.wait(timeout=LOST_AFTER_S + 4 * BEAT_S + 10)
        assert a.why[0].startswith("the store's host 127.0.0.1 did not answer for ") and a.store_lost
    finally:
        a.liveness.stop()
        silent.close()


def test_kept_watching_a_node_is_declared_lost_once_per_silence_and_again_after_it_came_back(store):
    """Heal mode: the job goes on after a lost node, and so does the watch."""
    a, b = Watch(store.port, "a", ["b"], keep_watching=True), Watch(store.port, "b", ["a"])
    try:
        b.liveness.stop()
        assert a.lost.wait(timeout=LOST_AFTER_S + 10)
        a.lost.clear()
        assert not a.lost.wait(timeout=LOST_AFTER_S + 5 * BEAT_S), a.why  # still silent: not declared again
        b = Watch(store.port, "b", ["a"])  # back: its count moves again
        time.sleep(LOST_AFTER_S)  # 20 of a's reads of b's count, which a beat moved
        assert not a.lost.is_set(), a.why
        b.liveness.stop()
        assert a.lost.wait(timeout=LOST_AFTER_S + 10)
        assert len(a.why) == 2 and all(why.startswith("node b sent no sign of life for ") for why in a.why), a.why
    finally:
        a.liveness.stop()
        b.liveness.stop()


def test_kept_watching_a_verdict_is_heard_once(store):
    """A verdict stays on the store: it is news once."""
    b = Watch(store.port, "b", [], verdicts=["a: node c sent no sign of life for 3 s"], keep_watching=True)
    try:
        assert b.lost.wait(timeout=10)
        b.lost.clear()
        assert not b.lost.wait(timeout=20 * BEAT_S)
        assert b.why == ["node c sent no sign of life for 3 s (seen by a)"]
    finally:
        b.liveness.stop()


@pytest.mark.parametrize("nodes", [8, 64])
def test_a_node_does_the_same_store_operations_per_beat_in_a_job_of_any_size(store, nodes):
    """Each node beats, reads its two watched peers' beats and the verdicts: 4 operations a beat at
    8 nodes as at 64 (watching every node would be 66 at 64). It reads who ended too (3 more, as
    the agent reads them, phalanx.launch.crossnode), but only while a watched node is two beats
    late, which on a loaded machine is any node now and then: those are counted apart, and are at
    most 3 a beat. A lost node is named by its watchers, whose verdict every other node then
    hears. 64 nodes are 128 threads of this one process here, whose beats a loaded machine delays
    by seconds: their operations are counted, and only the 8 nodes' watch is timed, once every
    node beats (its bound is then lowered from 600 s to 15 s: the first connections of many nodes
    at once on a loaded machine take longer than that)."""
    beat_s = 0.2
    labels = [f"n{index:03d}" for index in range(nodes)]
    clients: dict[str, OperationsByKind] = {}
    lost: dict[str, tuple[str, bool]] = {}

    def watch(me: str) -> Liveness:
        def connect(host: str, port: int, _timeout_s: float) -> OperationsByKind:
            # 64 connections at once on a loaded machine take longer than a beat
            clients[me] = OperationsByKind(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10),
                                                    use_libuv=True), me)  # fmt: skip
            return clients[me]

        said = CrossNode(store, PREFIX, me)  # what the agent posts and reads (its own store: not counted)

        def on_lost(why: str, _store_lost: bool, heard: bool) -> None:
            lost[me] = (why, heard)
            if not heard:
                said.post_lost(why)

        ring = [labels[(labels.index(me) + step) % nodes] for step in (1, 2)]  # as the lobby names them
        liveness = Liveness("127.0.0.1", store.port, PREFIX, me, ring, ended=said.ended_nodes, on_lost=on_lost,
                            verdicts=said.lost_verdicts, beat_s=beat_s, lost_after_s=600.0,
                            connect=connect)  # fmt: skip
        liveness.start()
        return liveness

    def beats() -> dict[str, int]:
        return {label: store.add(f"{PREFIX}alive/{label}", 0) for label in labels}

    watches = {label: watch(label) for label in labels}
    try:
        # A node read in the middle of a beat is off by at most a beat's operations: over 20
        # beats, by at most 0.2 an operation a beat.
        deadline = time.monotonic() + 120
        while min(beats().values()) < 20 and time.monotonic() < deadline:
            time.sleep(beat_s)
        kinds = {label: Counter(clients[label].kinds) for label in labels}
        per_beat = {label: (k["beat"] + k["watch"]) / max(k["beat"], 1) for label, k in kinds.items()}
        assert min(k["beat"] for k in kinds.values()) >= 20, kinds
        assert all(3.8 <= ops <= 4.2 for ops in per_beat.values()), per_beat
        assert all(k["who ended"] <= 3 * (k["beat"] + 1) for k in kinds.values()), kinds
        assert not lost
        if nodes > 8:
            return
        lost_after_s = 15.0
        for liveness in watches.values():
            liveness.lost_after_s = lost_after_s
        gone = labels[nodes // 2]  # a node in the middle stops beating
        watches[gone].stop()
        deadline = time.monotonic() + lost_after_s + 30
        while len(lost) < nodes - 1 and time.monotonic() < deadline:
            time.sleep(beat_s)
        assert set(lost) == set(labels) - {gone}, lost  # every other node stops its workers
        watchers = {me for me, (_, heard) in lost.items() if not heard}
        assert watchers <= set(labels[nodes // 2 - 2 : nodes // 2]) and watchers, lost  # its two watchers
        assert all(why.startswith(f"node {gone} sent no sign of life") for why, _ in lost.values()), lost
        assert all("(seen by n00" in why for why, heard in lost.values() if heard), lost
    finally:
        for liveness in watches.values():
            liveness.stop()
