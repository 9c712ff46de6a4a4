"""torchrun's ``PET_<FLAG>`` variables: the job as a Kubeflow TrainJob (Trainer v2) describes it.

torchrun reads each of its flags from ``PET_<FLAG>`` when the flag is not given, and Kubeflow's
Trainer sets ``PET_NNODES``, ``PET_NPROC_PER_NODE`` (``auto`` by default), ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` on every pod of a TrainJob; an elastic PyTorchJob sets
``PET_RDZV_ENDPOINT`` instead of the master's address. phalanx builds torchrun's command line
itself, so it reads them here.
"""

from __future__ import annotations

from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.clusters.indexed_job import IndexedJob
from phalanx.settings import values

#: What Kubeflow's Trainer sets on every pod of a torch runtime (pkg/constants: TorchRunReservedEnvNames).
TRAINER_VARIABLES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: torchrun's default for --master-port, used when PET_MASTER_ADDR comes without PET_MASTER_PORT.
TORCHRUN_MASTER_PORT = 29500


class TorchrunVariables(ClusterEnvironment):
    """torchrun's PET_ variables: a Kubeflow TrainJob's pods, an elastic PyTorchJob, or set by hand."""

    name = "torchrun's PET_ variables"
    markers = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
    #: A TrainJob's pods are an Indexed Job's pods: JOB_COMPLETION_INDEX is PET_NODE_RANK again.
    covers = (IndexedJob,)

    def placement(self) -> Placement:
        nnodes = self._parsed("PET_NNODES", values.parse_nnodes, "a node count N or a MIN:MAX range")
        rank = self._int("PET_NODE_RANK")
        if nnodes is not None and rank is not None and rank.value >= nnodes.value.max:
            raise self._refuse_variable(f"{rank.source} with {nnodes.source}", "a node rank below the node count")
        return Placement(
            name=self.name,
            environment=self._described(),
            nnodes=nnodes,
            node_rank=rank,
            endpoint=self._endpoint(),
            rdzv_id=self._parsed("PET_RDZV_ID", values.parse_rdzv_id, "1 to 64 letters, digits, '.', '_' or '-'"),
            nproc_per_node=self._parsed(
                "PET_NPROC_PER_NODE", values.parse_nproc_per_node, "a number, auto, gpu or cpu"
            ),
            dns_may_lag=True,
        )

    def _described(self) -> str:
        if self.environ.get("KUBERNETES_SERVICE_HOST"):
            return "Kubernetes pod with torchrun's PET_ variables (a Kubeflow TrainJob or elastic PyTorchJob)"
        return "torchrun's PET_ variables"

    def _endpoint(self) -> Found[values.Endpoint] | None:
        found = self._parsed("PET_RDZV_ENDPOINT", values.parse_endpoint, "HOST[:PORT]")
        if found is not None:
            return found
        address = self._text("PET_MASTER_ADDR")
        if address is None:
            return None
        port = self._int("PET_MASTER_PORT", minimum=1) or Found(TORCHRUN_MASTER_PORT, "torchrun's default port")
        try:
            endpoint = values.parse_endpoint(str(values.Endpoint(address.value, port.value)))  # IPv6 in []
        except values.InvalidValue:
            raise self._refuse_variable(
                f"{address.source}, {port.source}", "a host name or IP address and a port"
            ) from None
        return Found(endpoint, f"{address.source}, {port.source}")
