"""`phalanx plan`'s report of a :class:`~phalanx.bench.cost_model.Prediction`: text for people, a dict for --json."""

from __future__ import annotations

import textwrap
from dataclasses import asdict
from typing import Any

from phalanx.bench.cost_model import (
    FORMULA,
    FORMULA_LEGEND,
    POWERSGD_MIN_COMPRESSION_RATE,
    Prediction,
    Row,
    rank_table_rows,
)
from phalanx.bench.link import format_bandwidth, format_latency
from phalanx.console import format_table
from phalanx.launch.rank_table import format_rank_table

CAUTION = (
    "the prediction is the all-reduce alone: DDP overlaps it with the backward pass, and compression costs compute "
    "(casts, PowerSGD's matmuls) not counted here; measure a real step before you choose"
)
RANK_TABLE_NOTE = "  (torchrun numbers ranks node by node; with the c10d rendezvous, node order is join order)"
WIDTH = 100


def assumptions(prediction: Prediction) -> list[str]:
    layout = prediction.layout
    lines = [
        f"the ring runs over all n = {layout.nnodes} x {layout.nproc_per_node} = {layout.world_size} ranks, "
        "ordered node by node as torchrun numbers them",
        "k: DDP's buckets (1 MiB first, then 25 MiB: its defaults), one all-reduce each, three with PowerSGD "
        "(uncompressed tensors, P, Q); the latency L is counted on every ring step, even those inside a node",
        "powersgd: the steady state (torch sends plain all-reduces before start_powerSGD_iter); a gradient is "
        f"compressed when (rows + cols) x {prediction.powersgd_rank} x {POWERSGD_MIN_COMPRESSION_RATE} < rows x cols, "
        "so biases and norms go whole",
    ]
    if prediction.size.shapes is None:
        lines.append("powersgd needs the model's shapes (--model): a parameter count cannot say which tensors compress")
    return lines


def verdict(prediction: Prediction) -> str:
    if prediction.layout.world_size == 1:
        return "one process: DDP has nothing to all-reduce, so no compression helps; plan more --nnodes or --nproc-per-node"
    if prediction.bound is None:
        return (
            "one node, so no network: the intra-node transport (shared memory, NVLink, PCIe) decides the time; "
            "give --intra-bandwidth (e.g. --intra-bandwidth 100GB/s) to predict it"
        )
    fastest = prediction.fastest
    names = " = ".join(row.label for row in fastest)
    baseline = prediction.rows[0]
    best = fastest[0]
    if best is baseline:
        return f"predicted fastest: {names} ({_ms(best.seconds)} ms a step): compression does not pay on this link"
    return (
        f"predicted fastest: {names}, {_ms(best.seconds)} ms of all-reduce a step against {_ms(baseline.seconds)} ms "
        f"uncompressed ({best.speedup:,.2f}x)"
    )


def format_report(prediction: Prediction) -> str:
    ranks = prediction.layout.world_size
    size = prediction.size
    frozen = f", {size.frozen:,} frozen ones not sent" if size.frozen else ""
    lines = [
        format_rank_table(rank_table_rows(prediction.layout)),
        RANK_TABLE_NOTE,
        "",
        f"phalanx: all-reduce a step: {size.parameters:,} trainable parameters ({size.origin}{frozen}) over {ranks} ranks",
    ]
    if prediction.bound is not None:
        link = prediction.bound.link
        figures = f"{format_bandwidth(link.bandwidth_bytes_per_s)}, latency {format_latency(link.latency_s)}"
        if link.bandwidth_origin == link.latency_origin:
            lines.append(_wrapped(f"  link: {figures} (both {link.bandwidth_origin})"))
        else:
            lines.append(_wrapped(
                f"  link: {format_bandwidth(link.bandwidth_bytes_per_s)} ({link.bandwidth_origin}), "
                f"latency {format_latency(link.latency_s)} ({link.latency_origin})"
            ))  # fmt: skip
        lines.append(_wrapped(f"  bound: {prediction.bound.reason}"))
    lines.append(f"  formula: {FORMULA}\n    ({FORMULA_LEGEND})")
    lines += [_wrapped(f"  assumed: {line}") for line in assumptions(prediction)]
    lines += ["", _table(prediction.rows, ranks), ""]
    lines += [_wrapped(f"verdict: {verdict(prediction)}"), _wrapped(f"caution: {CAUTION}")]
    return "\n".join(lines)


def _wrapped(line: str) -> str:
    """Long sentences folded for an 100-column terminal, continuation lines indented under their label."""
    return textwrap.fill(line, width=WIDTH, subsequent_indent="    ", break_on_hyphens=False)


def _table(rows: tuple[Row, ...], ranks: int) -> str:
    def cells(row: Row) -> list[str]:
        sent = row.traffic
        if sent is None:
            return [row.label, "-", "-", "-", "-", "-", "-", row.note]
        return [
            row.label,
            _mb(sent.bytes),
            _mb(sent.sent_per_rank(ranks)),
            "-" if row.ratio is None else f"{row.ratio:,.1f}x",
            str(sent.allreduces),
            "-" if row.seconds is None else _ms(row.seconds),
            "-" if row.speedup is None else f"{row.speedup:,.2f}x",
            row.note,
        ]

    headers = [
        "compression", "all-reduced a step (MB)", "sent per rank (MB)", "ratio", "all-reduces (k)", "time (ms)",
        "speed-up", "note",
    ]  # fmt: skip
    return format_table(headers, [cells(row) for row in rows])


def report_as_dict(prediction: Prediction) -> dict[str, Any]:
    """The same facts for --json, unrounded: bytes, seconds, bytes/s."""
    ranks = prediction.layout.world_size
    bound = prediction.bound
    size = prediction.size
    return {
        "model": {
            "parameters": size.parameters,
            "frozen_parameters": size.frozen,
            "shapes_known": size.shapes is not None,
            "origin": size.origin,
        },
        "layout": {**asdict(prediction.layout), "world_size": ranks},
        "rank_table": rank_table_rows(prediction.layout),
        "link": None if bound is None else {**asdict(bound.link), "reason": bound.reason},
        "formula": f"{FORMULA}  ({FORMULA_LEGEND})",
        "assumptions": assumptions(prediction),
        "compressions": [
            {
                "compression": row.compression,
                "label": row.label,
                "bytes_per_step": None if row.traffic is None else row.traffic.bytes,
                "bytes_sent_per_rank": None if row.traffic is None else row.traffic.sent_per_rank(ranks),
                "allreduces_per_step": None if row.traffic is None else row.traffic.allreduces,
                "compression_ratio": row.ratio,
                "allreduce_s": row.seconds,
                "speedup": row.speedup,
                "note": row.note,
            }
            for row in prediction.rows
        ],
        "fastest": [row.compression for row in prediction.fastest] if prediction.bound is not None else [],
        "verdict": verdict(prediction),
        "caution": CAUTION,
    }


def _mb(count: float) -> str:
    megabytes = count / 1e6
    return f"{megabytes:,.1f}" if megabytes >= 10 else f"{megabytes:.3g}"


def _ms(seconds: float) -> str:
    milliseconds = seconds * 1e3
    return f"{milliseconds:,.1f}" if milliseconds >= 10 else f"{milliseconds:.3g}"
