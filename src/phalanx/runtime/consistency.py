"""Cross-rank consistency: compare what every rank believes before the first step.

A rank with another torch, another dataset length or another model shape does not crash
DDP: it hangs it, or trains something else in silence. One all_gather_object of a small
fingerprint turns that into an error, raised on every rank, that names the ranks and values.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch
import torch.distributed as dist

from phalanx.console import ranges
from phalanx.errors import PhalanxError
from phalanx.exit_codes import ExitCode
from phalanx.runtime.context import DistributedContext


class InconsistentRanks(PhalanxError, RuntimeError):
    """Raised on every rank when the ranks disagree on something that must be equal: the
    settings were refused (exit code 2 from ``phalanx run``)."""

    exit_code = ExitCode.REFUSED


def rank_fingerprint(
    context: DistributedContext, model: torch.nn.Module | None, dataset: Sized | None
) -> dict[str, Any]:
    """What this rank must agree on with the others: world size, backend, torch, model, dataset."""
    fingerprint: dict[str, Any] = {
        "world size": context.world_size,
        "backend": context.backend,
        "torch": torch.__version__,
    }
    if model is not None:
        fingerprint["parameter shapes"] = [f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters()]
    if dataset is not None:
        fingerprint["dataset length"] = len(dataset)
    return fingerprint


def check_consistency(
    context: DistributedContext, *, model: torch.nn.Module | None = None, dataset: Sized | None = None
) -> None:
    """A collective: every rank must call it with the same kind of arguments."""
    if not context.is_distributed or not dist.is_initialized():
        return
    mine = rank_fingerprint(context, model, dataset)
    everyone: list[Any] = [None] * context.world_size
    dist.all_gather_object(everyone, mine)
    problems = []
    for key in mine:
        groups: dict[str, list[int]] = {}
        for rank, fingerprint in enumerate(everyone):
            groups.setdefault(_short(fingerprint.get(key)), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {ranges(ranks)}: {value}" for value, ranks in groups.items())
            problems.append(f"{key}: {parts}")
    if problems:
        raise InconsistentRanks(
            "the ranks disagree before the first step",
            "\n".join(problems),
            "every rank must build the same model and dataset from the same code and data "
            "(check the files and arguments on every node)",
        )


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
