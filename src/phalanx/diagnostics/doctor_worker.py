"""The program `phalanx doctor` runs on every rank (``python -m phalanx.diagnostics.doctor_worker``);
every rank takes part in each probe, global rank 0 writes the report."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from phalanx.bench.collective_report import collective_result
from phalanx.bench.collective_runner import CollectiveBench
from phalanx.bench.device_sync import barrier
from phalanx.console import say
from phalanx.diagnostics.doctor_settings import DoctorSettings
from phalanx.diagnostics.env_report import collect_env_report, comparable_facts
from phalanx.diagnostics.networks import Attachment, measure, pairs_to_measure, responding
from phalanx.diagnostics.probes import Probe
from phalanx.launch.tool import ToolInvocation, rank_identities, tool_context
from phalanx.quick_exit import exit_quickly
from phalanx.worker_env import WorkerEnv

T = TypeVar("T")


class _PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, measure: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = measure()
        self.seconds[name] = time.perf_counter() - started
        return result

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())


def _this_rank(context: Any) -> dict[str, Any]:
    env = collect_env_report()
    worker = WorkerEnv.from_env(os.environ)
    return {
        "address": worker.address or "127.0.0.1",
        "interface": os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME") or "(default)",
        "facts": comparable_facts(env),
        "traps": [dataclasses.asdict(finding) for finding in env.findings],
        "gpus": len(env.gpus.devices),
        "processes": context.local_world_size,
    }


def _nodes(ranks: list[dict[str, Any]], details: list[dict[str, Any]]) -> list[dict[str, Any]]:
    nodes: dict[str, dict[str, Any]] = {}
    for rank, detail in zip(ranks, details):
        node = nodes.setdefault(rank["node"], {"label": rank["node"], "host": rank["host"], "ranks": [], **detail})
        node["ranks"].append(rank["rank"])
    return list(nodes.values())  # in order of their lowest rank


def _networks(context: Any, nodes: list[dict[str, Any]], message_bytes: int) -> list[dict[str, Any]]:
    """Each network two nodes' leads share, measured between them one at a time; the figures are
    on the lower lead. Every node's addresses (its attachments) go into its ``networks``."""
    leads = [node["ranks"][0] for node in nodes]
    mine = next((node["address"] for node in nodes if node["ranks"][0] == context.rank), None)
    with responding(mine) if mine is not None else contextlib.nullcontext([]) as attachments:
        gathered: list[Any] = [None] * context.world_size
        dist.all_gather_object(gathered, [dataclasses.asdict(attachment) for attachment in attachments])
        for node, lead in zip(nodes, leads):
            node["networks"] = gathered[lead]
        attached = {lead: [Attachment(**attachment) for attachment in gathered[lead]] for lead in leads}
        figures = []
        for source, target, ours, theirs in pairs_to_measure(attached):
            if context.rank == source:  # measure() never raises: every rank reaches each barrier
                figures.append(dataclasses.asdict(measure(source, target, ours, theirs, message_bytes)))
            barrier(context.device)  # one pair and network at a time; the listeners stay until the last
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    invocation = ToolInvocation.from_argv(sys.argv[1:] if argv is None else argv)
    settings = DoctorSettings(**invocation.settings)
    with tool_context() as context:
        ranks = rank_identities(context)
        details: list[Any] = [None] * context.world_size
        dist.all_gather_object(details, _this_rank(context))
        nodes = _nodes(ranks, details)
        leads = [node["ranks"][0] for node in nodes]
        probe = Probe(context.device)
        progress = say if context.is_main else (lambda text: None)
        progress(f"doctor: {len(nodes)} node(s), {context.world_size} ranks: clocks, links, all-reduce, compute, "
                 "networks")  # fmt: skip
        timer = _PhaseTimer()
        offsets = timer.run("clocks", lambda: probe.clock_offsets(leads))
        links = timer.run(
            "links", lambda: [probe.link(a, b, settings.p2p_bytes) for i, a in enumerate(leads) for b in leads[i + 1 :]]
        )
        allreduce_settings = settings.allreduce()
        rows = timer.run("all-reduce", lambda: CollectiveBench(allreduce_settings, "all_reduce", context.device).rows())
        compute = timer.run("compute", probe.compute)
        networks = timer.run("networks", lambda: _networks(context, nodes, settings.p2p_bytes))
        progress(f"doctor: measured in {timer}")
        gathered: list[Any] = [None] * context.world_size
        dist.all_gather_object(gathered, ([dataclasses.asdict(o) for o in offsets],
                                          [dataclasses.asdict(link) for link in links if link],
                                          dataclasses.asdict(compute), networks))  # fmt: skip
        if context.is_main:
            measured_links = [link for _, rank_links, _, _ in gathered for link in rank_links]
            timed = [link for link in measured_links if link["bandwidth_bytes_per_s"] is not None]
            slowest = min(timed, key=lambda link: link["bandwidth_bytes_per_s"], default=None)
            invocation.write_report({
                "tool": "doctor", "world_size": context.world_size, "backend": context.backend,
                "simulated": all(node["address"].startswith("127.") for node in nodes) and len(nodes) > 1,
                "settings": dataclasses.asdict(settings), "ranks": ranks, "nodes": nodes,
                "clock_offsets": [offset for rank_offsets, _, _, _ in gathered for offset in rank_offsets],
                "links": measured_links,
                "networks": [figure for _, _, _, rank_networks in gathered for figure in rank_networks],
                "allreduce": collective_result(allreduce_settings, "all_reduce", rows),
                "compute": [rank_compute for _, _, rank_compute, _ in gathered],
                # the slowest link between nodes: what `phalanx plan --from-doctor` reads
                "network": None if slowest is None else {"bandwidth_bytes_per_s": slowest["bandwidth_bytes_per_s"],
                                                         "latency_s": slowest["latency_s"]},
            })  # fmt: skip
    return 0


if __name__ == "__main__":
    exit_quickly(main())
