"""Whether a worker joined its job's process group: written by the worker, read by its launcher.

A job of N ranks whose script never forms a group of N, or forms one and never communicates
over it (Accelerate on CPUs without ``ACCELERATE_USE_CPU=1`` does the latter: it creates the
group, then trains in every process alone), trains N times alone and exits 0: nothing says that
nothing was distributed. Each worker writes one small JSON record (``process_group.json`` in its
rank's log folder): the largest group it formed, and how many collectives it issued, as torch's
flight recorder counted them (None where the recorder is off). The launcher names the ranks that
ran alone.

torch has no hook on process-group creation, so :class:`GroupWatch` wraps
``torch.distributed.init_process_group`` as soon as ``torch.distributed.distributed_c10d`` is
imported (an import hook: importing torch earlier would change the script's behaviour, such as
``OMP_NUM_THREADS`` set before its own ``import torch``). The wrapper passes every argument
through and only looks at the result. Checked against torch 2.4 to 2.13, whose
``torch.distributed`` and ``torch.distributed.device_mesh`` take the function from that module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

#: The record's file name, in each rank's log folder.
GROUP_RECORD_NAME = "process_group.json"
_C10D = "torch.distributed.distributed_c10d"
#: Modules whose presence at exit explains a rank that ran alone (see :func:`hint_for`).
FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning")


@dataclass(frozen=True)
class GroupRecord:
    #: The size of the largest process group this worker formed (0: none).
    joined_world: int
    #: The WORLD_SIZE the launcher gave it.
    world_size: int
    #: The frameworks the script imported, for the HINT.
    frameworks: tuple[str, ...] = ()
    #: Collectives it issued in any process group (None: unknown, torch's flight recorder was off).
    collectives: int | None = None

    @property
    def ran_alone(self) -> bool:
        return self.world_size > 1 and (self.joined_world < self.world_size or self.collectives == 0)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> GroupRecord | None:
        """The record, or None where the worker wrote none (it ended before its exit handlers)."""
        try:
            data = json.loads(path.read_text())
            collectives = data.get("collectives")
            return cls(int(data["joined_world"]), int(data["world_size"]), tuple(data.get("frameworks", ())),
                       None if collectives is None else int(collectives))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            return None


class GroupWatch:
    """In a worker: notes each process group it forms, and writes the :class:`GroupRecord` at exit."""

    def __init__(self, path: Path, world_size: int, backend: str | None) -> None:
        self.path = path
        self.world_size = world_size
        self.backend = backend or "gloo"
        self.joined_world = 0

    def install(self) -> None:
        """Wraps init_process_group now if torch.distributed is imported, else as soon as it is."""
        module = sys.modules.get(_C10D)
        if module is not None:
            self._wrap(module)
        else:
            sys.meta_path.insert(0, _AfterImport(_C10D, self._wrap))

    def _wrap(self, c10d: ModuleType) -> None:
        original = c10d.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.joined_world = max(self.joined_world, c10d.get_world_size())
            return result

        init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        init_process_group.__doc__ = original.__doc__
        for module in list(sys.modules.values()):  # those that took the name before this point
            if getattr(module, "init_process_group", None) is original:
                module.init_process_group = init_process_group  # type: ignore[attr-defined]
        c10d.init_process_group = init_process_group  # type: ignore[attr-defined]

    def write(self) -> None:
        """Writes the record; a group still formed at exit counts even if it escaped the wrapper."""
        c10d = sys.modules.get(_C10D)
        if c10d is not None and c10d.is_initialized():
            self.joined_world = max(self.joined_world, c10d.get_world_size())
        frameworks = tuple(name for name in FRAMEWORKS if name in sys.modules)
        collectives = self._collectives_issued() if self.joined_world else None
        try:
            GroupRecord(self.joined_world, self.world_size, frameworks, collectives).write(self.path)
        except OSError:
            pass  # the log folder is gone: the launcher then makes no claim about this rank


    def _collectives_issued(self) -> int | None:
        """The collectives this process issued in all its groups, by torch's flight recorder
        (which keeps its counts after the groups are destroyed); None where it cannot tell."""
        from phalanx.runtime.watchdog import collectives_issued

        try:
            return collectives_issued(self.backend)
        except Exception:  # noqa: BLE001 - a torch whose recorder cannot be read: no claim
            return None


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``then(module)`` right after the module ``name`` executes, before anyone else gets it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self.loader: Any = None

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)


def solo_ranks(records: dict[int, GroupRecord | None]) -> list[int]:
    """The ranks that wrote that they never joined a group of the whole job."""
    return sorted(rank for rank, record in records.items() if record is not None and record.ran_alone)


def hint_for(records: Sequence[GroupRecord]) -> str:
    frameworks = {name for record in records for name in record.frameworks}
    if "accelerate" in frameworks:
        return ("Accelerate joins the world on CPUs only with ACCELERATE_USE_CPU=1 (what `accelerate launch --cpu` "
                "sets): export ACCELERATE_USE_CPU=1 before phalanx run; with GPUs, check that CUDA sees them")
    if frameworks & {"lightning", "pytorch_lightning"}:
        return ("give Lightning the job's size: Trainer(num_nodes=N, devices=K, strategy='ddp') with N and K as in "
                "phalanx run; a Trainer on one device runs alone in every process")
    return ("call torch.distributed.init_process_group() (or phalanx.init()) before training; a script that does "
            "not use torch.distributed runs with --nproc-per-node 1 on one node")
