"""Where the seconds of a start went: from `phalanx run` (or a later round's start) to the first
optimizer step, in phases, with the node the others waited for named (docs/launch-design.md)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from phalanx.launch.import_hook import when_imported
from phalanx.launch.restarts import raise_if_signal

#: The record's file name, in each rank's log folder and in the run's.
START_RECORD_NAME = "start.json"
#: The phases of a start, in order, with what each is the time from and to.
PHASES = (
    "launcher",  # `phalanx run` started -> its node agent is ready (imports torch, the plan)
    "lobby",  # -> the nodes met and agreed on their settings
    "rendezvous",  # -> torchrun's rendezvous gave this node's workers their ranks and started them
    "workers' start",  # -> the last rank called init_process_group (Python, imports, the script's setup)
    "process group",  # -> the last rank's init_process_group returned
    "first step",  # -> the last rank's first optimizer.step() ended (data, forward, backward, all-reduce)
)
#: The phases of a later round's start: from the start of the last look at the round before's
#: workers (the look that found one failed, or found a node waiting to join) on.
RESTART_PHASES = (
    "stopping",  # -> this round's rendezvous began (torch's agent stopped the other workers)
    "rendezvous",  # -> the round gave this node's workers their ranks and started them
    *PHASES[-3:],
)


@dataclass(frozen=True)
class StartKind:
    """A first start or a later round's: its name in the line, its phases, what its total counts
    from, and the run's record of it."""

    title: str
    phases: tuple[str, ...]
    since: str
    record_name: str


FIRST_START = StartKind("start", PHASES, "", START_RECORD_NAME)


def restart(attempt: int) -> StartKind:
    """The kind of a later round's start, this node's ``attempt`` (its count of rounds before, as
    its log folders number them): said as "restart N", recorded in the attempt's log folder."""
    title = f"restart {attempt}" if attempt else "restart"  # 0: a node's first round, not the job's
    return StartKind(
        title, RESTART_PHASES, " from the end of the round before", f"attempt_{attempt}/{START_RECORD_NAME}"
    )


#: How often a node looks for its ranks' records, and the node that holds rank 0 for the nodes'.
POLL_S = 0.25
#: After a job's workers finished: how long the node that holds rank 0 looks for the nodes'
#: phases, which each posted before it said it finished.
START_FINISH_S = 3.0
#: How long stopping waits for the thread's look in progress, and a finish for the lock.
STOP_WAIT_S = 2.0


class FirstStepWatch:
    """In a worker: writes its start record at the end of its first ``optimizer.step()``.

    Args:
        path: the record's path, in the rank's log folder (absolute: the script may change
            the working folder).
        group: the worker's :class:`~phalanx.launch.group_record.GroupWatch` (its ``began`` and
            ``formed`` times).
    """

    def __init__(self, path: Path, group: Any) -> None:
        self.path, self.group = path, group
        self._handle: Any = None

    def install(self) -> None:
        when_imported("torch.optim.optimizer", self._hook)

    def _hook(self, module: ModuleType) -> None:
        self._handle = module.register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, *_: object) -> None:
        if self._handle is None:
            return
        self._handle.remove()
        self._handle = None
        record = {"group_began": self.group.began, "group_formed": self.group.formed, "first_step": time.time()}
        written = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:  # whole or not at all: the launcher reads it while the worker trains on
            written.write_text(json.dumps(record))
            os.replace(written, self.path)
        except OSError:
            pass  # the log folder is gone: the start goes unreported


def process_started_at(pid: int) -> float:
    """When process ``pid`` started (Unix time), to the kernel's clock tick (psutil's ``create_time``,
    the fallback, may be up to a second early)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks_since_boot = int(fields[19])  # the 22nd field of stat(5), the first two cut off above
    except (OSError, ValueError, IndexError):
        import psutil

        return float(psutil.Process(pid).create_time())
    since_boot = ticks_since_boot / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def node_phases(
    times: dict[str, float], records: list[dict[str, Any]], phases: tuple[str, ...] = PHASES
) -> dict[str, float] | None:
    """A node's ``phases`` in seconds, from its agent's ``times`` (Unix times in order, ``started``
    last) and its ranks' records; None where a rank formed no process group before its first step."""
    if not records or any(record.get("group_formed") is None for record in records):
        return None
    points = [
        *times.values(),
        max(record["group_began"] for record in records),
        max(record["group_formed"] for record in records),
        max(record["first_step"] for record in records),
    ]
    assert len(points) == len(phases) + 1, (times, phases)
    return {phase: end - begin for phase, begin, end in zip(phases, points, points[1:])}


