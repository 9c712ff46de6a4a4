"""`phalanx bench collectives` results: the JSON report and nccl-tests' table.

The text follows nccl-tests' layout column for column, so that people who read its output read
this one; cells torch.distributed has no call for (out-of-place all_reduce and broadcast,
in-place all_to_all) say n/a.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from phalanx.bench.collective_runner import Measurement, Row
from phalanx.bench.collective_settings import CollectiveSettings
from phalanx.bench.collectives import AVERAGE_MODES, COLLECTIVES


def collective_result(settings: CollectiveSettings, name: str, rows: list[Row]) -> dict[str, Any]:
    measured = [m for row in rows for m in (row.out_of_place, row.in_place) if m is not None]
    wrong = sum(m.wrong or 0 for m in measured)
    failed_cells = sum(1 for m in measured if m.wrong)
    return {
        "collective": name,
        "type": settings.dtype,
        "redop": settings.op if COLLECTIVES[name].reduces else "none",
        "root": settings.root if COLLECTIVES[name].rooted else -1,
        "rows": [asdict(row) for row in rows],
        "wrong": wrong,  # elements, over every cell
        "failed_cells": failed_cells,  # what nccl-tests' "Out of bounds values" counts
        # nccl-tests' footer: the mean busbw over every measured cell, both variants
        "avg_busbw": sum(m.busbw for m in measured) / len(measured) if measured else 0.0,
    }


def _time_text(microseconds: float) -> str:
    if microseconds >= 10000.0:
        return f"{microseconds:7.0f}"
    return f"{microseconds:7.1f}" if microseconds >= 100.0 else f"{microseconds:7.2f}"


def _cells(measurement: dict[str, Any] | None) -> str:
    if measurement is None:
        return f"  {'n/a':>7}  {'n/a':>6}  {'n/a':>6}  {'n/a':>5}"
    m = Measurement(**measurement)
    wrong = "N/A" if m.wrong is None else str(m.wrong)
    return f"  {_time_text(m.time_us)}  {m.algbw:6.2f}  {m.busbw:6.2f}  {wrong:>5}"


def format_row(settings: CollectiveSettings, name: str, row: Row) -> str:
    """One row of :func:`format_table`, as soon as it is measured (the worker's progress)."""
    return _row_text(collective_result(settings, name, []), asdict(row))


def _row_text(result: dict[str, Any], row: dict[str, Any]) -> str:
    head = (
        f"{row['size_bytes']:12d}  {row['count']:12d}  {result['type']:>8}  {result['redop']:>6}  {result['root']:6d}"
    )
    return head + _cells(row["out_of_place"]) + _cells(row["in_place"])


def format_table(result: dict[str, Any]) -> str:
    lines = [*table_header()]
    lines += [_row_text(result, row) for row in result["rows"]]
    status = "FAILED" if result["wrong"] else "OK"
    lines += [
        f"# Out of bounds values : {result['failed_cells']} {status}",
        f"# Avg bus bandwidth    : {result['avg_busbw']:g}",
        "#",
    ]
    return "\n".join(lines)


def table_header() -> list[str]:
    """The table's column heads, nccl-tests' three lines."""
    return [
        f"# {'':10}  {'':12}  {'':8}  {'':6}  {'':6}           out-of-place                       in-place",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6} "
        f"{'#wrong':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6} {'#wrong':>6}",
        f"# {'(B)':>10}  {'(elements)':>12}  {'':8}  {'':6}  {'':6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':5}  "
        f"{'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':5}".rstrip(),
    ]


def _line_rate_text(report: dict[str, Any]) -> str:
    rate = report.get("line_rate")
    if not rate:
        return f"unknown ({report['interface'] or 'the default interface'} does not report a speed; give --line-rate)"
    return f"{rate * 8 / 1e9:g} Gbit/s = {rate / 1e9:g} GB/s ({report['interface'] or 'given'})"


def format_report(report: dict[str, Any]) -> str:
    settings = report["settings"]
    step = f"{settings['step_factor']}(factor)" if settings["step_factor"] > 1 else f"{settings['step_bytes']}(bytes)"
    head = [
        f"# phalanx bench collectives: {report['world_size']} ranks on {report['nodes']} node(s), backend "
        f"{report['backend']}, interface {report['interface'] or 'default'}",
        f"# minBytes {settings['min_bytes']} maxBytes {settings['max_bytes']} step: {step} warmup iters: "
        f"{settings['warmup_iters']} iters: {settings['iters']} validation: {settings['check']}",
        f"# time: the {AVERAGE_MODES[settings['average']]} of each rank's mean over {settings['iters']} calls",
        "# algbw = bytes / time, busbw = algbw x bus factor (2(n-1)/n for all_reduce): nccl-tests' definitions",
        f"# line rate of the link: {_line_rate_text(report)}",
        "#",
        "# Using devices",
        *(
            f"#  Rank {r['rank']:2d} Pid {r['pid']:7d} on {r['node']:>12} ({r['host']}) device {r['device']}"
            for r in report["ranks"]
        ),
        "#",
    ]
    blocks = [f"# {result['collective']}\n{format_table(result)}" for result in report["results"]]
    return "\n".join(head + blocks)


def total_wrong(report: dict[str, Any]) -> int:
    return sum(result["wrong"] for result in report["results"])
