"""The program `phalanx bench ddp` runs on every rank (``python -m phalanx.bench.ddp_worker``);
every rank trains, global rank 0 writes the report that the command prints."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from phalanx.bench.ddp_models import MODELS
from phalanx.bench.ddp_report import ddp_row
from phalanx.bench.ddp_runner import measure, waiting_group
from phalanx.bench.ddp_settings import DdpSettings
from phalanx.launch.tool import ToolInvocation, rank_identities, tool_context
from phalanx.quick_exit import exit_quickly


def cpu_cores_per_host() -> dict[str, int]:
    """The CPU cores each host lets its ranks use (a collective)."""
    import torch.distributed as dist

    mine = (socket.gethostname(), len(os.sched_getaffinity(0)))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return dict(gathered)


def main(argv: Sequence[str] | None = None) -> int:
    invocation = ToolInvocation.from_argv(sys.argv[1:] if argv is None else argv)
    settings = DdpSettings.from_dict(invocation.settings["ddp"])
    with tool_context() as context:
        ranks = rank_identities(context)
        cores = cpu_cores_per_host()
        compressions, skipped = settings.runnable(context.backend, context.world_size)
        group = waiting_group(context)
        results = []
        for name in settings.models:
            for compression in compressions:
                if context.is_main:
                    print(f"training {name} with compression {compression}", file=sys.stderr, flush=True)
                times = measure(MODELS[name], compression, settings, context, group)
                results.append(ddp_row(name, compression, context.world_size, settings.batch_size, times))
        if context.is_main:
            invocation.write_report({
                "tool": "bench ddp", "world_size": context.world_size, "nodes": len({rank["node"] for rank in ranks}),
                "backend": context.backend, "settings": settings.to_dict(), "skipped": skipped, "ranks": ranks,
                "cpu_cores": cores, "results": results,
            })  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_quickly(main())
