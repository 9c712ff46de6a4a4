"""A real SLURM cluster on a test bed: Debian's slurmctld on this machine, one slurmd per host.

No munge and no cgroups (``auth/none``, ``proctrack/pgid``, ``task/none``); each slurmd runs in
its host with its own port and files, slurmctld on the bed's bridge. ``cred_expire`` and
``sched_interval`` are short, so that a requeued job starts again within seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.testbed.bed import TestBed
from phalanx.testbed.together import signal_group

#: How long the daemons may take to start and the nodes to report idle.
READY_TIMEOUT_S = 60.0
DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


@dataclass
class SlurmCluster:
    """A running cluster: its configuration, and the daemons it started."""

    bed: TestBed
    folder: Path
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What SLURM's commands (sbatch, srun, scontrol) need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def log(self, daemon: str) -> str:
        path = self.folder / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cancel_jobs(self) -> None:
        """Cancels every job on the cluster, batch shells and steps alike."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", "--full", "--user", "root"], env={**os.environ, **self.env},
                           capture_output=True, timeout=10)  # fmt: skip

    def stop(self) -> None:
        """Stops every daemon (and, with the bed's hosts, every job step they started)."""
        self.cancel_jobs()
        for daemon in self.daemons:
            signal_group(daemon, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(daemon, signal.SIGKILL)
                daemon.wait()


def missing_commands() -> list[str]:
    """SLURM's daemons and commands this machine lacks (Debian's slurmctld, slurmd, slurm-client)."""
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    """A port free on every address: slurmctld binds all of them, so a port free on the bridge's
    address alone may be taken on loopback (where a busy machine's clients hold thousands)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _configuration(bed: TestBed, folder: Path, cpus: int, cred_expire_s: int) -> str:
    ctld_port = _free_port()
    nodes = "\n".join(
        f"NodeName={host.name} NodeAddr={host.address} Port={6830 + k} CPUs={cpus} State=UNKNOWN"
        for k, host in enumerate(bed.hosts)
    )
    return f"""\
ClusterName={bed.name}
SlurmctldHost={socket.gethostname()}({bed.bridge_address})
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire={cred_expire_s}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/linear
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
InactiveLimit=0
MinJobAge=600
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(bed: TestBed, folder: Path, *, cpus: int = 2, cred_expire_s: int = 5) -> Iterator[SlurmCluster]:
    """slurmctld here and a slurmd in every host of ``bed``, for the duration of a ``with`` block
    that starts once every node is idle; stopped afterwards whatever happens.

    Raises:
        SettingsRefused: SLURM's daemons or commands are not installed.
        RuntimeError: the nodes were not idle within READY_TIMEOUT_S (the daemons' logs attached).
    """
    missing = missing_commands()
    if missing:
        raise SettingsRefused(
            f"a SLURM test cluster needs {', '.join(missing)}, which this machine lacks",
            "they come with Debian's slurmctld, slurmd and slurm-client packages.",
            "make cluster-deps (apt-get install slurmctld slurmd slurm-client)",
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state").mkdir(exist_ok=True)
    cluster = SlurmCluster(bed, folder)
    cluster.conf.write_text(_configuration(bed, folder, cpus, cred_expire_s))
    env = {**os.environ, **cluster.env}
    try:
        cluster.daemons.append(subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(cluster.conf)], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
        for host in bed.hosts:
            cluster.daemons.append(subprocess.Popen(
                host.command(["slurmd", "-D", "-N", host.name, "-f", str(cluster.conf)]), env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ))  # fmt: skip
        _wait_until_idle(cluster, env)
        yield cluster
    finally:
        cluster.stop()


def _wait_until_idle(cluster: SlurmCluster, env: dict[str, str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    states = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=10)
        states = done.stdout.strip()
        lines = states.splitlines()
        if len(lines) == len(cluster.bed.hosts) and all(line.split()[1] == "idle" for line in lines):
            return
        if any(daemon.poll() is not None for daemon in cluster.daemons):
            break  # a daemon died: its log says why
        time.sleep(0.5)
    logs = "\n".join(f"--- {name}\n{cluster.log(name)[-2000:]}" for name in
                     ["slurmctld", *(f"slurmd-{h.name}" for h in cluster.bed.hosts)])  # fmt: skip
    raise RuntimeError(f"the SLURM nodes were not idle (sinfo: {states!r}; a daemon may have died)\n{logs}")
