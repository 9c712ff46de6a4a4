"""``phalanx.init()``: who this process is in the job, as one explicit object.

No module-level state: the context is returned to the caller, who passes it on. The process
group it creates is destroyed by :meth:`DistributedContext.close` (also at interpreter exit).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.runtime.watchdog import (
    FLIGHT_RECORDER_ENTRIES,
    FLIGHT_RECORDER_VARIABLE,
    StallWatchdog,
    stall_timeout_from_env,
    watchdog_unavailable,
)
from phalanx.settings.values import seconds_problem
from phalanx.worker_env import WorkerEnv, launcher_takeover

if TYPE_CHECKING:
    from phalanx.runtime.heal.healing import Healing

DEFAULT_INIT_TIMEOUT_S = 300.0
#: The process groups :func:`init` formed in this process: process state by nature. Every worker
#: process of a start is new and forms its groups alike, so the count agrees between ranks, where
#: a count kept on the store would not (it outlives a start, and ranks move between starts).
_GROUPS_FORMED = itertools.count()
#: How long :func:`destroy_process_group` gives the backend's threads to drop the Python callbacks
#: they ran (tests/unit/exit_after_hooks.py).
BACKEND_THREADS_RELEASE_S = 0.1


@dataclass(frozen=True)
class TorchrunEnv:
    """The variables torchrun (and so phalanx run) sets for every worker, parsed once."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ[str]) -> TorchrunEnv:
        """Parsed from ``environ``; one process's defaults when RANK is not set."""
        if "RANK" not in environ:
            return cls()
        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            world_size=int(environ.get("WORLD_SIZE", 1)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(environ.get("GROUP_RANK", 0)),
        )


@dataclass
class DistributedContext:
    """Who this process is in the job: its rank, node, device and process-group backend.

    :func:`phalanx.init` makes it and the caller passes it on (to a :class:`~phalanx.CheckpointManager`,
    a :class:`~phalanx.GlobalMean`...): no module-level state. The same code runs with one
    process (rank 0 of a world of 1, no process group) and with N.

    Attributes:
        rank: this process's global rank, from 0 to ``world_size - 1``.
        local_rank: its rank on its node (LOCAL_RANK), the index of its GPU.
        node_rank: its node's index in the job (GROUP_RANK).
        world_size: the number of processes in the job.
        local_world_size: the number of processes on this node.
        device: this rank's device: ``cuda:<local_rank>``, or the CPU.
        backend: the process group's backend, nccl or gloo.

    Example::

        with phalanx.init() as context:
            model = torch.nn.Linear(10, 2).to(context.device)
            if context.is_main:
                print(f"{context.world_size} process(es) on {context.backend}")
    """

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    _owns_group: bool = field(default=False, repr=False)
    _watchdog: StallWatchdog | None = field(default=None, repr=False)
    #: Heal mode's part of this rank (:mod:`phalanx.runtime.heal`); None outside it.
    healing: Healing | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that prints and writes files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether the job has more than one process (then the collectives run)."""
        return self.world_size > 1

    def regroup(self, rank: int, world_size: int) -> None:
        """Heal mode: this process's rank and the world size in a generation of the job's group
        without a lost node's ranks (an elastic job that shrank without restarting).

        Args:
            rank: this process's rank in the new group.
            world_size: the new group's size.
        """
        self.rank, self.world_size = rank, world_size

    def mark_step(self, step: int) -> None:
        """Optional: lets a stall report say which training step each rank last finished.

        Args:
            step: the training step this rank just finished.
        """
        if self._watchdog is not None:
            self._watchdog.step = step

    def barrier(self) -> None:
        """Waits for every rank, in the process group this context created (nothing otherwise)."""
        if self._owns_group:
            if self.backend == "nccl":  # NCCL's barrier runs on a GPU: named, or torch guesses one and warns
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def close(self) -> None:
        """Stops the stall watchdog and destroys the process group this context created."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._owns_group and dist.is_initialized():
            destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def destroy_process_group() -> None:
    """``dist.destroy_process_group()``, once the backend's threads let go of the group.

    Compression hooks (fp16, PowerSGD) chain Python callbacks on their futures, which the
    backend's own threads run; such a thread drops the callbacks (and the group they hold) only
    once it gets the GIL back, after the caller's ``wait()`` has returned. Destroyed before that,
    the group can be freed in that thread, which then joins itself ("Resource deadlock
    avoided"); left until Python shuts down, the thread asks for the GIL when no thread may have
    it ("terminate called without an active exception"). Either aborts the process. Collecting
    first frees a DDP model that nothing but a reference cycle holds.
    """
    gc.collect()
    time.sleep(BACKEND_THREADS_RELEASE_S)  # the GIL is free meanwhile: the threads drop what they hold
    dist.destroy_process_group()


