"""The cluster environment ``phalanx run`` would detect here, for ``phalanx env``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from phalanx.clusters import detect
from phalanx.errors import SettingsRefused


@dataclass(frozen=True)
class ClusterFacts:
    """The cluster environment in the env report, as plain data (JSON round-trips)."""

    #: The environment's name (``SLURM``), or None where only the launch flags count.
    name: str | None
    #: Which job, in words, or why none was found.
    description: str
    #: What the environment says, as text: nnodes, node_rank, endpoint, rdzv_id, nproc_per_node, hosts.
    values: dict[str, str] = field(default_factory=dict)
    #: The variables each value came from.
    sources: list[str] = field(default_factory=list)
    #: Why phalanx run would refuse these variables (None: it would not).
    refused: str | None = None
    hint: str | None = None


def cluster_facts(environ: Mapping[str, str]) -> ClusterFacts:
    """What phalanx run would detect here; a refusal is reported, not raised (the report goes on)."""
    try:
        environment = detect(environ, headless_service=environ.get("PHALANX_HEADLESS_SERVICE"))
        if environment is None:
            return ClusterFacts(None, "none detected: phalanx run takes the launch flags alone")
        placement = environment.placement()
    except SettingsRefused as refused:
        return ClusterFacts("refused", "phalanx run would refuse these variables", refused=refused.what,
                            hint=refused.hint)  # fmt: skip
    found = {"nnodes": placement.nnodes, "node_rank": placement.node_rank, "endpoint": placement.endpoint,
             "rdzv_id": placement.rdzv_id, "nproc_per_node": placement.nproc_per_node}  # fmt: skip
    values = {name: str(item.value) for name, item in found.items() if item is not None}
    if placement.hosts:
        values["hosts"] = ",".join(placement.hosts)
    return ClusterFacts(environment.name, placement.environment, values, placement.sources())
