"""The program `phalanx bench collectives` runs on every rank (``python -m phalanx.bench.collectives_worker``);
every rank measures, global rank 0 writes the report that the command prints."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

from phalanx.bench.collective_report import collective_result, format_row, table_header
from phalanx.bench.collective_runner import CollectiveBench, Row
from phalanx.bench.collective_settings import CollectiveSettings
from phalanx.launch.tool import ToolInvocation, rank_identities, tool_context
from phalanx.quick_exit import exit_quickly


def link_of_this_node(line_rate_override: float | None) -> tuple[str | None, float | None]:
    """The interface the launcher chose for this node, and its line rate in bytes/s when known."""
    import psutil

    chosen = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    interface = chosen.split(",")[0] if chosen else None  # gloo and NCCL take a list: name the first
    if line_rate_override:
        return interface, line_rate_override
    stats = psutil.net_if_stats().get(interface or "")
    speed_mbit = stats.speed if stats else 0  # 0: the OS does not know (loopback, many virtual links)
    return interface, speed_mbit * 1e6 / 8 if speed_mbit else None


def _show_row(settings: CollectiveSettings, name: str, row: Row) -> None:
    """A row as soon as it is measured: a run stopped early shows what it measured."""
    print(format_row(settings, name, row), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    invocation = ToolInvocation.from_argv(sys.argv[1:] if argv is None else argv)
    settings = CollectiveSettings.from_dict(invocation.settings["collectives"])
    with tool_context() as context:
        ranks = rank_identities(context)
        results: list[dict[str, Any]] = []
        for name in settings.collectives:
            if context.is_main:  # the rows as measured; the report's table has them all at the end
                print(f"measuring {name} at {len(settings.sizes)} sizes", *table_header(), sep="\n", file=sys.stderr,
                      flush=True)  # fmt: skip
            show = functools.partial(_show_row, settings, name) if context.is_main else None
            rows = CollectiveBench(settings, name, context.device).rows(show)
            results.append(collective_result(settings, name, rows))
        if context.is_main:
            interface, line_rate = link_of_this_node(invocation.settings.get("line_rate"))
            invocation.write_report({
                "tool": "bench collectives", "world_size": context.world_size,
                "nodes": len({rank["node"] for rank in ranks}), "backend": context.backend,
                "interface": interface, "line_rate": line_rate, "settings": settings.to_dict(),
                "ranks": ranks, "results": results,
            })  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_quickly(main())
