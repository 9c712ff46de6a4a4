"""LaunchSpec: everything `phalanx run` was asked to do, typed and checked once, at the edge."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.clusters.environment import Placement
from phalanx.errors import SettingsRefused
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import blaming
from phalanx.settings.values import DEFAULT_HEARTBEAT_TIMEOUT_S, Endpoint, NodeRange

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LaunchSpec:
    """A launch as the user asked for it, typed and checked: what `phalanx run` sets nodes up from.
    Made by :func:`phalanx.launch.options.spec_from_args`; refuses settings that contradict each other.

    The fields from ``nnodes`` to ``headless_service`` are the launch options, documented in
    :data:`phalanx.settings.options.LAUNCH_OPTIONS`; the defaults here are what an option left
    unset means. The fields after them are what phalanx found.
    """

    #: What every worker runs.
    entrypoint: Entrypoint
    nnodes: NodeRange = NodeRange(1, 1)
    nproc_per_node: int | str = 1
    rdzv_endpoint: Endpoint | None = None
    rdzv_id: str = "phalanx"
    max_restarts: int = 0
    heal: int = 0
    log_dir: Path = Path("phalanx-logs")
    backend: str = "auto"
    interface: str | None = None
    join_timeout: float = 300.0
    last_call: float = 30.0
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    simulate_nodes: int = 0
    standalone: bool = False
    all_ranks: bool = False
    independent_ranks: bool = False
    allow_public_endpoint: bool = False
    dry_run: bool = False
    headless_service: str | None = None
    #: The config file the settings were read from (--config, else $PHALANX_CONFIG), if any.
    config_file: Path | None = field(default=None, compare=False)
    #: Where the cluster environment (SLURM, Kubernetes, ...) places this node: None without one.
    placement: Placement | None = field(default=None, compare=False)
    #: This node's rank by the cluster environment, when the endpoint is the environment's too.
    node_rank: int | None = None
    #: Lines for the decision block: the environment, what was read, what the user overrode.
    cluster_notes: tuple[str, ...] = ()
    #: Where the endpoint came from when the cluster environment gave it (None: the user set it).
    endpoint_origin: str | None = None
    #: Where each setting the user gave came from, by field: ``--nnodes``, ``PHALANX_NNODES=2``, ...
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: Settings beyond the launch settings that every node must share (phalanx's own tools' settings).
    extra_fingerprint: tuple[tuple[str, str], ...] = ()

    @property
    def endpoint_text(self) -> str:
        """The endpoint as messages name it: the flag, or the environment's variables."""
        if self.endpoint_origin:
            return f"the endpoint {self.rdzv_endpoint} ({self.endpoint_origin})"
        return f"--rdzv-endpoint {self.rdzv_endpoint}"

    def __post_init__(self) -> None:
        self._check_node_count()
        self._check_endpoint()
        self.entrypoint.check_exists()

    def blamed(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Within, a refusal of setting ``name`` names where the value came from (:func:`blaming`)."""
        return blaming(self.origins.get(name, ""))

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes.max > 1

    def _check_node_count(self) -> None:
        if self.simulate_nodes:
            if self.nnodes != NodeRange(1, 1) and self.nnodes != NodeRange(self.simulate_nodes, self.simulate_nodes):
                raise SettingsRefused(
                    f"--simulate-nodes {self.simulate_nodes} with --nnodes {self.nnodes}",
                    "a simulated job has exactly the simulated number of nodes, all on this host.",
                    f"drop --nnodes, or set it to {self.simulate_nodes}",
                )
            if self.standalone:
                raise SettingsRefused(
                    f"--simulate-nodes {self.simulate_nodes} with --standalone",
                    "--standalone means one node; a simulation runs several node agents.",
                    "drop --standalone",
                )
        elif self.standalone and self.is_multi_node:
            raise SettingsRefused(
                f"--standalone with --nnodes {self.nnodes}",
                "--standalone starts a private rendezvous on this host, which the other nodes cannot join.",
                "drop --standalone and give every node --rdzv-endpoint MAIN_NODE_IP:PORT; "
                "to rehearse on one machine use --simulate-nodes N",
            )
        if self.is_multi_node and not self.simulate_nodes and self.rdzv_endpoint is None:
            raise SettingsRefused(
                f"--nnodes {self.nnodes} without --rdzv-endpoint",
                "the nodes need one address they can all reach to find each other.",
                "add --rdzv-endpoint MAIN_NODE_IP:29400 (the same on every node), "
                "or rehearse on this machine with --simulate-nodes N",
            )

    def _check_endpoint(self) -> None:
        endpoint = self.rdzv_endpoint
        if endpoint is None:
            return
        if self.simulate_nodes:
            if not is_loopback_host(endpoint.host):
                raise SettingsRefused(
                    f"--simulate-nodes {self.simulate_nodes} with --rdzv-endpoint {endpoint}",
                    "simulated nodes all run on this host and meet on the loopback interface.",
                    "drop --rdzv-endpoint (a free local port is chosen), or give a 127.0.0.1:PORT endpoint",
                )
            return
        if self.standalone:
            raise SettingsRefused(
                f"--standalone with --rdzv-endpoint {endpoint}",
                "--standalone picks its own local endpoint; the two contradict each other.",
                "drop one of them",
            )
        if self.is_multi_node and is_loopback_host(endpoint.host):
            raise SettingsRefused(
                f"{self.endpoint_text} is a loopback address, but "
                + (f"the job has {self.nnodes} nodes" if self.placement else f"--nnodes is {self.nnodes}"),
                "on every other node that address means the node itself, so the nodes can never meet.",
                "use the main node's address on the network the nodes share (see `ip -br addr` there), "
                "e.g. --rdzv-endpoint 10.0.0.1:29400; to rehearse on this machine use --simulate-nodes "
                f"{self.nnodes.max}",
            )
