"""How every benchmark states its targets, so that benchmarks/summary.py can list them in one table.

A benchmark writes its JSON report with :func:`write_report`: what it measured, and a list of
:class:`Target`, each a figure (usually a ratio against plain torch in the same run) beside the
limit it must meet.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

#: What a target's verdict can be.
VERDICTS = ("met", "not met", "not decided", "too few runs", "not measured", "smoke run: not judged")


@dataclass(frozen=True)
class Target:
    """One figure against its limit.

    Attributes:
        name: what is compared, such as "wall time, phalanx run / torchrun (1 node, 2 processes)".
        value: the figure measured; None when it could not be.
        limit: the bound it must meet.
        at_least: True when the value must be at least the limit, False when at most.
        unit: "x" for a ratio, or the figure's unit.
        decided: the verdict a benchmark reached itself (one with confidence intervals); None to
            compare the value with the limit.
    """

    name: str
    value: float | None
    limit: float
    at_least: bool
    unit: str = "x"
    decided: str | None = None

    @property
    def verdict(self) -> str:
        if self.decided is not None:
            assert self.decided in VERDICTS, self.decided
            return self.decided
        if self.value is None or not math.isfinite(self.value):
            return "not measured"
        met = self.value >= self.limit if self.at_least else self.value <= self.limit
        return "met" if met else "not met"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def write_report(path: Path, results: Any, targets: list[Target], *, smoke: bool = False) -> None:
    """Writes the benchmark's JSON report: {"smoke", "measured", "targets", "results"}; "measured"
    says when, with which command, and on what (a table gathered from reports of several days
    names each row's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**target.as_dict(), **({"verdict": VERDICTS[-1]} if smoke else {})} for target in targets]
    measured = {"date": time.strftime("%Y-%m-%d"), "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "cpus": os.cpu_count(), "torch": version("torch")}  # fmt: skip
    report = {"smoke": smoke, "measured": measured, "targets": rows, "results": results}
    path.write_text(json.dumps(report, indent=1) + "\n")


def bound(target: dict[str, Any]) -> str:
    """The limit as the summary table shows it: ">= 0.97x", "<= 1.05x"."""
    return f"{'>=' if target['at_least'] else '<='} {figure(target['limit'], target['unit'])}"


def figure(value: float | None, unit: str) -> str:
    """A value as the summary table shows it: "0.982x", "212 MiB", "87.1%"."""
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 2**20:.0f} MiB"
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "x":
        return f"{value:.3f}{unit}"
    return f"{value:.0f} {unit}" if float(value).is_integer() else f"{value:.3g} {unit}"
