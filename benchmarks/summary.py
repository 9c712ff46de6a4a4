"""Every benchmark, one after the other, and one table of every target: `make bench`.

Each benchmark writes its JSON report (benchmarks/targets.py) to benchmarks/results/; this reads
their targets into one table, printed and written to benchmarks/results/summary.md, with the
command that produced it. A benchmark this machine cannot run (one that builds network
namespaces needs root; fabric_exits needs lightning) is listed as skipped, with why.

--smoke runs each benchmark's smoke mode instead (tiny sizes, one repeat, seconds to a minute
each): it proves that each still runs end to end, and judges nothing. The test suite runs the
same smoke lines (tests/e2e/test_benchmarks.py).

--table prints the table of the reports already in --results and runs nothing: the full set takes
about five hours here, and may be measured over several days (each row says on which).

Usage: python benchmarks/summary.py [--smoke] [--only NAME ...] [--results DIR] [--table]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from targets import bound, figure  # benchmarks/: a script's folder is on its path

from phalanx.console import format_table

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    """One script of benchmarks/ and what running it takes."""

    name: str  # benchmarks/<name>.py
    needs_root: bool = False  # it builds network namespaces (phalanx.testbed)
    needs: tuple[str, ...] = ()  # Python packages beyond phalanx's own
    minutes: int = 5  # about how long its full run takes on a 2-core machine
    #: Its smoke run belongs to the second stage, where no test runs beside it: it keeps every core
    #: busy, or takes minutes (stage 1 has 15 for everything).
    second_stage_smoke: bool = False

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"

    def argv(self, report: Path, smoke: bool) -> list[str]:
        return [sys.executable, str(self.script), *(["--smoke"] if smoke else []), "--json", str(report)]

    def missing(self) -> str | None:
        """Why this machine cannot run it; None when it can."""
        if self.needs_root and os.geteuid() != 0:
            return "needs root (it builds network namespaces)"
        absent = [package for package in self.needs if importlib.util.find_spec(package) is None]
        if absent:
            return f"needs {', '.join(absent)} (pip install -e '.[fabric]')"
        return None


BENCHMARKS = (
    Benchmark("launch_overhead", minutes=15),
    Benchmark("loop_overhead", minutes=10),
    Benchmark("checkpoint", minutes=8),
    Benchmark("collectives_vs_torch", needs_root=True, minutes=5),
    Benchmark("auto_compression", needs_root=True, minutes=120, second_stage_smoke=True),
    Benchmark("fabric_exits", needs_root=True, needs=("lightning",), minutes=6),
    Benchmark("control_plane", minutes=15),
    Benchmark("recovery", needs_root=True, minutes=160, second_stage_smoke=True),
    Benchmark("detection", needs_root=True, minutes=35, second_stage_smoke=True),
)


def run(benchmark: Benchmark, results: Path, smoke: bool) -> dict:
    """Runs one benchmark; returns its report, or why there is none."""
    report, log = results / f"{benchmark.name}.json", results / f"{benchmark.name}.log"
    why = benchmark.missing()
    if why is not None:
        return {"skipped": why}
    argv = benchmark.argv(report, smoke)
    report.unlink(missing_ok=True)  # a report left by an earlier run is never read as this one's
    print(f"== {benchmark.name}: {shlex.join(argv)}", flush=True)
    started = time.monotonic()
    with log.open("w") as output:
        done = subprocess.run(argv, stdout=output, stderr=subprocess.STDOUT, cwd=results)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-10:]
        return {"failed": f"exit code {done.returncode} after {seconds:.0f} s; the end of {log}:\n" + "\n".join(tail)}
    if not report.is_file():
        return {"failed": f"exit code 0 after {seconds:.0f} s, but it wrote no report {report}"}
    return {**json.loads(report.read_text()), "seconds": seconds}


def table(reports: dict[str, dict]) -> str:
    rows = []
    for name, report in reports.items():
        if "targets" not in report:
            rows.append(
                (
                    name,
                    report.get("skipped") or report.get("absent") or report["failed"].splitlines()[0],
                    "",
                    "",
                    "skipped" if "skipped" in report else "not run" if "absent" in report else "FAILED",
                    "",
                )
            )
            continue
        when = report.get("measured", {}).get("date", "")
        for target in report["targets"]:
            rows.append(
                (name, target["name"], figure(target["value"], target["unit"]), bound(target), target["verdict"], when)
            )
    return format_table(("benchmark", "target", "measured", "limit", "verdict", "on"), rows, indent="")


def read_reports(chosen: list[Benchmark], results: Path) -> dict[str, dict]:
    """The reports already in ``results`` (a set measured over several days), running nothing."""
    reports = {}
    for benchmark in chosen:
        report = results / f"{benchmark.name}.json"
        reports[benchmark.name] = json.loads(report.read_text()) if report.is_file() else {"absent": f"no {report}"}
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="each benchmark's smoke mode: proves that it runs, judges nothing"
    )
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARKS], metavar="NAME",
                        help=f"these benchmarks only: {', '.join(b.name for b in BENCHMARKS)}")  # fmt: skip
    parser.add_argument(
        "--results", type=Path, default=HERE / "results", help="where the reports go (default benchmarks/results)"
    )
    parser.add_argument("--table", action="store_true",
                        help="run nothing: the table of the reports already in --results")  # fmt: skip
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if args.only is None or b.name in args.only]
    if args.table:
        print(table(read_reports(chosen, args.results)))
        return
    if not args.smoke:
        print(
            f"about {sum(b.minutes for b in chosen)} minutes on a 2-core machine; each report lands in {args.results}"
        )
    args.results.mkdir(parents=True, exist_ok=True)
    reports = {benchmark.name: run(benchmark, args.results.resolve(), args.smoke) for benchmark in chosen}
    summary = table(reports)
    command = shlex.join([Path(sys.executable).name, "benchmarks/summary.py", *sys.argv[1:]])
    print(f"\n{summary}")
    (args.results / ("summary-smoke.md" if args.smoke else "summary.md")).write_text(
        f"`{command}`, {time.strftime('%Y-%m-%d')}\n\n```\n{summary}\n```\n"
    )
    failed = [name for name, report in reports.items() if "failed" in report]
    for name in failed:
        print(f"\n{name} failed: {reports[name]['failed']}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
