"""SLURM: the allocation's nodes from its variables, one ``phalanx run`` per node.

Inside ``srun`` the step's variables (``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_NODES``) describe
the nodes that run it, which may be fewer than the job's; outside a step (a batch script, an
``salloc`` shell) the job's do. The first host of the list is the rendezvous endpoint, the job ID
(with the array task) names the rendezvous, and the port is derived from the job ID so that two
jobs sharing a first node do not collide.
"""

from __future__ import annotations

import re

from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.clusters.nodelist import NodelistError, expand_nodelist
from phalanx.errors import SettingsRefused
from phalanx.settings.values import DEFAULT_RDZV_PORT, Endpoint, NodeRange

#: The endpoint's port is DEFAULT_RDZV_PORT + (job ID modulo this): the same on every node of a job.
PORT_SPREAD = 1000


def rendezvous_port(job_id: int) -> int:
    """The port a SLURM job's nodes meet on: derived from the job ID, the same on every node."""
    return DEFAULT_RDZV_PORT + job_id % PORT_SPREAD


def tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts, ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(item)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


class Slurm(ClusterEnvironment):
    """Inside a SLURM allocation: a batch script or salloc shell (job scope), or an srun step."""

    name = "SLURM"
    markers = ("SLURM_JOB_ID", "SLURM_JOBID")

    @property
    def in_step(self) -> bool:
        """Inside srun: the step's variables describe the nodes that run it."""
        return bool(self.environ.get("SLURM_STEP_ID") or self.environ.get("SLURM_STEP_NODELIST"))

    def placement(self) -> Placement:
        job = self._int("SLURM_JOB_ID", "SLURM_JOBID")
        assert job is not None  # detect() found it
        if self.in_step:
            nodelist = self._text("SLURM_STEP_NODELIST")
            count = self._int("SLURM_STEP_NUM_NODES", minimum=1)
        else:
            nodelist = self._text("SLURM_JOB_NODELIST", "SLURM_NODELIST")
            count = self._int("SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1)
        if nodelist is None:
            raise SettingsRefused(
                f"SLURM: {job.source} is set, but no node list (SLURM_JOB_NODELIST or SLURM_STEP_NODELIST)",
                "without it phalanx cannot tell which node hosts the rendezvous.",
                "run phalanx inside the allocation (sbatch, salloc or srun), not with a copied SLURM_JOB_ID",
            )
        hosts = self._hosts(nodelist)
        nnodes, rank = self._nodes_of(hosts, nodelist.source, count, "SLURM_NODEID")
        self._check_one_task_per_node(len(hosts))
        if len(hosts) > 1 and not self.in_step:
            raise SettingsRefused(
                f"SLURM job {job.value} has {len(hosts)} nodes ({nodelist.source}), but phalanx run runs outside "
                "srun, on this node only",
                "phalanx run is one launcher per node; the other nodes must run it too.",
                "start it on every node: srun --ntasks-per-node=1 phalanx run [options] SCRIPT "
                "(or write the whole job script with `phalanx slurm`)",
            )
        scope = f"step {self.environ.get('SLURM_STEP_ID', '?')}" if self.in_step else "batch script"
        return Placement(
            name=self.name,
            environment=f"SLURM job {self._job_name(job.value)} ({scope}) on {nodelist.value}",
            nnodes=Found(NodeRange(nnodes.value, nnodes.value), nnodes.source),
            node_rank=rank,
            endpoint=Found(Endpoint(hosts[0], rendezvous_port(job.value)),
                           f"the first host of {nodelist.source}, port {DEFAULT_RDZV_PORT} + job ID mod {PORT_SPREAD}"),
            rdzv_id=Found(f"slurm-{self._job_name(job.value)}", job.source),
            nproc_per_node=self._gpus("SLURM_GPUS_ON_NODE"),
            hosts=tuple(hosts),
            notes=self._restart_note(),
        )  # fmt: skip

    def _job_name(self, job_id: int) -> str:
        array_job, task = self.environ.get("SLURM_ARRAY_JOB_ID"), self.environ.get("SLURM_ARRAY_TASK_ID")
        return f"{array_job}_{task}" if array_job and task else str(job_id)

    def _hosts(self, nodelist: Found[str]) -> list[str]:
        try:
            return expand_nodelist(nodelist.value)
        except NodelistError as error:
            raise SettingsRefused(
                f"SLURM: {nodelist.source} does not parse: {error}",
                "phalanx expands the host list itself (containers often have no scontrol).",
                "check the variable: `scontrol show hostnames` expands it where SLURM's tools are installed; "
                "unset it if the job script sets it by hand",
            ) from None

    def _check_one_task_per_node(self, nodes: int) -> None:
        """Inside a step every task runs phalanx run; a batch script is one process whatever
        the allocation's tasks per node."""
        text = self.environ.get("SLURM_STEP_TASKS_PER_NODE")
        if not self.in_step or not text:
            return
        try:
            counts = tasks_per_node(text)
        except ValueError:
            raise self._refuse_variable(f"SLURM_STEP_TASKS_PER_NODE={text}", "task counts such as 1(x2)") from None
        if set(counts) == {1}:
            return
        most = max(counts)
        raise SettingsRefused(
            f"SLURM started {most} tasks on a node (SLURM_STEP_TASKS_PER_NODE={text}), so {most} copies of "
            "phalanx run share it",
            "phalanx run is one launcher per node that starts the worker processes itself "
            "(--nproc-per-node); several launchers on one node would form separate worlds or fight over a port.",
            f"srun --nodes={nodes} --ntasks-per-node=1 phalanx run --nproc-per-node {most} [options] SCRIPT",
        )

    def _restart_note(self) -> tuple[str, ...]:
        count = self.environ.get("SLURM_RESTART_COUNT")
        return (f"requeued {count} time(s) (SLURM_RESTART_COUNT={count})",) if count and count != "0" else ()
