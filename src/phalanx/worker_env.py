"""What the launcher and its workers agree on: the environment variables it hands to every
worker, in one typed schema, and the words a worker's stall report begins with.

torchrun sets the standard variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). These are
phalanx's own additions: :mod:`phalanx.launch.node_setup` writes them and the runtime reads them,
both through this class, never through string keys of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: How the stall watchdog's report begins in the log of a worker that exits with ExitCode.STALLED:
#: the launcher finds the report by it, to show it as the root cause.
STALL_REPORT = "phalanx: stall:"
#: In each rank's log folder: its keep request (a FIFO it listens on, :attr:`WorkerEnv.keep_request`),
#: its keep report (the line that says what it kept after a failure, written once it did), and in
#: heal mode the mark that phalanx.Run armed healing (a failure before it is not healed).
KEEP_REQUEST_NAME, KEEP_REPORT_NAME, HEAL_ARMED_NAME = "keep-request", "keep-report", "heal-armed"


def keep_report_of(request: str | Path) -> Path:
    """Where the rank that listens on ``request`` writes its keep report: beside it."""
    return Path(request).with_name(KEEP_REPORT_NAME)


def heal_armed_of(request: str | Path) -> Path:
    """Where the rank that listens on ``request`` marks that its training can heal: beside it."""
    return Path(request).with_name(HEAL_ARMED_NAME)


def agent_restarts(environ: Mapping[str, str]) -> tuple[int, int]:
    """(restarts done, --max-restarts) of this node's agent, from the variables torch's agent
    gives every worker; (0, 0) outside an agent."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def launcher_takeover(environ: Mapping[str, str]) -> str:
    """Words that follow "leaving it to" where a worker leaves its failure to this node's agent:
    how many of --max-restarts it has left (from the variables torch's agent gives every worker).
    Whether it restarts is its own decision: a restart that cannot help, or a lost node, ends the
    job even with restarts left, and each node counts its own.

    Example:
        >>> launcher_takeover({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"})
        'the launcher (1 of --max-restarts 2 left on this node)'
    """
    done, most = agent_restarts(environ)
    left = most - done
    if left > 0:
        return f"the launcher ({left} of --max-restarts {most} left on this node)"
    return f"the launcher, which has no restart left on this node (--max-restarts {most})"


def job_name(rdzv_id: str, endpoint: str) -> str:
    """How a job is named to its workers (:attr:`WorkerEnv.job`): its rendezvous ID and endpoint."""
    return f"'{rdzv_id}' at {endpoint}"


@dataclass(frozen=True)
class WorkerEnv:
    #: The backend the launcher chose for this node (nccl or gloo).
    backend: str | None = None
    #: How the launcher names this node in its output: its address, or nodeK when simulated.
    node: str | None = None
    #: The address this node advertises to the others (the route's source address).
    address: str | None = None
    #: Which start of the workers this is, counted from 0 and the same on every node: set by the
    #: node's agent (:class:`phalanx.launch.logs.RankLogsSpecs`) each time it starts them.
    attempt: int | None = None
    #: The process that starts the workers (the node's agent): a worker dies with it.
    launcher_pid: int | None = None
    #: Where this rank writes whether it joined the job's process group (set per rank with ``attempt``).
    group_record: str | None = None
    #: The job, the same on every node and in every rendezvous round and restart of one launch:
    #: its rendezvous ID and endpoint (unset for one node, whose store port is picked at its start).
    job: str | None = None
    #: A preemption signal (SIGUSR1) that came before the worker's script could handle it: kept by
    #: the launcher (no worker yet) or the worker's entry point; PreemptionGuard takes it as received.
    early_signal: str | None = None
    #: How the worker's training stopped for a signal ("after step 320; checkpoint saved"): set by
    #: phalanx.Run as it stops, written into the rank's exit record, said by the launcher.
    stopped: str | None = None
    #: A FIFO on which the launcher asks this rank to keep the state after its last step (it lost
    #: a node, whose silence leaves this rank's collective waiting): set per rank with
    #: ``attempt``; phalanx.Run listens on it and writes its report beside it (:func:`keep_report_of`).
    keep_request: str | None = None
    #: Heal mode: how many replacements of a failed rank may join the surviving ranks, which keep
    #: their processes (:mod:`phalanx.runtime.heal`); 0 or unset: off.
    heal: int | None = None
    #: Set in a process that replaces a rank that died: how many replacements of it came before.
    replacement: int | None = None
    #: Heal mode: the process that runs the script as its child (:mod:`phalanx.launch.supervisor`).
    supervisor_pid: int | None = None
    #: Heal mode: ``host:port`` of the launch's store, where the ranks form each generation of
    #: their group (the workers' own store can die with a worker).
    heal_store: str | None = None
    #: The name of this start of the workers, the same on every node (the rendezvous round's in a
    #: multi-node job, where a node that joined later counts its starts from 0, so ``attempt``
    #: differs): the keys of the ranks' process groups, stall watchdogs and heals are under it.
    start_name: str | None = None

    _KEYS = {"backend": "PHALANX_BACKEND", "node": "PHALANX_NODE", "address": "PHALANX_NODE_ADDRESS",
             "attempt": "PHALANX_ATTEMPT", "launcher_pid": "PHALANX_LAUNCHER_PID",
             "group_record": "PHALANX_GROUP_RECORD", "early_signal": "PHALANX_EARLY_SIGNAL", "job": "PHALANX_JOB",
             "stopped": "PHALANX_STOPPED", "keep_request": "PHALANX_KEEP_REQUEST",
             "heal": "PHALANX_HEAL", "replacement": "PHALANX_REPLACEMENT",
             "supervisor_pid": "PHALANX_SUPERVISOR_PID", "heal_store": "PHALANX_HEAL_STORE",
             "start_name": "PHALANX_START_NAME"}  # fmt: skip
    _INTEGERS = ("attempt", "launcher_pid", "heal", "replacement", "supervisor_pid")
    #: The fields whose values differ between the nodes (or ranks) of a healthy job: a process's
    #: own ids, paths and labels, and the job's name and heal store, which each node spells with
    #: its own --rdzv-endpoint. Every other field is the same on every node.
    _PER_PROCESS = ("node", "address", "launcher_pid", "group_record", "job", "early_signal", "keep_request",
                    "replacement", "supervisor_pid", "heal_store")  # fmt: skip

    @classmethod
    def per_process_keys(cls) -> tuple[str, ...]:
        """The variables whose values differ between the nodes of a healthy job
        (``PHALANX_NODE``, ``PHALANX_SUPERVISOR_PID``...), which a comparison of nodes leaves out."""
        return tuple(cls._KEYS[name] for name in cls._PER_PROCESS)

    def to_env(self) -> dict[str, str]:
        return {key: str(getattr(self, name)) for name, key in self._KEYS.items() if getattr(self, name) is not None}

    @classmethod
    def key_of(cls, name: str) -> str:
        """The variable of one field (``early_signal`` -> ``PHALANX_EARLY_SIGNAL``)."""
        return cls._KEYS[name]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerEnv:
        values: dict[str, str | int | None] = {name: environ.get(key) or None for name, key in cls._KEYS.items()}
        for name in cls._INTEGERS:
            if values[name] is not None:
                values[name] = int(values[name])  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]
