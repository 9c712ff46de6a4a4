"""Where the seconds of a start went: from `phalanx run` to the first optimizer step, in phases,
with the slowest node named.

Each worker notes, at its first ``optimizer.step()``, when it called ``init_process_group``,
when that returned (:class:`~phalanx.launch.group_record.GroupWatch` times it) and when the
step ended, in ``start.json`` in its rank's log folder (:class:`FirstStepWatch`; torch's global
optimizer-step hook, registered once torch.optim is imported). Its node agent, which knows
when the launcher started, when the nodes met and when the workers were started, turns its
ranks' records into the node's phases (:func:`node_phases`), posts them on the store, and the
node that holds rank 0 prints one line for the job and writes every node's phases to
``start.json`` in the run's log folder. Each node's phases are differences of its own clock's
times: no two machines' clocks are compared.

The first start only: a restart's phases are those of the failure and the restart, which the
restart's own lines tell.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from phalanx.launch.import_hook import when_imported

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
#: How often a node looks for its ranks' records, and the node that holds rank 0 for the nodes'.
POLL_S = 0.25


class FirstStepWatch:
    """In a worker: writes its start record at the end of its first ``optimizer.step()``.

    Args:
        path: the record's path, in the rank's log folder.
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
        try:
            self.path.write_text(json.dumps(record))
        except OSError:
            pass  # the log folder is gone: the start goes unreported


def node_phases(times: dict[str, float], records: list[dict[str, Any]]) -> dict[str, float] | None:
    """A node's phases in seconds, from its agent's ``times`` (``launched``, ``agent``, ``met``,
    ``started``: Unix times) and its ranks' records; None where a rank formed no process group
    before its first step (a script that trains alone: nothing to break down)."""
    if not records or any(record.get("group_formed") is None for record in records):
        return None
    points = [
        times["launched"],
        times["agent"],
        times["met"],
        times["started"],
        max(record["group_began"] for record in records),
        max(record["group_formed"] for record in records),
        max(record["first_step"] for record in records),
    ]
    return {phase: max(0.0, end - begin) for phase, begin, end in zip(PHASES, points, points[1:])}


def start_line(nodes: list[dict[str, Any]]) -> str:
    """The one line of a start: the slowest node's total and phases.

    Args:
        nodes: each node's ``{"label", "phases"}``.
    """
    slowest = max(nodes, key=lambda node: sum(node["phases"].values()))
    phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in slowest["phases"].items())
    where = f" (slowest node: {slowest['label']})" if len(nodes) > 1 else ""
    return f"phalanx: start: {sum(slowest['phases'].values()):.1f} s to the first step{where}: {phases}"


class StartReporter:
    """In a node agent: waits, in a thread, for its ranks' start records; posts the node's phases
    (``post``), and where ``gather`` is given (the node that holds rank 0), gathers every node's,
    prints the line and writes the run's record.

    Args:
        times: the agent's ``launched``, ``agent`` and ``met`` times, and ``started`` (its
            workers' start).
        label: this node's name in messages.
        folders: this node's ranks' log folders.
        post: posts this node's ``{"label", "phases"}`` for the others; None for a single node.
        gather: every node's values once all are posted, else None at once; None on a node
            that does not hold rank 0.
        report: where the line goes (the console).
        run_dir: the run's log folder.
    """

    def __init__(
        self, times: dict[str, float], label: str, folders: list[Path], *,
        post: Callable[[dict[str, Any]], None] | None, gather: Callable[[], list[dict[str, Any]] | None] | None,
        report: Callable[[str], None], run_dir: Path,
    ) -> None:  # fmt: skip
        self.times, self.label, self.folders = times, label, folders
        self.post, self.gather, self.report, self.run_dir = post, gather, report, run_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-start", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        paths = [folder / START_RECORD_NAME for folder in self.folders]
        while not all(path.exists() for path in paths):
            if self._stop.wait(POLL_S):
                return
        try:
            phases = node_phases(self.times, [json.loads(path.read_text()) for path in paths])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if phases is None:
            return
        mine = {"label": self.label, "phases": phases}
        try:
            if self.post is not None:
                self.post(mine)
            nodes = [mine] if self.post is None else None
            while nodes is None and self.gather is not None:
                nodes = self.gather()
                if nodes is None and self._stop.wait(POLL_S):
                    return
        except Exception:  # the store went down with its node: the start goes unreported
            return
        if nodes and not self._stop.is_set():
            self.report(start_line(nodes))
            (self.run_dir / START_RECORD_NAME).write_text(json.dumps({"nodes": nodes}, indent=1) + "\n")
