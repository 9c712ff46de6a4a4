"""A Kubeflow PyTorchJob (the training operator's v1 API): node-level RANK and WORLD_SIZE.

The operator gives every pod ``MASTER_ADDR`` (``<job>-master-0``), ``MASTER_PORT``, ``RANK``
(the pod's index: 0 for the master, 1 + i for worker i) and ``WORLD_SIZE``, whose meaning changed:
up to v1.6 it counts the pods, from v1.7 (which also sets ``PET_NNODES``, ``PET_NODE_RANK`` and,
when the job has ``nprocPerNode``, ``PET_NPROC_PER_NODE``) it counts processes, pods x nprocPerNode.
Read from training-operator v1.5.0 to v1.9.0, ``pkg/controller.v1/pytorch/envvar.go``.
"""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.clusters.indexed_job import IndexedJob
from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.errors import SettingsRefused
from phalanx.settings import values

#: The port a PyTorchJob's master listens on when its spec names none (the operator's default).
DEFAULT_PORT = 23456
#: What the operator sets on every pod of a job with a Master.
OPERATOR_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                      "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE")  # fmt: skip
#: The master pod's (and its Service's) name after the job's: ``<job>-master-0``, which is MASTER_ADDR.
MASTER_SUFFIX = "-master-0"


def pod_hostnames(job: str, nodes: int) -> list[str]:
    """The operator's pod (and Service) names, in RANK order: ``<job>-master-0``, ``<job>-worker-<i>``."""
    return [job + MASTER_SUFFIX, *(f"{job}-worker-{index}" for index in range(nodes - 1))]


class PyTorchJob(ClusterEnvironment):
    """A pod of a Kubeflow PyTorchJob (training-operator v1): node-level RANK and WORLD_SIZE."""

    name = "Kubeflow PyTorchJob"
    markers = ("MASTER_ADDR", "RANK", "WORLD_SIZE")
    #: From v1.7 its pods carry PET_ variables too: the same job, described twice.
    covers = (TorchrunVariables, IndexedJob)

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        # A pod's node-level RANK; a torchrun worker's RANK comes with LOCAL_RANK (inside_torchrun).
        return bool(environ.get("KUBERNETES_SERVICE_HOST")) and all(environ.get(name) for name in cls.markers) \
            and not environ.get("LOCAL_RANK")  # fmt: skip

    def placement(self) -> Placement:
        rank = self._int("RANK")
        world = self._int("WORLD_SIZE", minimum=1)
        pods = self._parsed("PET_NNODES", values.parse_nnodes, "a node count N or a MIN:MAX range")
        nproc = self._parsed("PET_NPROC_PER_NODE", values.parse_nproc_per_node, "a number, auto, gpu or cpu")
        assert rank is not None and world is not None  # detect() found them
        if pods is None:  # up to v1.6: WORLD_SIZE counts the pods
            nnodes = Found(values.NodeRange(world.value, world.value), f"{world.source} (pods, as up to v1.6)")
        else:
            nnodes = pods
            per_pod = nproc.value if nproc else 1
            if isinstance(per_pod, int) and world.value != pods.value.max * per_pod:
                raise SettingsRefused(
                    f"{self.name}: {world.source} is neither the pod count of {pods.source} nor its "
                    f"processes ({pods.value.max} x {per_pod})",
                    "from v1.7 the operator sets WORLD_SIZE to pods x nprocPerNode; these variables contradict it.",
                    "unset WORLD_SIZE if the pod spec sets it by hand",
                )
        if rank.value >= nnodes.value.max:
            raise self._refuse_variable(f"{rank.source} with {nnodes.source}", "a pod index below the pod count")
        master = self._text("MASTER_ADDR")
        assert master is not None
        port = self._int("MASTER_PORT", minimum=1) or Found(DEFAULT_PORT, "the operator's default port")
        try:
            endpoint = values.parse_endpoint(f"{master.value}:{port.value}")
        except values.InvalidValue:
            raise self._refuse_variable(f"{master.source}, {port.source}", "a host name and a port") from None
        job = master.value.split(".")[0].removesuffix(MASTER_SUFFIX)
        return Placement(
            name=self.name,
            environment=f"{self.name} {job}",
            nnodes=nnodes,
            node_rank=Found(rank.value, f"{rank.source} (the pod's index)"),
            endpoint=Found(endpoint, f"{master.source}, {port.source}"),
            rdzv_id=self._rdzv_id(job),
            nproc_per_node=nproc,
            dns_may_lag=True,
        )

    def _rdzv_id(self, job: str) -> Found[str] | None:
        try:
            return Found(values.parse_rdzv_id(job), "the job's name in MASTER_ADDR")
        except values.InvalidValue:
            return None
