"""What a cluster environment tells a node about its job, and the interface every environment has.

A scheduler that starts ``phalanx run`` on each node (SLURM's srun, a Kubernetes controller,
SkyPilot) says in environment variables how many nodes the job has, which one this is, and
often where they meet. Each environment is one small class that reads its own variables into a
:class:`Placement`; :func:`phalanx.clusters.detect` picks the one that applies.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from phalanx.errors import SettingsRefused
from phalanx.settings.values import Endpoint, InvalidValue, NodeRange

T = TypeVar("T")


@dataclass(frozen=True)
class Found(Generic[T]):
    """A value an environment gave, and where it came from (``SLURM_NODEID=1``)."""

    value: T
    source: str


@dataclass(frozen=True)
class Placement:
    """This node's place in the job, as its cluster environment describes it.

    Every field but ``environment`` may be missing: an environment says only what it knows (an
    Indexed Job knows this pod's index but not how many pods there are).
    """

    #: The environment's name, as in its class (``SLURM``).
    name: str
    #: Which job, in words: ``SLURM job 4242 (step 0) on n[1-2]``.
    environment: str
    nnodes: Found[NodeRange] | None = None
    node_rank: Found[int] | None = None
    endpoint: Found[Endpoint] | None = None
    rdzv_id: Found[str] | None = None
    nproc_per_node: Found[int | str] | None = None
    #: Every node's host name or address, in node-rank order, where the environment lists them.
    hosts: tuple[str, ...] = ()
    #: Host names may resolve only once every pod is scheduled (Kubernetes' DNS).
    dns_may_lag: bool = False
    #: Lines for the decision block beyond the values above.
    notes: tuple[str, ...] = field(default=(), compare=False)
    #: Why this environment names no endpoint, and the HINT, for a job of several nodes that has
    #: none (None: the environment would have named it; the user gives the first node's address).
    no_endpoint: tuple[str, str] | None = field(default=None, compare=False)

    def sources(self) -> list[str]:
        """Every variable this placement was read from, for the decision block."""
        found = (self.nnodes, self.node_rank, self.endpoint, self.rdzv_id, self.nproc_per_node)
        return [item.source for item in found if item is not None]


class ClusterEnvironment(abc.ABC):
    """One kind of cluster environment: detects itself and reads this node's :class:`Placement`."""

    #: The environment's name, as messages and ``phalanx env`` show it.
    name: ClassVar[str]
    #: The variables that give it away; :meth:`detect` is true when any of them is set.
    markers: ClassVar[tuple[str, ...]]
    #: Environments that describe the same job again when this one is found (a PyTorchJob's
    #: pods also carry torchrun's PET_ variables): they are not told apart as a contradiction.
    covers: ClassVar[tuple[type[ClusterEnvironment], ...]] = ()

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """Whether this environment is the one ``phalanx run`` runs in."""
        return any(environ.get(name) for name in cls.markers)

    def markers_set(self) -> list[str]:
        """The marker variables that are set, as ``NAME=value``."""
        return [f"{name}={self.environ[name]}" for name in self.markers if self.environ.get(name)]

    @abc.abstractmethod
    def placement(self) -> Placement:
        """This node's place in the job; refused where a variable does not parse, or variables
        contradict each other or what ``phalanx run`` can do (one launcher per node)."""

    # -- reading variables, with refusals that name them -----------------------------------
    def _text(self, *names: str) -> Found[str] | None:
        """The first of ``names`` that is set (several spellings of one value), or None."""
        for name in names:
            value = self.environ.get(name)
            if value:
                return Found(value.strip(), f"{name}={value.strip()}")
        return None

    def _int(self, *names: str, minimum: int = 0) -> Found[int] | None:
        found = self._text(*names)
        if found is None:
            return None
        if not found.value.isdigit() or int(found.value) < minimum:
            raise self._refuse_variable(found.source, f"a whole number of at least {minimum}")
        return Found(int(found.value), found.source)

    def _gpus(self, name: str) -> Found[int | str] | None:
        """A GPU count variable as the processes per node, where it is set and positive."""
        gpus = self._int(name)
        return Found(gpus.value, gpus.source) if gpus is not None and gpus.value > 0 else None

    def _nodes_of(
        self, hosts: list[str], listed: str, count: Found[int] | None, rank_variable: str
    ) -> tuple[Found[int], Found[int]]:
        """The node count and this node's rank, for an environment that lists every node's host;
        refused where its count or this node's rank disagrees with the list."""
        nnodes = count or Found(len(hosts), listed)
        if nnodes.value != len(hosts):
            raise SettingsRefused(
                f"{self.name}: {nnodes.source} but {listed} names {len(hosts)} host(s)",
                "the two variables describe the same nodes and must agree.",
                "unset whichever of them the job script or image sets by hand",
            )
        rank = self._int(rank_variable) or Found(0, f"{rank_variable} not set: node 0")
        if rank.value >= len(hosts):
            raise self._refuse_variable(
                f"{rank.source} with {len(hosts)} node(s) in {listed}", "a node rank below the node count"
            )
        return nnodes, rank

    def _refuse_variable(self, source: str, expected: str) -> SettingsRefused:
        return SettingsRefused(
            f"{self.name}: {source} does not parse: phalanx expects {expected}",
            f"phalanx reads it to place this node in the job ({self.name} sets it on every node).",
            "fix or unset the variable; a job started by the scheduler itself never has it wrong, so look "
            "for an `export` of it in the job script or the container image",
        )

    def _parsed(self, name: str, parse: Callable[[str], T], expected: str) -> Found[T] | None:
        """A variable parsed as the launch flag of the same meaning parses its value."""
        found = self._text(name)
        if found is None:
            return None
        try:
            return Found(parse(found.value), found.source)
        except InvalidValue:
            raise self._refuse_variable(found.source, expected) from None
