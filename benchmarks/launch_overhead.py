"""Launch overhead of `phalanx run` against plain torchrun, on examples/tutorial_ddp.py.

For each scenario the two launchers run alternately (interleaved, so that the machine's noise
hits both alike), --repeats times each. Reported per launcher: the median whole-process wall
time and the median time to first step (from process start until rank 0 prints "training on",
which the example prints right before its first step), and their ratios phalanx / torchrun.

Scenarios:
  single  one node, 2 processes: `phalanx run --nproc-per-node 2` vs `torchrun --standalone`
  nodesK  K node agents on this host (K = 2, 4, 8), one process each: `phalanx run
          --simulate-nodes K` vs K torchrun agents on loopback with the flags phalanx would have to
          be given by hand

phalanx's own breakdown of each start (the line `phalanx: start: ...`, from the run's
start.json: the phases of the node whose start took longest) is reported too, as medians per
phase.

Target: each ratio at most 1.05, for single and nodes2 (4 and 8 agents on 2 cores measure the
cores more than the launcher: their rows are reported, not judged).

Usage: python benchmarks/launch_overhead.py [--repeats 5] [--scenario single nodes2 nodes4 nodes8] [--smoke]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

REPO = Path(__file__).resolve().parents[1]
#: The tutorial's own workload (1000 images of 3x224x224, one linear layer, batch 32), 2 epochs.
EXAMPLE = [str(REPO / "examples" / "tutorial_ddp.py"), "--epochs", "2"]
#: --smoke: a tenth of the data, one epoch, one run per launcher (it proves the benchmark runs).
SMOKE_EXAMPLE = [str(REPO / "examples" / "tutorial_ddp.py"), "--epochs", "1", "--samples", "100"]
MARKER = "training on"
#: phalanx run's time over torchrun's, at most.
TARGET = 1.05
METRICS = {"wall": "wall time", "first_step": "time to first step"}
SCENARIOS = {"single": "1 node, 2 processes", "nodes2": "2 simulated nodes", "nodes4": "4 simulated nodes",
             "nodes8": "8 simulated nodes"}  # fmt: skip
#: The scenarios whose ratios are targets.
JUDGED = ("single", "nodes2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commands(scenario: str, launcher: str, logs: str, example: list[str]) -> list[list[str]]:
    python = sys.executable
    if scenario == "single":
        if launcher == "phalanx":
            return [[python, "-m", "phalanx", "run", "--log-dir", logs, "--nproc-per-node", "2", *example]]
        return [[python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *example]]
    nodes = int(scenario.removeprefix("nodes"))
    if launcher == "phalanx":
        return [[python, "-m", "phalanx", "run", "--log-dir", logs, "--simulate-nodes", str(nodes), *example]]
    port = free_port()
    return [
        [python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(node == 0)}",
         "--local-addr", f"127.0.0.{101 + node}", *example]
        for node in range(nodes)
    ]  # fmt: skip


def timed_run(argvs: list[list[str]]) -> tuple[float, float]:
    """(wall seconds, seconds to the first-step marker) for commands started together."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    started = time.perf_counter()
    processes = [
        subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for a in argvs
    ]
    first_step = float("nan")
    for line in processes[0].stdout:  # rank 0 runs under the first command
        if MARKER in line and first_step != first_step:
            first_step = time.perf_counter() - started
    codes = [p.wait() for p in processes]
    wall = time.perf_counter() - started
    if any(codes):
        raise SystemExit(f"a benchmark run failed ({codes}): {argvs}")
    return wall, first_step


def start_phases(logs: Path) -> dict[str, float] | None:
    """The phases of the node whose start took longest, in the one run logged under ``logs``
    (its start.json); None where the run wrote none."""
    records = list(logs.glob("*/start.json"))
    if len(records) != 1:
        return None
    nodes = json.loads(records[0].read_text())["nodes"]
    return max(nodes, key=lambda node: sum(node["phases"].values()))["phases"]


def measure(scenario: str, repeats: int, example: list[str]) -> dict[str, object]:
    samples: dict[str, dict[str, list[float]]] = {
        name: {"wall": [], "first_step": []} for name in ("torchrun", "phalanx")
    }
    phases: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        if repeats > 1:  # (not in a smoke run)
            timed_run(commands(scenario, "torchrun", scratch, example))  # warms the file cache, not counted
        for index in range(repeats):
            for launcher in ("torchrun", "phalanx"):
                logs = Path(scratch) / f"{launcher}-{index}"
                wall, first = timed_run(commands(scenario, launcher, str(logs), example))
                samples[launcher]["wall"].append(wall)
                samples[launcher]["first_step"].append(first)
                found = start_phases(logs) if launcher == "phalanx" else None
                if found is not None:
                    phases.append(found)
    medians = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    ratios = {k: medians["phalanx"][k] / medians["torchrun"][k] for k in ("wall", "first_step")}
    if not phases:
        raise SystemExit(f"{scenario}: no phalanx run wrote its start's phases (start.json)")
    breakdown = {phase: statistics.median(run[phase] for run in phases) for phase in phases[0]}
    return {"scenario": scenario, "repeats": repeats, "samples": samples, "median_s": medians, "ratio": ratios,
            "start_phases_s": breakdown, "start_phases_runs": phases}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--smoke", action="store_true", help="one short run per launcher (seconds): proves that the "
                        "benchmark runs, judges nothing")  # fmt: skip
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "launch_overhead.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least one run per launcher")
    repeats, example = (1, SMOKE_EXAMPLE) if args.smoke else (args.repeats, EXAMPLE)
    scenarios = list(JUDGED) if args.smoke else args.scenario
    results = [measure(scenario, repeats, example) for scenario in scenarios]
    print(f"{'scenario':<9} {'metric':<11} {'torchrun (s)':>13} {'phalanx (s)':>12} {'ratio':>7}")
    for result in results:
        for metric in ("wall", "first_step"):
            torchrun, phalanx = result["median_s"]["torchrun"][metric], result["median_s"]["phalanx"][metric]
            print(
                f"{result['scenario']:<9} {metric:<11} {torchrun:>13.2f} {phalanx:>12.2f} {result['ratio'][metric]:>6.3f}x"
            )
    print(f"medians of {repeats} interleaved runs each; target: ratio <= {TARGET} ({', '.join(JUDGED)})")
    phases = list(results[0]["start_phases_s"])
    print(f"\nphalanx's start, the phases of the node whose start took longest (medians, s)\n{'scenario':<9} "
          + " ".join(f"{phase:>14}" for phase in phases) + f" {'total':>7}")  # fmt: skip
    for result in results:
        breakdown = result["start_phases_s"]
        print(f"{result['scenario']:<9} " + " ".join(f"{breakdown[phase]:>14.2f}" for phase in phases)
              + f" {sum(breakdown.values()):>7.2f}")  # fmt: skip
    targets = [Target(f"{METRICS[metric]}, phalanx run / torchrun ({SCENARIOS[r['scenario']]})", r["ratio"][metric], TARGET,
                      at_least=False)
               for r in results if r["scenario"] in JUDGED for metric in METRICS]  # fmt: skip
    write_report(args.json, results, targets, smoke=args.smoke)


if __name__ == "__main__":
    main()
