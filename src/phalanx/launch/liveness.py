"""Notices a node that is gone: each node agent beats on the rendezvous store, and watches the
beats of the next :data:`WATCHED` nodes in the ring of the job's nodes (docs/launch-design.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from phalanx.launch.lobby import store_client
from phalanx.launch.restarts import raise_if_signal
from phalanx.settings.values import DEFAULT_HEARTBEAT_TIMEOUT_S

#: Beats per timeout: six missed beats, far above a busy machine's scheduling delay.
BEATS_PER_TIMEOUT = 6
#: The shortest wait for one store operation (a reconnection after each slow answer costs more).
MIN_STORE_TIMEOUT_S = 1.0
#: The nodes each node watches, the next ones in the ring: two, so that a node is still watched
#: when the node before it is lost with it.
WATCHED = 2


def beat_of(timeout_s: float) -> float:
    """Seconds between a node's beats for a heartbeat timeout of ``timeout_s``."""
    return timeout_s / BEATS_PER_TIMEOUT


class Liveness:
    """Beats for ``me`` and watches the beats of the nodes ``watched`` (their labels: the next
    :data:`WATCHED` nodes in the order of the lobby, :class:`phalanx.launch.lobby.Meeting`) on the
    store at ``host:port``; calls ``on_lost(why, store_lost, heard)`` from its own thread when one
    is lost (``store_lost``: the one lost is the store's host, which this node can no longer
    reach; ``heard``: another node's watch said so, in ``verdicts(store)``, its lines
    ``"NODE: why"``). ``ended(store)`` names the nodes that said they ended, which are no longer
    expected to beat.

    Once only, unless ``keep_watching`` (heal mode, where the job goes on): then a node declared
    lost is judged again once it beats again, the store once it answered again, and a verdict
    heard once; ``on_back(node)`` is called when a node declared lost beats again.

    Two threads: one talks to the store (and may block for good), the other judges and never blocks.
    """

    def __init__(
        self, host: str, port: int, prefix: str, me: str, watched: Sequence[str], *,
        ended: Callable[[Any], set[str]], on_lost: Callable[[str, bool, bool], None],
        verdicts: Callable[[Any], list[str]] = lambda _store: [],
        beat_s: float = beat_of(DEFAULT_HEARTBEAT_TIMEOUT_S), lost_after_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        store_host: str = "",
        connect: Callable[[str, int, float], Any] = store_client,
        keep_watching: bool = False, on_back: Callable[[str], object] = lambda _node: None,
    ) -> None:  # fmt: skip
        self.host, self.port, self.prefix, self.me = host, port, prefix, me
        self.others = list(watched)
        self.connect = connect
        self.ended, self.on_lost, self.verdicts = ended, on_lost, verdicts
        self.beat_s, self.lost_after_s = beat_s, lost_after_s
        self.store_timeout_s = max(beat_s, MIN_STORE_TIMEOUT_S)
        self.store_host = store_host or host
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        started = time.monotonic()
        self._last_round = started  # when the store last answered a whole round
        self._seen = {node: (-1, started) for node in self.others}  # counter, and when it last moved
        self._ended: set[str] = set()
        self._heard: list[str] = []
        self.keep_watching, self.on_back = keep_watching, on_back
        self._declared: dict[str, int] = {}  # a node declared lost -> its count then
        self._store_declared: float | None = None  # the last round the store answered, when declared lost
        self._heard_used = 0  # the verdicts heard and acted on already

    def start(self) -> None:
        for target, name in ((self._beat, "phalanx-beat"), (self._watch, "phalanx-liveness")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stops both threads and waits for them, at most a store call's timeout: a thread still in a
        store call at interpreter exit aborts the process, and the launcher's exit code is lost."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.store_timeout_s + 1.0)

    def _key(self, node: str) -> str:
        return f"{self.prefix}alive/{node}"

    def _beat(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:  # connected (again) here: a reset link broke the last connection
                    store = self.connect(self.host, self.port, self.store_timeout_s)
                store.add(self._key(self.me), 1)
                counts = {node: store.add(self._key(node), 0) for node in self.others}
                ended = self.ended(store) if self._a_watched_node_is_quiet() else None
                heard = self.verdicts(store)
            except Exception as error:
                raise_if_signal(error)
                store = None
            else:
                self._record(counts, ended, heard)
            self._stop.wait(self.beat_s)

    def _a_watched_node_is_quiet(self) -> bool:
        """Whether a watched node missed two beats: only then is it worth reading who ended (three
        keys), which excuses a node's silence; a live job's beat is four operations."""
        quiet_after = min(2 * self.beat_s, self.lost_after_s / 2)
        with self._lock:
            return any(self._last_round - moved >= quiet_after for _, moved in self._seen.values())

    def _record(self, counts: dict[str, int], ended: set[str] | None, heard: list[str]) -> None:
        now = time.monotonic()
        back = []
        with self._lock:
            self._last_round, self._heard = now, heard
            if ended is not None:  # else as last read
                self._ended = ended
            for node, count in counts.items():
                if count != self._seen[node][0]:
                    self._seen[node] = (count, now)
                    if self._declared.pop(node, None) is not None:  # it beats again: judged afresh
                        back.append(node)
        for node in back:
            self.on_back(node)

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            lost = self._judge(time.monotonic())
            if lost is not None and not self._stop.is_set():
                if self.keep_watching:  # as judged: on_lost may take minutes
                    self._set_aside(lost)
                self.on_lost(*lost)
                if not self.keep_watching:
                    return

    def _set_aside(self, lost: tuple[str, bool, bool]) -> None:
        """Keeps what was just declared lost from being declared again before it is back."""
        why, store_lost, heard = lost
        with self._lock:
            self._heard_used = len(self._heard) if heard else self._heard_used
            if store_lost:
                self._store_declared = self._last_round
            elif not heard:
                node = silent_node(why)
                self._declared[node] = self._seen[node][0]

    def _judge(self, now: float) -> tuple[str, bool, bool] | None:
        """Why a node counts as lost now, whether it is the store's host, and whether another
        node's watch said so; or None."""
        with self._lock:
            if now - self._last_round >= self.lost_after_s and self._store_declared != self._last_round:
                return (
                    f"the store's host {self.store_host} did not answer for {now - self._last_round:.0f} s",
                    True,
                    False,
                )
            for node, (count, moved) in self._seen.items():
                # silent over rounds the store answered: a store that stopped answering is judged
                # above, never as the silence of the nodes it would have shown
                if node in self._ended or self._declared.get(node) == count:
                    continue
                if self._last_round - moved >= self.lost_after_s:
                    return f"{_SILENT}{node} sent no sign of life for {now - moved:.0f} s", False, False
            for line in self._heard[self._heard_used :]:
                watcher, _, why = line.partition(": ")
                if watcher != self.me:
                    return f"{why} (seen by {watcher})", False, True
        return None


#: How a node's verdict about a silent node begins: "node LABEL sent no sign of life for N s".
_SILENT = "node "


def silent_node(why: str) -> str:
    """The node a verdict ``why`` of this module's declares silent (its label)."""
    return why.removeprefix(_SILENT).split(" ", 1)[0]
