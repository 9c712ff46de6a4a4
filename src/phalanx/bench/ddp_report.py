"""`phalanx bench ddp` results: the figures derived from the step times, the JSON report and the table."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from phalanx.bench.ddp_models import MODELS
from phalanx.bench.ddp_settings import DdpSettings
from phalanx.console import format_table

if TYPE_CHECKING:
    from phalanx.bench.ddp_runner import StepTimes

#: A waiting rank using more than this share of a core would disturb the baseline on shared cores
#: (a barrier call's own work is a few percent of a short baseline step; spinning would be ~100%).
WAITING_CPU_WARNING = 0.25


def ddp_row(model: str, compression: str, world_size: int, batch_size: int, times: StepTimes) -> dict[str, Any]:
    """One model and compression: the definitions of --help, applied to the agreed step times."""
    samples_per_s = world_size * batch_size / times.step
    baseline_samples_per_s = batch_size / times.baseline
    return {
        "model": model,
        "parameters": MODELS[model].parameters,
        "compression": compression,
        "world_size": world_size,
        "batch_size": batch_size,
        "step_ms": times.step * 1e3,
        "compute_ms": times.compute * 1e3,
        "baseline_step_ms": times.baseline * 1e3,
        "samples_per_s": samples_per_s,
        "baseline_samples_per_s": baseline_samples_per_s,
        "scaling_efficiency": samples_per_s / (world_size * baseline_samples_per_s),
        "comm_fraction": max(0.0, 1.0 - times.compute / times.step),
        "waiting_cpu_fraction": times.waiting_cpu,
    }


def _parameters_text(count: int) -> str:
    for unit, scale in (("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "params", "compression", "world", "samples/s", "1-process samples/s", "scaling eff.",
               "step (ms)", "compute (ms)", "comm %"]  # fmt: skip
    cells = [
        [row["model"], _parameters_text(row["parameters"]), row["compression"], row["world_size"],
         f"{row['samples_per_s']:.1f}", f"{row['baseline_samples_per_s']:.1f}", f"{row['scaling_efficiency']:.2f}",
         f"{row['step_ms']:.2f}", f"{row['compute_ms']:.2f}", f"{100 * row['comm_fraction']:.1f}"]
        for row in rows
    ]  # fmt: skip
    return format_table(headers, cells)


def _waiting_cpu(report: dict[str, Any]) -> float:
    return max((row["waiting_cpu_fraction"] for row in report["results"]), default=0.0)


def _notes(report: dict[str, Any]) -> list[str]:
    notes = [f"# skipped --compression {name}: {why}" for name, why in report["skipped"].items()]
    if report["world_size"] == 1:
        notes.append("# one process: wrap_model makes no DDP and nothing is sent, so every figure is the 1-process "
                     "baseline's; run with --nproc-per-node 2 or --simulate-nodes 2")  # fmt: skip
    ranks_per_host = Counter(rank["host"] for rank in report["ranks"])
    for host, ranks in ranks_per_host.items():
        cores = report["cpu_cores"].get(host, 0)
        if cores and ranks > cores:
            notes.append(f"# {ranks} ranks share {cores} CPU cores on {host}: the scaling efficiency measures the shared "
                         "cores as much as the network")  # fmt: skip
    busiest = _waiting_cpu(report)
    if busiest > WAITING_CPU_WARNING:
        notes.append(f"# the ranks waiting out the 1-process baseline used up to {100 * busiest:.0f}% of a core: "
                     "the baseline may be slowed where they share its cores")  # fmt: skip
    return notes


def format_report(report: dict[str, Any]) -> str:
    settings = DdpSettings.from_dict(report["settings"])
    warmups = sorted({settings.warmup_for(row["compression"]) for row in report["results"]})
    warmup = " or ".join(map(str, warmups or [settings.warmup_steps]))
    waited = f"; the waiting ranks used {100 * _waiting_cpu(report):.1f}% of a core during the 1-process baseline"
    head = [
        f"# phalanx bench ddp: {report['world_size']} rank{'s' * (report['world_size'] != 1)} on {report['nodes']} node(s), backend {report['backend']}, "
        f"batch {settings.batch_size} per process, medians of {settings.steps} steps after {warmup} warm-up",
        "# samples/s = world x batch / step time; scaling eff. = samples/s / (world x 1-process samples/s)",
        "# comm % = 1 - compute / step: the part of a DDP step spent waiting on communication (no_sync leaves it out)",
        "# each time: the median per rank, then the slowest rank's" + (waited if report["world_size"] > 1 else ""),
        *_notes(report),
    ]
    return "\n".join([*head, format_rows(report["results"])])
