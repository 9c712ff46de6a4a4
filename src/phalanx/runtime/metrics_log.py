"""Metrics files: JSON Lines (always available) and TensorBoard (when it is installed).

Rank 0 writes; one JSON object per logged step, flushed at once, so ``tail -f`` and a crash
both see every finished line. A run that continues from step S (a resume after a crash or a
preemption) first drops the records after S that the interrupted run wrote, and a torn last
line: those steps are trained and logged again, and the file then reads as one uninterrupted
run, with every step once.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any


class JsonlMetrics:
    """A JSON Lines metrics file, one object per record; a resumed run continues it."""

    def __init__(self, path: str | Path, continue_from_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dropped = drop_records_after(self.path, continue_from_step)
        if dropped:
            print(f"phalanx: metrics file {self.path}: dropped {dropped} record(s) after step {continue_from_step}, "
                  "which this run trains and logs again", file=sys.stderr)  # fmt: skip
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Appends ``record`` as one line, flushed; NaN and infinities become null."""
        clean = {
            key: (None if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in record.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites ``path`` (atomically) without records after ``step`` or unreadable lines; the count dropped."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if _step_of(line) <= step]
    dropped = len(lines) - len(kept)
    if dropped:
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(temporary, path)
    return dropped


def _step_of(line: str) -> float:
    """The record's step; infinity for a line that is not a record (the torn end of a killed run)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return math.inf
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, (int, float)) else math.inf


class TensorBoardMetrics:
    """Every number of a record as a scalar, at the record's step."""

    def __init__(self, directory: str | Path, continue_from_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        # purge_step: TensorBoard hides the events an earlier run left after it (all of them for a
        # fresh run, as the JSONL file starts over; those after the checkpoint for a resumed one).
        self._writer = SummaryWriter(str(directory), purge_step=continue_from_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        """Writes every number of ``record`` as a scalar at its step, then flushes."""
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        """Closes the event writer."""
        self._writer.close()


class MetricsLog:
    """The metrics files a run asked for, written on rank 0 only (``enabled=False`` elsewhere).

    TensorBoard asked for but not installed is a notice, not a failure: training goes on and
    the JSON Lines file (when asked for) has the same numbers.

    Args:
        jsonl: a JSON Lines file to write; None: none.
        tensorboard: a folder for TensorBoard events; None: none.
        continue_from_step: the step a resumed run continues from: the records after it
            (which the interrupted run wrote, and this one logs again) are dropped; 0 for a
            fresh run.
        enabled: False on every rank but 0: it writes nothing.

    Example::

        metrics = phalanx.MetricsLog(jsonl="metrics.jsonl", enabled=context.is_main)
        metrics.write({"step": 10, "loss": 0.42})
        metrics.close()
    """

    def __init__(
        self, *, jsonl: str | Path | None = None, tensorboard: str | Path | None = None, continue_from_step: int = 0,
        enabled: bool = True,
    ) -> None:  # fmt: skip
        self._sinks: list[JsonlMetrics | TensorBoardMetrics] = []
        if not enabled:
            return
        if jsonl is not None:
            self._sinks.append(JsonlMetrics(jsonl, continue_from_step))
        if tensorboard is not None:
            try:
                self._sinks.append(TensorBoardMetrics(tensorboard, continue_from_step))
            except ImportError as error:
                print(f"phalanx: TensorBoard logs to {tensorboard} were asked for, but TensorBoard cannot be "
                      f"loaded ({error}); this run writes no TensorBoard events and goes on.\n"
                      "HINT: pip install tensorboard, then run again", file=sys.stderr)  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        """Writes ``record`` to every file.

        Args:
            record: a ``step`` and values by name (TensorBoard takes the numbers).
        """
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        """Closes the files; a later :meth:`write` writes nothing."""
        for sink in self._sinks:
            sink.close()
        self._sinks = []
