"""`phalanx doctor`'s report as text: the nodes side by side, the measurements, the verdict."""

from __future__ import annotations

import statistics
from typing import Any

from phalanx.console import format_table
from phalanx.diagnostics.verdict import Finding, node_names, rank_nodes
from phalanx.launch.network import speed_text


def _nodes_table(report: dict[str, Any]) -> str:
    nodes = report["nodes"]
    offsets = {offset["rank"]: offset["offset_s"] for offset in report["clock_offsets"]}
    names = node_names(report)
    headers = ["", *(names[node["label"]] for node in nodes), ""]
    placed = [
        ("host", [node["host"] for node in nodes]),
        ("interface", [node["interface"] for node in nodes]),
        ("processes / GPUs", [f"{node['processes']} / {node['gpus']}" for node in nodes]),
        (
            "clock offset",
            ["rank 0" if 0 in node["ranks"] else f"{offsets.get(node['ranks'][0], 0.0):+.3f} s" for node in nodes],
        ),
    ]
    keys = sorted({key for node in nodes for key in node["facts"]}, key=lambda key: (key.startswith("env "), key))
    compared = [(key, [node["facts"].get(key, "(not set)") for node in nodes]) for key in keys]
    rows = [[name, *values, ""] for name, values in placed]
    rows += [[name, *values, "<- differs" if len(set(values)) > 1 else ""] for name, values in compared]
    return "nodes (the rows below the line must be equal on every node)\n" + format_table(
        headers, [*rows[:4], ["-" * 16] + [""] * (len(headers) - 1), *rows[4:]]
    )


def _links_table(report: dict[str, Any]) -> str:
    labels = rank_nodes(report)
    if not report["links"]:
        return "links between nodes\n  none: one node (run with --nnodes or --simulate-nodes to measure links)"

    def rate(link: dict[str, Any], scale: float) -> str:
        value = link["bandwidth_bytes_per_s"]
        return "too short to time" if value is None else f"{value * scale:.3g}"

    rows = [
        [
            labels[link["source"]],
            labels[link["target"]],
            f"{link['latency_s'] * 1e6:.0f}",
            rate(link, 8 / 1e9),
            rate(link, 1e-9),
        ]
        for link in report["links"]
    ]
    size = report["settings"]["p2p_bytes"]
    title = f"links between nodes (lead ranks, point to point, {size / 1024**2:g} MiB one way)"
    return title + "\n" + format_table(["from", "to", "latency (us)", "bandwidth (Gbit/s)", "(GB/s)"], rows)


def _networks_table(report: dict[str, Any]) -> str:
    title = "networks between nodes (plain TCP over each subnet two nodes are on; * the workers' network)"
    if len(report["nodes"]) < 2:
        return f"{title}\n  none: one node"
    if not report["networks"]:
        why = ("simulated nodes share this host's networks" if report["simulated"]
               else "no two nodes on different hosts share a private IPv4 subnet")  # fmt: skip
        return f"{title}\n  none measured: {why}"
    labels = rank_nodes(report)
    workers = {a["network"] for node in report["nodes"] for a in node["networks"] if a["address"] == node["address"]}
    speeds = {(node["ranks"][0], a["network"]): a["speed_mbps"] for node in report["nodes"] for a in node["networks"]}

    def kernel_speed(figure: dict[str, Any]) -> str:
        ends = {speeds.get((figure[end], figure["network"]), 0) for end in ("source", "target")}
        return "unknown" if ends == {0} else " / ".join(speed_text(mbps) if mbps else "?" for mbps in sorted(ends))

    rows = [
        [
            f"{figure['network']}{' *' if figure['network'] in workers else ''}",
            labels[figure["source"]],
            labels[figure["target"]],
            f"{figure['source_interface']} -> {figure['target_interface']}",
            kernel_speed(figure),
            "-" if figure["latency_s"] is None else f"{figure['latency_s'] * 1e6:.0f}",
            figure["error"] or ("too short to time" if figure["bandwidth_bytes_per_s"] is None
                                else f"{figure['bandwidth_bytes_per_s'] * 8 / 1e9:.3g}"),
        ]
        for figure in report["networks"]
    ]  # fmt: skip
    headers = ["network", "from", "to", "interfaces", "link speed (kernel)", "latency (us)", "bandwidth (Gbit/s)"]
    return f"{title}\n" + format_table(headers, rows)


def _allreduce_table(report: dict[str, Any]) -> str:
    result = report["allreduce"]
    rows = [
        [
            row["size_bytes"],
            f"{row['in_place']['time_us']:.0f}",
            f"{row['in_place']['busbw']:.3g}",
            row["in_place"]["wrong"],
        ]
        for row in result["rows"]
    ]
    title = f"all_reduce over all {report['world_size']} ranks (busbw as nccl-tests: algbw x 2(n-1)/n)"
    return title + "\n" + format_table(["size (B)", "time (us)", "busbw (GB/s)", "#wrong"], rows)


def _compute_table(report: dict[str, Any]) -> str:
    labels = rank_nodes(report)
    median = statistics.median(c["gflops"] for c in report["compute"])
    rows = [
        [c["rank"], labels[c["rank"]], f"{c['gflops']:.1f}", f"{c['gflops'] / median:.1%}"] for c in report["compute"]
    ]
    size = report["compute"][0]["matrix"]
    title = f"compute ({size}x{size} float32 matmul on every rank at once)"
    return title + "\n" + format_table(["rank", "node", "GFLOP/s", "of median"], rows)


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "verdict\n  no problems found"
    lines = ["verdict"]
    for finding in findings:
        lines += [f"  {finding.severity.upper()}: {finding.what}", f"    HINT: {finding.hint}"]
    return "\n".join(lines)


def format_report(report: dict[str, Any], findings: list[Finding]) -> str:
    nodes = len(report["nodes"])
    head = (f"phalanx doctor: {nodes} node{'s' if nodes != 1 else ''}"
            f"{' (simulated on this host)' if report['simulated'] else ''}, world size {report['world_size']}, "
            f"backend {report['backend']}")  # fmt: skip
    parts = [head, _nodes_table(report), _links_table(report), _networks_table(report), _allreduce_table(report),
             _compute_table(report), format_findings(findings), summary(findings)]  # fmt: skip
    return "\n\n".join(parts)


def summary(findings: list[Finding]) -> str:
    problems = sum(finding.severity == "problem" for finding in findings)
    warnings = len(findings) - problems
    return f"phalanx doctor: {problems} problem{'s' if problems != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
