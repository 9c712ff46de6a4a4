"""The variables of this shell that the nodes of a job written here inherit."""

from __future__ import annotations

from collections.abc import Mapping

from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.errors import SettingsRefused


def refuse_torchrun_markers(
    environ: Mapping[str, str], inherit: str, where: str = "set in this shell", drop: str = "unset"
) -> None:
    """Refuses torchrun's PET_ variables that describe a job (PET_NNODES, PET_NODE_RANK, ...) where
    every node inherits them: there, beside the scheduler's own (or the flags each host gets),
    they describe the job twice, the same on every node, and phalanx run refuses to start.

    Args:
        environ: the variables every node inherits.
        inherit: how the nodes inherit them, as a clause ("the batch job's nodes inherit this
            shell's variables").
        where: where the variables were set, as the refusal says it.
        drop: how to drop them, as the HINT says it (``unset``, ``leave out --env``).

    Raises:
        SettingsRefused: one is set.
    """
    inherited = [name for name in TorchrunVariables.markers if name in environ]
    if inherited:
        raise SettingsRefused(
            f"{', '.join(f'{name}={environ[name]}' for name in inherited)} {where}",
            f"{inherit}, and torchrun's PET_ variables describe the job to each node: the same on every node, "
            "beside what phalanx gives each one, they would make phalanx run refuse to start.",
            f"{drop} {' '.join(inherited)}; give the settings as flags or PHALANX_<FLAG> variables",
        )