def start_line(nodes: list[dict[str, Any]], kind: StartKind = FIRST_START) -> str:
    """The one line of a start (``nodes``: each node's ``{"label", "phases"}``): the phases of the
    node whose start took longest, and the node the others waited for (the one that waited least)."""
    longest = max(nodes, key=lambda node: sum(node["phases"].values()))
    phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in longest["phases"].items())
    total = f"{sum(longest['phases'].values()):.1f} s{kind.since} to the first step"
    if len(nodes) == 1:
        return f"phalanx: {kind.title}: {total}: {phases}"
    last = min(nodes, key=_waiting)
    waited = ", which the other nodes waited for" if last is longest else f" (the nodes waited for {last['label']})"
    return f"phalanx: {kind.title}: {total} on {longest['label']}{waited}: {phases}"


def _waiting(node: dict[str, Any]) -> float:
    """How long a node waited for the others: in the lobby (the job's first start) or a later
    round's rendezvous, and for the process group."""
    phases = node["phases"]
    return phases.get("lobby", phases.get("rendezvous", 0.0)) + phases["process group"]


class StartReporter:
    """In a node agent: looks, from a thread, for its ranks' start records; posts the node's
    phases once they are in, and on the node that holds rank 0, gathers every node's, says the
    line and writes the run's record.

    Args:
        times: the agent's points of the start (Unix times, in order; :func:`node_phases`),
            the workers' start, ``started``, last.
        label: this node's name in messages.
        folders: this node's ranks' log folders.
        post: posts this node's ``{"label", "phases"}`` for the others; None for a single node.
        gather: every node's values once all are posted, else None at once; None on a node
            that does not hold rank 0.
        report: where the line goes (the console).
        run_dir: the run's log folder.
        kind: which start it is (``times`` holds its points).
    """

    def __init__(
        self, times: dict[str, float], label: str, folders: list[Path], *,
        post: Callable[[dict[str, Any]], None] | None, gather: Callable[[], list[dict[str, Any]] | None] | None,
        report: Callable[[str], None], run_dir: Path, kind: StartKind = FIRST_START,
    ) -> None:  # fmt: skip
        self.times, self.label, self.folders, self.kind = times, label, folders, kind
        self.post, self.gather, self.report, self.run_dir = post, gather, report, run_dir
        self._mine: dict[str, Any] | None = None
        self._done = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-start", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread: it ends after its current look, whose store call is waited for at
        most :data:`STOP_WAIT_S` here (a store that went away holds it longer)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_WAIT_S)

    def finish(self, timeout: float) -> None:
        """After this node's workers finished: stops the thread, then looks again until done or
        ``timeout`` seconds passed. A record missing now never comes: the node posts that it
        has none (its ranks never stepped an optimizer), and no line is said."""
        self.stop()
        deadline = time.monotonic() + timeout
        while self._lock.acquire(timeout=max(0.0, deadline - time.monotonic()) + STOP_WAIT_S):
            try:
                if self._look(final=True) or time.monotonic() >= deadline:
                    return
            finally:
                self._lock.release()
            time.sleep(POLL_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._look(final=False):
                    return
            self._stop.wait(POLL_S)

    def _look(self, final: bool) -> bool:
        """One look, under the lock (``final``: a missing record never comes); True when nothing is
        left to do."""
        if not self._done:
            try:
                self._done = self._next(final)
            except Exception as error:  # the store went down with its node: the start goes unreported
                raise_if_signal(error)
                self._done = True
        return self._done

    def _next(self, final: bool) -> bool:
        if self._mine is None:
            records = self._records()
            if records is None and not final:
                return False
            phases = node_phases(self.times, records, self.kind.phases) if records else None
            self._mine = {"label": self.label, "phases": phases}
            if self.post is not None:
                self.post(self._mine)
        if self.post is None:
            nodes: list[dict[str, Any]] | None = [self._mine]
        elif self.gather is None:
            return True
        else:
            nodes = self.gather()
            if nodes is None:
                return False
        if all(node["phases"] is not None for node in nodes):  # else a node's ranks formed no group
            self.report(start_line(nodes, self.kind))
            with contextlib.suppress(OSError):
                (self.run_dir / self.kind.record_name).write_text(json.dumps({"nodes": nodes}, indent=1) + "\n")
        return True

    def _records(self) -> list[dict[str, Any]] | None:
        """Every rank's record of this start, or None while one is missing."""
        records = []
        for folder in self.folders:
            try:
                record = json.loads((folder / START_RECORD_NAME).read_text())
            except (OSError, ValueError):
                return None
            if not isinstance(record, dict) or not record.get("first_step", 0) >= self.times["started"]:
                return None  # not this start's
            records.append(record)
        return records