def init(
    backend: str | None = None, timeout: float = DEFAULT_INIT_TIMEOUT_S, stall_timeout: float | None = None
) -> DistributedContext:
    """Joins the job: the process group (when there is more than one process) and the device.

    With more than one process it is a collective: every rank calls it (it ends with a barrier).
    Under ``phalanx run`` it takes off the "[rankN]: " that torch's process group adds to every
    line of a traceback: the console already names the node and rank, and each rank has its own log.

    Args:
        backend: the process group's backend; default the launcher's choice
            (PHALANX_BACKEND), else nccl with CUDA and gloo without.
        timeout: how long the process group may take to form, in seconds.
        stall_timeout: seconds a collective may stay pending before the job ends with a
            report naming the stalled ranks (:mod:`phalanx.runtime.watchdog`); default
            PHALANX_STALL_TIMEOUT, else 300.

    Returns:
        The :class:`~phalanx.DistributedContext`. A process group that already exists (made
        by the script) is used as it is; one made here is destroyed by its
        :meth:`~phalanx.DistributedContext.close`, or at interpreter exit.

    Raises:
        SettingsRefused: nccl for a process without a GPU, or a timeout or stall timeout that
            is not a positive number of seconds of at most a week.

    Example::

        context = phalanx.init()
        model = torch.nn.Linear(10, 2).to(context.device)
        ...
        context.close()
    """
    hint = f"give the seconds the group may take to form, for example {DEFAULT_INIT_TIMEOUT_S:g} (the default)"
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise SettingsRefused(
            f"timeout={timeout!r}", "the process group's timeout is not a number of seconds", hint
        ) from None
    problem = seconds_problem(seconds)
    if problem:
        raise SettingsRefused(f"timeout={timeout!r}", f"the process group's timeout {problem}", hint)
    stall_timeout = stall_timeout_from_env(stall_timeout)
    env = TorchrunEnv.from_env(os.environ)
    if torch.cuda.is_available() and env.local_rank < torch.cuda.device_count():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    launched = WorkerEnv.from_env(os.environ)
    backend = backend or launched.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise SettingsRefused(
            f"backend nccl for LOCAL_RANK {env.local_rank}, on a node with {gpus} GPU(s)",
            "NCCL runs on GPUs, one per process: this process has none.",
            "start at most as many processes per node as it has GPUs (--nproc-per-node), or use the gloo backend",
        )
    context = DistributedContext(
        rank=env.rank, local_rank=env.local_rank, node_rank=env.node_rank, world_size=env.world_size,
        local_world_size=env.local_world_size, device=device, backend=backend,
    )  # fmt: skip
    if env.world_size > 1 and not dist.is_initialized() and launched.heal:
        context.healing = _join_healing(context, launched, seconds)
    elif env.world_size > 1 and not dist.is_initialized():
        os.environ.setdefault(FLIGHT_RECORDER_VARIABLE, FLIGHT_RECORDER_ENTRIES)  # quicker to read (watchdog.py)
        store, group = _group_store(launched, timedelta(seconds=seconds))
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=seconds))  # fmt: skip
        context._owns_group = True
        # A first collective, on every rank: the flight recorder must show it, or the watchdog
        # would never see a stall. (It also sets up NCCL's connections here, not at the first step.)
        context.barrier()
        unavailable = watchdog_unavailable(backend, timeout)
        if unavailable is None:
            context._watchdog = StallWatchdog(env.rank, env.world_size, stall_timeout, backend, group=group)
            context._watchdog.start()
        else:  # every rank that has none says so, in its own log (the console shows rank 0)
            print(unavailable, file=sys.stderr, flush=True)
    atexit.register(context.close)
    return context


def _group_store(launched: WorkerEnv, timeout: timedelta) -> tuple[dist.Store, int]:
    """The job's store, as env:// gives it to init_process_group, under a prefix of this process
    group's own; and the group's number in this process.

    The store outlives a process group (the launcher holds it, also from one start of the workers
    to the next), and torch names every new default group alike (destroy_process_group resets its
    count). A group formed after a destroyed one found that one's keys: gloo's rendezvous sets
    this rank's address, then reads each peer's, and found the old one at once, before the peer
    had set its new one; the rank connected to a listener of the old group, and the peer waited
    for it forever. The prefix names the group within the start, and the start under phalanx run
    (plain torchrun names none alike on every node: its starts share keys, as torch's own do).
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    group = next(_GROUPS_FORMED)
    start = f"{launched.start_name}/" if launched.start_name else ""
    return dist.PrefixStore(f"phalanx/group/{start}{group}", store), group


def _join_healing(context: DistributedContext, launched: WorkerEnv, timeout_s: float) -> Healing:
    """Heal mode: the group of generation 0 formed on the job's store (a replacement: the
    generation the survivors are forming), with no stall watchdog (a heal's wait is no stall)."""
    from phalanx.runtime.heal.generations import Generations, job_store
    from phalanx.runtime.heal.healing import Healing

    if context.backend != "gloo":
        raise SettingsRefused(f"--heal with the {context.backend} backend",
                              "heal mode ends the collectives of a failed group by gloo's means; NCCL's abort and shrink "
                              "are not used yet.", "leave --heal out on GPUs, or use --backend gloo")  # fmt: skip
    generations = Generations(job_store(launched.heal_store, timeout_s), context.backend, context.rank,
                              context.world_size, timeout_s)  # fmt: skip
    healing = Healing(generations, launched.replacement is not None, context.device)
    if healing.replacement:
        try:
            generations.join_as_replacement()
            context.regroup(generations.rank, generations.world_size)  # an elastic job may have shrunk
        except Exception as error:  # no generation opened in time: the launcher's restart takes over
            print(f"phalanx: this replacement could not join the surviving ranks ({type(error).__name__}: "
                  f"{str(error).strip()[:200]}); leaving the job to {launcher_takeover(os.environ)}", file=sys.stderr,
                  flush=True)  # fmt: skip
            raise SystemExit(ExitCode.HEAL_FAILED) from error
    else:
        generations.form_first()
    generations.watch(job_store(launched.heal_store, timeout_s), healing.health)  # from the generation joined
    context._owns_group = True
    return healing
