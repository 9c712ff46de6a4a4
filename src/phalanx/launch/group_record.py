"""Whether a worker joined its job's process group: written by the worker, read by its launcher,
which names the ranks that trained alone (docs/launch-design.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from phalanx.launch.import_hook import when_imported
from phalanx.worker_env import WorkerEnv

#: The record's file name, in each rank's log folder.
GROUP_RECORD_NAME = "process_group.json"
_C10D = "torch.distributed.distributed_c10d"
#: Point-to-point calls, which gloo's flight recorder does not count: a rank that only sends and
#: receives (a pipeline, monitored_barrier) communicated all the same.
_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "monitored_barrier")
#: Modules whose presence at exit explains a rank that ran alone (see :func:`hint_for`).
FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning")


@dataclass(frozen=True)
class GroupRecord:
    """What one rank did with torch.distributed, as it wrote it at its exit."""

    #: The size of the largest process group this worker formed (0: none).
    joined_world: int
    #: The WORLD_SIZE the launcher gave it.
    world_size: int
    #: The frameworks the script imported, for the HINT.
    frameworks: tuple[str, ...] = ()
    #: Collectives and point-to-point calls it issued in any process group (None: unknown,
    #: torch's flight recorder was off).
    collectives: int | None = None
    #: How its training stopped for a signal (WorkerEnv.stopped); None when it did not.
    stopped: str | None = None

    @property
    def ran_alone(self) -> bool:
        """In a job of several ranks: never in a group of them all, or never a collective in one."""
        return self.world_size > 1 and (self.joined_world < self.world_size or self.collectives == 0)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> GroupRecord | None:
        """The record, or None where the worker wrote none (it ended before its exit handlers)."""
        try:
            data = json.loads(path.read_text())
            collectives, stopped = data.get("collectives"), data.get("stopped")
            return cls(int(data["joined_world"]), int(data["world_size"]), tuple(data.get("frameworks", ())),
                       None if collectives is None else int(collectives), None if stopped is None else str(stopped))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            return None


class GroupWatch:
    """In a worker: notes each process group it forms, and writes the :class:`GroupRecord` at exit."""

    def __init__(self, path: Path, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        self.joined_world = 0
        self.backends: set[str] = set()  # of the groups formed: which flight recorder counts their collectives
        #: When the first init_process_group was called, and when it returned (Unix time).
        self.began: float | None = None
        self.formed: float | None = None
        self.point_to_point = 0  # calls of _POINT_TO_POINT

    def install(self) -> None:
        """Wraps init_process_group now if torch.distributed is imported, else as soon as it is."""
        when_imported(_C10D, self._wrap)

    def _wrap(self, c10d: ModuleType) -> None:
        original = c10d.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            began, excepthook = time.time(), sys.excepthook
            result = original(*args, **kwargs)
            # torch's hook prefixes every line of a traceback with "[rankN]: "; phalanx run's
            # console names the node and rank already, and a rank's log file is its own
            sys.excepthook = excepthook
            if self.formed is None:
                self.began, self.formed = began, time.time()
            self._joined(c10d)
            return result

        _replace(original, init_process_group)
        for name in _POINT_TO_POINT:
            if hasattr(c10d, name):
                _replace(getattr(c10d, name), self._counted(getattr(c10d, name)))

    def _counted(self, original: Any) -> Any:
        def point_to_point(*args: Any, **kwargs: Any) -> Any:
            self.point_to_point += 1
            return original(*args, **kwargs)

        return point_to_point

    def _joined(self, c10d: ModuleType) -> None:
        self.joined_world = max(self.joined_world, c10d.get_world_size())
        # The device-to-backend map ("cpu:gloo", "cpu:gloo,cuda:nccl"): get_backend() says
        # "undefined" for a group created without a backend, as Accelerate creates it.
        config = getattr(c10d, "get_backend_config", c10d.get_backend)
        self.backends.add(str(config()))

    def write(self) -> None:
        """Writes the record; a group still formed at exit counts even if it escaped the wrapper."""
        c10d = sys.modules.get(_C10D)
        if c10d is not None and c10d.is_initialized():
            self._joined(c10d)
        frameworks = tuple(name for name in FRAMEWORKS if name in sys.modules)
        collectives = self._collectives_issued() if self.joined_world else None
        try:
            stopped = WorkerEnv.from_env(os.environ).stopped
            GroupRecord(self.joined_world, self.world_size, frameworks, collectives, stopped).write(self.path)
        except OSError:
            pass  # the log folder is gone: the launcher then makes no claim about this rank

    def _collectives_issued(self) -> int | None:
        """The collectives this process issued in all its groups, by torch's flight recorders
        (which keep their counts after the groups are destroyed); None where they cannot tell.

        A count of zero is evidence only for groups whose backend map has no NCCL (gloo's recorder
        counts every gloo collective, checked); NCCL's may be off, so there only a count above zero is."""
        from phalanx.runtime.watchdog import collectives_issued

        recorders = ["gloo", *(["nccl"] if any("nccl" in backend for backend in self.backends) else [])]
        counts = []
        for recorder in recorders:
            try:
                counts.append(collectives_issued(recorder))
            except Exception:
                counts.append(None)
        total = sum(count for count in counts if count is not None) + self.point_to_point
        if total > 0:
            return total
        trusted = not any("nccl" in backend or "undefined" in backend for backend in self.backends)
        return 0 if trusted and counts[0] is not None else None


def _replace(original: Any, wrapper: Any) -> None:
    """Puts ``wrapper`` where torch.distributed's modules hold ``original`` (also those that took
    the name before the wrapping, where torch.distributed was imported before install())."""
    wrapper.__wrapped__, wrapper.__doc__, wrapper.__name__ = original, original.__doc__, original.__name__
    for name in (_C10D, "torch.distributed", "torch.distributed.device_mesh"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, original.__name__, None) is original:
            setattr(module, original.__name__, wrapper)


def solo_ranks(records: dict[int, GroupRecord | None]) -> list[int]:
    """The ranks that wrote that they never joined a group of the whole job."""
    return sorted(rank for rank, record in records.items() if record is not None and record.ran_alone)


def uncounted_ranks(records: dict[int, GroupRecord | None]) -> list[int]:
    """The ranks that joined a group of the whole job, but whose collectives torch did not count
    (its flight recorder off): whether they communicated cannot be told, so they are not blamed."""
    return sorted(rank for rank, record in records.items()
                  if record is not None and not record.ran_alone and record.world_size > 1 and record.collectives is None)  # fmt: skip


def hint_for(records: Sequence[GroupRecord]) -> str:
    """The HINT for ranks that ran alone, by the framework their script used."""
    frameworks = {name for record in records for name in record.frameworks}
    if "accelerate" in frameworks:
        return (
            "Accelerate joins the world on CPUs only with ACCELERATE_USE_CPU=1 (what `accelerate launch --cpu` "
            "sets): export ACCELERATE_USE_CPU=1 before phalanx run; with GPUs, check that CUDA sees them"
        )
    if frameworks & {"lightning", "pytorch_lightning"}:
        return (
            "give Lightning the job's size: Trainer(num_nodes=N, devices=K, strategy='ddp') with N and K as in "
            "phalanx run; a Trainer on one device runs alone in every process"
        )
    return (
        "call torch.distributed.init_process_group() (or phalanx.init()) and train with DDP; ranks that are "
        "meant to work alone (an evaluation sharded by RANK) say so with --independent-ranks"
    )
