"""`phalanx bench collectives` against a plain torch.distributed timing loop, and against the line rate.

Scenarios:
  loopback  2 processes on this host: the all_reduce busbw phalanx reports at 16, 32 and 64 MiB
            against benchmarks/plain_collective_loop.py under torchrun, both timing --iters calls
            per size. The two run alternately (interleaved), --repeats times each, after one
            round of each that is not counted (the first launch on a cold machine measures low
            on either side). Reported: the ratio of the medians, and the median of the ratios of
            each pair (a phalanx run against the plain run next to it; the order alternates). Target: >= 0.97.
  1gbit     two network-namespace hosts joined by a veth pair shaped with tc tbf to 1 Gbit/s
            (root only): phalanx's all_reduce busbw at 64 MiB across them, against the line rate
            0.125 GB/s. Target: >= 85%.

Usage: python benchmarks/collectives_vs_torch.py [--repeats 5] [--iters 50] [--scenario loopback 1gbit] [--smoke]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

from phalanx.testbed import Shaping, run_together, test_bed

REPO = Path(__file__).resolve().parents[1]
MIB = 1024**2
SIZES = [16 * MIB, 32 * MIB, 64 * MIB]
#: --smoke: one small size, two calls, one round (seconds): proves that the benchmark runs.
SMOKE_SIZES = [1 * MIB]
LINE_RATE_1GBIT = 1e9 / 8 / 1e9  # GB/s
PORT = "29400"
#: phalanx's busbw over the plain loop's on loopback, at least; and over the 1 Gbit/s line rate.
TARGET_LOOPBACK, TARGET_LINE_RATE = 0.97, 0.85


def phalanx_bench(*launch: str, sizes: list[int], iters: int, logs: str) -> dict[int, float]:
    argv = [sys.executable, "-m", "phalanx", "bench", "collectives", *launch, "--log-dir", logs,
            "-b", str(sizes[0]), "-e", str(sizes[-1]), "-f", "2", "-n", str(iters), "-c", "0", "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=logs)
    if done.returncode != 0:
        raise SystemExit(f"phalanx bench failed:\n{done.stderr[-3000:]}")
    rows = json.loads(done.stdout)["results"][0]["rows"]
    return {row["size_bytes"]: row["in_place"]["busbw"] for row in rows}


def plain_loop(sizes: list[int], iters: int) -> dict[int, float]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "benchmarks" / "plain_collective_loop.py"), *map(str, sizes), "--iters", str(iters)]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    )
    if done.returncode != 0:
        raise SystemExit(f"plain loop failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    return {int(size): busbw for size, busbw in json.loads(line).items()}


def loopback(repeats: int, iters: int, logs: str, sizes: list[int], warm_up: bool = True) -> dict:
    ours, plain = [], []
    for round_ in range(repeats + warm_up):

        def run_mine() -> dict[int, float]:
            return phalanx_bench("--nproc-per-node", "2", sizes=sizes, iters=iters, logs=logs)

        if round_ % 2:  # which side goes first alternates, so that neither always meets a warmer machine
            mine, theirs = run_mine(), plain_loop(sizes, iters)
        else:
            theirs, mine = plain_loop(sizes, iters), run_mine()
        if round_ or not warm_up:  # round 0 warms the machine up
            ours.append(mine)
            plain.append(theirs)
    result = {}
    for size in sizes:
        a, b = statistics.median(r[size] for r in ours), statistics.median(r[size] for r in plain)
        pairs = [mine[size] / theirs[size] for mine, theirs in zip(ours, plain)]
        result[size] = {"phalanx_busbw": a, "plain_busbw": b, "ratio": a / b, "median_pair_ratio": statistics.median(pairs),
                        "phalanx_runs": [r[size] for r in ours], "plain_runs": [r[size] for r in plain]}  # fmt: skip
    return result


def one_gbit(repeats: int, logs: str, size: str = "64M", iters: int = 10) -> dict:
    figures = []
    with test_bed(f"cv{os.getpid() % 100000}", ["a", "b"], shaping=Shaping(rate="1gbit")) as bed:
        a, b = bed.hosts
        for _ in range(repeats):
            reports = [Path(logs) / f"{host.namespace}.json" for host in (a, b)]
            lines = []
            for host, report in zip((a, b), reports):
                bench = [sys.executable, "-m", "phalanx", "bench", "collectives", "--nnodes", "2", "--rdzv-endpoint",
                         f"{a.address}:{PORT}", "--log-dir", logs, "-b", size, "-e", size, "-c", "0", "-n", str(iters), "--json"]  # fmt: skip
                lines.append(host.command(["sh", "-c", " ".join(bench) + f" > {report}"]))
            outcomes = run_together(lines, timeout=300, cwd=logs)
            if any(o.returncode != 0 for o in outcomes):
                raise SystemExit("\n".join(o.output[-2000:] for o in outcomes))
            rows = json.loads(reports[0].read_text())["results"][0]["rows"]
            figures.append(rows[0]["in_place"]["busbw"])
            time.sleep(1)  # the store port is free again before the next round
    median = statistics.median(figures)
    return {"size": size, "busbw": median, "line_rate_GBps": LINE_RATE_1GBIT, "fraction": median / LINE_RATE_1GBIT,
            "runs": figures}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--iters", type=int, default=50, help="timed calls per size and run, on both sides (default 50)"
    )
    parser.add_argument("--scenario", nargs="+", default=["loopback", "1gbit"], choices=["loopback", "1gbit"])
    parser.add_argument("--smoke", action="store_true", help="one round of 2 calls of 1 MiB per scenario (seconds): "
                        "proves that the benchmark runs, judges nothing")  # fmt: skip
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "collectives_vs_torch.json")
    args = parser.parse_args()
    if args.repeats < 1 or args.iters < 1:
        parser.error(f"--repeats {args.repeats} --iters {args.iters}: at least one of each")
    results: dict = {}
    targets = []
    with tempfile.TemporaryDirectory() as logs:
        if "loopback" in args.scenario:
            results["loopback"] = (loopback(1, 2, logs, SMOKE_SIZES, warm_up=False) if args.smoke else
                                   loopback(args.repeats, args.iters, logs, SIZES))  # fmt: skip
            for size, row in results["loopback"].items():
                print(f"loopback {size // MIB:3d} MiB  busbw phalanx {row['phalanx_busbw']:.3f}  plain "
                      f"{row['plain_busbw']:.3f} GB/s  ratio {row['ratio']:.3f}  median pair ratio "
                      f"{row['median_pair_ratio']:.3f}  (target >= {TARGET_LOOPBACK})")  # fmt: skip
                targets.append(Target(f"all_reduce busbw, phalanx bench / plain torch loop (loopback, {size // MIB} MiB)",
                                      row["ratio"], TARGET_LOOPBACK, at_least=True))  # fmt: skip
        if "1gbit" in args.scenario:
            results["1gbit"] = one_gbit(1, logs, "1M", 2) if args.smoke else one_gbit(args.repeats, logs)
            row = results["1gbit"]
            print(f"1gbit    {row['size']}  busbw {row['busbw']:.4f} GB/s = {row['fraction']:.1%} of the line rate "
                  f"0.125 GB/s (target >= {TARGET_LINE_RATE:.0%})")  # fmt: skip
            targets.append(Target(f"all_reduce busbw / line rate (two hosts, 1 Gbit/s, {row['size']}iB)", row["fraction"],
                                  TARGET_LINE_RATE, at_least=True))  # fmt: skip
    write_report(args.json, results, targets, smoke=args.smoke)


if __name__ == "__main__":
    main()
