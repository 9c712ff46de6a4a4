"""The variables of this shell that the nodes of a job written here inherit."""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.errors import SettingsRefused


def refuse_torchrun_markers(
    environ: Mapping[str, str], inherit: str, where: str = "set in this shell", drop: str = "unset"
) -> None:
    """Refuses torchrun's PET_ variables that describe a job (PET_NNODES, PET_NODE_RANK, ...) in
    ``environ``, which every node inherits: beside the scheduler's own (or the flags each host
    gets) they describe the job twice, and phalanx run refuses to start. ``inherit``, ``where``
    and ``drop`` word the refusal: how the nodes inherit them, where they were set, how to drop them.
    """
    inherited = [name for name in TorchrunVariables.markers if name in environ]
    if inherited:
        raise SettingsRefused(
            f"{', '.join(f'{name}={environ[name]}' for name in inherited)} {where}",
            f"{inherit}, and torchrun's PET_ variables describe the job to each node: the same on every node, "
            "beside what phalanx gives each one, they would make phalanx run refuse to start.",
            f"{drop} {' '.join(inherited)}; give the settings as flags or PHALANX_<FLAG> variables",
        )
