"""What heal mode needs of a run's objects: the settings it handles, and the states it rolls back."""

from __future__ import annotations

import copy
from typing import Any

import torch

from phalanx.errors import SettingsRefused


def check_settings(checkpoints: bool, keep_last_step: bool, async_checkpoints: bool, accumulate: int) -> None:
    """Refuses the settings heal mode does not handle yet, before the first step.

    Raises:
        SettingsRefused: no checkpoint folder or keep_last_step off (the fallback, a restart,
            resumes from them), async checkpoints, or gradient accumulation.
    """
    if not (checkpoints and keep_last_step):
        raise SettingsRefused("--heal without a checkpoint folder and keep_last_step",
                              "a heal that cannot finish falls back to a restart, which resumes from them.",
                              "give phalanx.Run a checkpoint_dir (and keep keep_last_step=True)")  # fmt: skip
    if async_checkpoints:
        raise SettingsRefused("--heal with async_checkpoints=True",
                              "a save in the background would still use the group that a heal replaces.",
                              "leave async_checkpoints out with --heal")  # fmt: skip
    if accumulate > 1:
        raise SettingsRefused(f"--heal with accumulate={accumulate}",
                              "a failed step is trained again from its first micro-batch, which the loop's own "
                              "count of micro-batches does not follow yet.", "use accumulate=1 with --heal")  # fmt: skip


def rollback_states(tracked: dict[str, Any]) -> dict[str, Any]:
    """What heal mode rolls back after a failed step, copied: the states of the tracked objects
    other than the model, the optimizers and the data (an LR scheduler, a scaler), and the
    optimizers' hyperparameters (a scheduler's step in the failed step changed the rate).

    Args:
        tracked: the run's tracked objects by name.

    Returns:
        A copy of each rolled-back state, by name (an optimizer's: its param_groups without params).
    """
    others: dict[str, Any] = {}
    for name, target in tracked.items():
        if isinstance(target, torch.optim.Optimizer):
            others[name] = [copy.deepcopy({key: value for key, value in group.items() if key != "params"})
                            for group in target.param_groups]  # fmt: skip
        elif name not in ("model", "data"):
            others[name] = copy.deepcopy(target.state_dict())
    return others
