"""Which cluster environment ``phalanx run`` runs in, by one documented precedence.

1. Inside a torchrun worker already (``TORCHELASTIC_RUN_ID``, or ``LOCAL_RANK`` with ``RANK``):
   refused, since a second launcher under the first would start workers of workers.
2. One of :data:`ENVIRONMENTS` (SLURM, a Kubeflow PyTorchJob, torchrun's ``PET_`` variables, an
   Indexed Job, SkyPilot), when exactly one describes the job. One that ``covers`` another (a
   PyTorchJob's pods also carry ``PET_`` variables) takes its place; two that do not (SLURM and
   Kubeflow variables at once) are refused, as nobody can tell which is right.
3. None: the launch flags alone, as on a machine without a scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.clusters.environment import ClusterEnvironment
from phalanx.clusters.indexed_job import IndexedJob
from phalanx.clusters.pytorchjob import PyTorchJob
from phalanx.clusters.skypilot import SkyPilot
from phalanx.clusters.slurm import Slurm
from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.errors import SettingsRefused

#: Every environment phalanx knows, each detected by its own variables.
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (Slurm, PyTorchJob, TorchrunVariables, IndexedJob, SkyPilot)


def inside_torchrun(environ: Mapping[str, str]) -> list[str]:
    """The variables that say this process is a worker of torchrun (or of phalanx run) already."""
    if environ.get("TORCHELASTIC_RUN_ID"):
        return [f"TORCHELASTIC_RUN_ID={environ['TORCHELASTIC_RUN_ID']}"]
    if environ.get("LOCAL_RANK") and environ.get("RANK"):
        return [f"LOCAL_RANK={environ['LOCAL_RANK']}", f"RANK={environ['RANK']}"]
    return []


def detect(environ: Mapping[str, str], *, headless_service: str | None = None) -> ClusterEnvironment | None:
    """The cluster environment whose variables ``environ`` sets, or None where only the launch flags
    count; refused inside a torchrun worker, or where two environments contradict each other.
    ``headless_service`` is an Indexed Job's (``--headless-service``): the pod's environment does
    not name it.

    Example:
        >>> env = detect({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"})
        >>> env.name, env.placement().endpoint.value.host
        ('SLURM', 'n1')
    """
    worker = inside_torchrun(environ)
    if worker:
        raise SettingsRefused(
            f"phalanx run was started inside a torchrun worker ({', '.join(worker)})",
            "it would start a second launcher under the first, and workers of workers.",
            "run the script directly where torchrun started it (it is one of torchrun's workers already), "
            "or start it with phalanx run instead of torchrun",
        )
    found: list[ClusterEnvironment] = []
    for kind in ENVIRONMENTS:
        if kind.detect(environ):
            found.append(kind(environ, headless_service) if kind is IndexedJob else kind(environ))  # type: ignore[call-arg]
    covered = {kind for environment in found for kind in environment.covers}
    found = [environment for environment in found if type(environment) not in covered]
    if len(found) > 1:
        described = "; ".join(f"{e.name} ({', '.join(e.markers_set())})" for e in found)
        raise SettingsRefused(
            f"the variables of {len(found)} cluster environments are set: {described}",
            "each describes the job's nodes its own way, and phalanx cannot tell which one started this node.",
            "unset the variables of the environment that does not run this job (often exported by a job script "
            "or baked into a container image)",
        )
    return found[0] if found else None
