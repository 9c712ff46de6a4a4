"""--compression auto against every fixed choice: samples/s on the same workload, side by side.

Each run trains the tutorial's model (one Linear 3x224x224 -> 10, batch 32 per process; or
examples/train.py's synthetic MLP with --model mlp) for --steps steps on 2 processes
(benchmarks/auto_compression_worker.py) and counts the global samples/s over all its steps:
auto's trial is included, since that is what auto costs. The modes run alternately, in a
rotating order, --repeats times each, so that the machine's noise hits all alike. Reported per
mode: the median samples/s and its ratio to the best fixed choice, the median of each round's
ratio (paired: a round's runs ran side by side, so what the machine did between rounds stays
out), the steady ratio (the steps after the first --steady-from, where auto runs its choice
alone: how good the choice is) and what auto chose in each of its runs; for auto also the trial's
cost, in steps of the best fixed choice: how much longer its first --steady-from steps took
(median of the rounds). Over a run of N steps auto comes to about
1 / (1 / steady + cost / N) of the best fixed choice.

Target: auto >= 0.95 x the best fixed choice (the ratio of the medians) over runs of 2000 steps.
The trial is a fixed cost of at most 88 steps with gloo's candidates, paid once per run (a resumed
run keeps the choice): a run of a few hundred steps mostly measures how the trial amortizes (the
cost and the steady ratio give that for any length), and a run that short has a few seconds to
win. 2000 steps of the tutorial's model take under a minute on loopback; real runs are longer.
9 runs per mode by default: single runs on this machine vary by about 6% (1 Gbit link) to 9%
(loopback), so the ratio of two medians of 5 runs moves by about 5%, as much as the margin it judges;
with 9 it moves by about 3.5%.

Methods:
  in-process  one launch per link; inside it every run builds and wraps a fresh model (so auto
              runs its whole trial each time). Launch-to-launch noise stays out (default).
  launches    one launch per run: also catches what a fresh process and fresh connections do.

Links:
  loopback  both processes on this host (`phalanx run --nproc-per-node 2`)
  1gbit     two network namespaces joined by a veth pair shaped to 1 Gbit/s (tc tbf), one
            process on each (`phalanx run --nnodes 2` in each); needs root
  veth      the same two namespaces, unshaped

Usage: python benchmarks/auto_compression.py [--repeats 9] [--steps 2000] [--link loopback 1gbit veth]
                                             [--method in-process|launches] [--model linear|mlp] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from itertools import count
from pathlib import Path

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

from phalanx.testbed import Host, Shaping, phalanx_argv, run_together, test_bed

REPO = Path(__file__).resolve().parents[1]

WORKER = str(REPO / "benchmarks" / "auto_compression_worker.py")
FIXED = ("none", "fp16", "powersgd")
MODES = ("auto", *FIXED)
RATES = {"loopback": None, "1gbit": "1gbit", "veth": None}
#: auto at least this fraction of the best fixed choice's samples/s.
TARGET = 0.95


@contextlib.contextmanager
def hosts_for(link: str) -> Iterator[tuple[Host, Host] | None]:
    """None on loopback, else two hosts a and b of a test bed (network namespaces), removed afterwards."""
    if link == "loopback":
        yield None
        return
    with test_bed(f"b{link[0]}{os.getpid() % 100000}", ["a", "b"], shaping=Shaping(rate=RATES[link])) as bed:
        yield bed.hosts[0], bed.hosts[1]


def launch(hosts: tuple[Host, Host] | None, worker_args: list[str], args: argparse.Namespace, folder: str,
           port: int) -> dict:  # fmt: skip
    out = f"{folder}/run-{port}.json"
    worker = [WORKER, out, "--steps", str(args.steps), "--steady-from", str(args.steady_from), "--model", args.model,
              *worker_args]  # fmt: skip
    if hosts is None:
        argv = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", *worker]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=args.timeout)
        codes, output = [done.returncode], done.stdout + done.stderr
    else:
        a, b = hosts
        line = phalanx_argv("run", "--nnodes", "2", "--rdzv-endpoint", f"{a.address}:{port}", *worker)
        outcomes = run_together([a.command(line), b.command(line)], timeout=args.timeout, cwd=folder)
        codes, output = [o.returncode for o in outcomes], "\n".join(o.output for o in outcomes)
    if any(codes):
        raise SystemExit(f"a benchmark run failed ({codes}):\n{output[-4000:]}")
    return json.loads(Path(out).read_text())["modes"]


def measure(link: str, args: argparse.Namespace) -> dict:
    runs: dict[str, dict[str, list]] = {mode: {} for mode in MODES}  # mode -> what the worker reports, per run
    ports = count(29501)
    with hosts_for(link) as hosts, tempfile.TemporaryDirectory() as folder:
        if args.method == "in-process":
            timeout = args.timeout * args.repeats * len(MODES)
            found = launch(hosts, ["--modes", ",".join(MODES), "--repeats", str(args.repeats)],
                           argparse.Namespace(**{**vars(args), "timeout": timeout}), folder, next(ports))  # fmt: skip
            runs = {mode: found[mode] for mode in MODES}
        else:
            for repeat in range(args.repeats):
                for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
                    found = launch(hosts, ["--modes", mode], args, folder, next(ports))[mode]
                    for key, values in found.items():
                        runs[mode].setdefault(key, []).extend(values)
                    print(f"  {link:<8} {mode:<8} {found['samples_per_second'][0]:8.0f} samples/s", file=sys.stderr,
                          flush=True)  # fmt: skip
    median = {mode: statistics.median(run["samples_per_second"]) for mode, run in runs.items()}
    best = max(FIXED, key=median.__getitem__)
    rest = {mode: statistics.median(rest for _, rest in run["seconds_head_rest"]) for mode, run in runs.items()}
    best_step_s = rest[best] / (args.steps - args.steady_from)
    trial_cost = [(auto_head - best_head) / best_step_s  # paired: the two heads ran side by side
                  for (auto_head, _), (best_head, _) in zip(runs["auto"]["seconds_head_rest"],
                                                            runs[best]["seconds_head_rest"])]  # fmt: skip
    return {
        "link": link,
        "method": args.method,
        "model": args.model,
        "steps": args.steps,
        "repeats": args.repeats,
        "median_samples_per_second": median,
        "best_fixed": best,
        "ratio_to_best_fixed": {mode: median[mode] / median[best] for mode in MODES},
        # Each round's runs ran side by side: their ratio leaves out what the machine did between rounds.
        "paired_ratio_to_best_fixed": {
            mode: statistics.median(
                a / b for a, b in zip(runs[mode]["samples_per_second"], runs[best]["samples_per_second"])
            )
            for mode in MODES
        },
        "steady_ratio_to_best_fixed": {mode: rest[best] / rest[mode] for mode in MODES},
        "steady_from": args.steady_from,
        "auto_trial_cost_steps": statistics.median(trial_cost),
        "auto_chose": [s["chosen"] for s in runs["auto"]["summaries"]],
        "auto_ms_per_step": [s["ms_per_step"] for s in runs["auto"]["summaries"]],
        "auto_phases": [s["phases"] for s in runs["auto"]["summaries"]],
        "auto_trial_steps": [s["trial_steps"] for s in runs["auto"]["summaries"]],
        "samples_per_second": {mode: run["samples_per_second"] for mode, run in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2000, help="steps per run, auto's trial (12 to 88 steps) included")
    parser.add_argument(
        "--steady-from",
        type=int,
        default=100,
        help="the steps after this many are steady: auto's trial (at most 88 steps) is over",
    )
    parser.add_argument("--link", nargs="+", default=["loopback", "1gbit", "veth"], choices=list(RATES))
    parser.add_argument("--method", choices=["in-process", "launches"], default="in-process")
    parser.add_argument("--model", choices=["linear", "mlp"], default="linear")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one run")
    parser.add_argument("--smoke", action="store_true", help="one run of 120 steps per mode on loopback and veth "
                        "(seconds): proves that the benchmark runs, judges nothing")  # fmt: skip
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "auto_compression.json")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.steps, args.steady_from, args.link = 1, 120, 100, ["loopback", "veth"]
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least one run per mode")
    if args.steps <= args.steady_from:
        parser.error(f"--steps {args.steps} leaves no steady steps after --steady-from {args.steady_from}")
    results: list[dict] = []
    for link in args.link:
        results.append(measure(link, args))
        targets = [Target(f"samples/s, --compression auto / the best fixed choice ({r['link']}, {r['steps']} steps)",
                          r["ratio_to_best_fixed"]["auto"], TARGET, at_least=True) for r in results]  # fmt: skip
        write_report(
            args.json, results, targets, smoke=args.smoke
        )  # after each link: an interrupted run keeps what it has
    print(f"{'link':<9} {'mode':<9} {'samples/s':>10} {'x best fixed':>13} {'paired':>7} {'steady':>7}  "
          "auto chose (phases of its trial) / its trial's cost")  # fmt: skip
    for result in results:
        for mode in MODES:
            runs = zip(result["auto_chose"], result["auto_phases"])
            chose = ", ".join(f"{name} ({len(phases)})" for name, phases in runs) if mode == "auto" else ""
            if mode == "auto":
                chose += f" / {result['auto_trial_cost_steps']:.0f} steps"
            print(f"{result['link']:<9} {mode:<9} {result['median_samples_per_second'][mode]:>10.0f} "
                  f"{result['ratio_to_best_fixed'][mode]:>12.3f}x {result['paired_ratio_to_best_fixed'][mode]:>6.3f}x "
                  f"{result['steady_ratio_to_best_fixed'][mode]:>6.3f}x  {chose}")  # fmt: skip
    print(
        f"medians of {args.repeats} interleaved runs of {args.steps} steps each ({args.model} model, 2 processes, "
        f"{args.method}); paired: the median of each round's ratio; steady: after step {args.steady_from}, auto's "
        "choice alone;\ncost: auto's first steps took that many more steps' time than the best fixed choice's; "
        f"target: auto >= {TARGET}x the best fixed choice over 2000 steps"
    )


if __name__ == "__main__":
    main()
