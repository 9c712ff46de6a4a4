"""SkyPilot: the cluster's node IPs, this node's rank and its GPUs, from ``SKYPILOT_*`` variables."""

from __future__ import annotations

import re

from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.errors import SettingsRefused
from phalanx.settings import values


class SkyPilot(ClusterEnvironment):
    """A node of a SkyPilot cluster: every node's IP, this node's rank, its GPUs."""

    name = "SkyPilot"
    markers = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS")

    def placement(self) -> Placement:
        ips_text = self._text("SKYPILOT_NODE_IPS")
        if ips_text is None:
            raise SettingsRefused(
                f"{self.name}: SKYPILOT_NODE_RANK is set, but not SKYPILOT_NODE_IPS",
                "phalanx needs the first node's address to meet the other nodes.",
                "run phalanx from the task's `run:` section, where SkyPilot sets both",
            )
        ips = [line.strip() for line in ips_text.value.splitlines() if line.strip()]
        count = self._int("SKYPILOT_NUM_NODES", minimum=1)
        nnodes, rank = self._nodes_of(ips, "SKYPILOT_NODE_IPS", count, "SKYPILOT_NODE_RANK")
        try:
            endpoint = values.parse_endpoint(ips[0])
        except values.InvalidValue:
            raise self._refuse_variable("SKYPILOT_NODE_IPS", "one IP address per line") from None
        task = self.environ.get("SKYPILOT_TASK_ID", "")
        rdzv_id = re.sub(r"[^A-Za-z0-9_.-]", "-", task)[-64:].strip("-.")
        return Placement(
            name=self.name,
            environment=f"{self.name} cluster of {len(ips)} node(s)",
            nnodes=Found(values.NodeRange(len(ips), len(ips)), nnodes.source),
            node_rank=rank,
            endpoint=Found(endpoint, f"the first line of SKYPILOT_NODE_IPS, port {values.DEFAULT_RDZV_PORT}"),
            rdzv_id=Found(rdzv_id, "SKYPILOT_TASK_ID") if rdzv_id else None,
            nproc_per_node=self._gpus("SKYPILOT_NUM_GPUS_PER_NODE"),
            hosts=tuple(ips),
        )
