"""phalanx's own programs (doctor, bench) run as a job's workers, through the same launcher: both
ends of the hand-over (settings in, rank 0's report out)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SETTINGS_FLAG = "--settings-json"
REPORT_FLAG = "--report"


@dataclass(frozen=True)
class ToolOutcome:
    exit_code: int
    #: Rank 0's report; None after --dry-run, when rank 0 ran on another node, or the job failed first.
    report: dict[str, Any] | None
    report_path: Path


def run_tool(
    args: argparse.Namespace,
    module: str,
    settings: Mapping[str, Any],
    check_setups: Callable[[Any], None] | None = None,
) -> ToolOutcome:
    """Launches ``python -m module`` on this host's nodes with the launch options in ``args``;
    ``check_setups`` as in :func:`phalanx.launch.job.run_nodes`."""
    from phalanx.launch.job import run_nodes
    from phalanx.launch.node_setup import new_run_dir
    from phalanx.launch.options import spec_from_args
    from phalanx.settings.entrypoint import Entrypoint

    spec = spec_from_args(args, entrypoint=Entrypoint(module, is_module=True))
    run_dir = new_run_dir(spec)
    # This launch's own name: nodes that share a file system may share the run's folder too, and
    # only the node whose worker is rank 0 (which got this launch's path) must find the report.
    report_path = (run_dir / f"report-{secrets.token_hex(4)}.json").resolve()
    worker_args = (SETTINGS_FLAG, json.dumps(dict(settings), sort_keys=True), REPORT_FLAG, str(report_path))
    # nodes started with different tool settings would issue different collectives and hang
    spec = replace(spec, entrypoint=Entrypoint(module, worker_args, is_module=True), extra_fingerprint=_flat(settings))
    exit_code = run_nodes(spec, run_dir, check_setups)
    return ToolOutcome(exit_code, None if spec.dry_run else read_report(report_path), report_path)


def _flat(settings: Mapping[str, Any], prefix: str = "") -> tuple[tuple[str, str], ...]:
    """{"collectives": {"iters": 20}} -> (("collectives.iters", "20"),): one row each in the lobby's table."""
    rows: list[tuple[str, str]] = []
    for key, value in settings.items():
        if isinstance(value, Mapping):
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", json.dumps(value)))
    return tuple(rows)


def read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ToolInvocation:
    """The worker's end: its settings and where rank 0 writes the report."""

    settings: dict[str, Any]
    report_path: Path

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> ToolInvocation:
        parser = argparse.ArgumentParser(description="a phalanx worker; started by phalanx doctor or phalanx bench")
        parser.add_argument(SETTINGS_FLAG, dest="settings", required=True)
        parser.add_argument(REPORT_FLAG, dest="report", required=True, type=Path)
        parsed = parser.parse_args(list(argv))
        return cls(json.loads(parsed.settings), parsed.report)

    def write_report(self, report: Mapping[str, Any]) -> None:
        """Written whole or not at all: a temporary file renamed over the final name."""
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.report_path.with_name(f".{self.report_path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(report, indent=1))
        os.replace(temporary, self.report_path)


@contextlib.contextmanager
def tool_context() -> Iterator[Any]:
    """The runtime context of a tool worker, with a process group even for a single process
    (a 1-rank group, so that the tool's collectives run unchanged at world size 1)."""
    import torch.distributed as dist

    from phalanx.runtime.context import destroy_process_group, init

    context = init()
    own_single_group = not dist.is_initialized()
    if own_single_group:
        dist.init_process_group(context.backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield context
    finally:
        if own_single_group:
            destroy_process_group()
        context.close()


def rank_identities(context: Any) -> list[dict[str, Any]]:
    """Every rank's rank, node label, host name, pid and device, in rank order (a collective)."""
    import socket

    import torch.distributed as dist

    from phalanx.worker_env import WorkerEnv

    mine = {
        "rank": context.rank,
        "node": WorkerEnv.from_env(os.environ).node or "node0",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(context.device),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered
