"""Overhead of the phalanx training loop against a hand-written DDP loop, in samples/s.

The phalanx loop is examples/train.py itself (ResumableSampler and ResumableLoader, GlobalMean of
the real samples, progress lines, metrics file, preemption guard, stall watchdog, consistency
check; no checkpoints). The plain loop below is what a user writes from the PyTorch tutorial:
DistributedSampler, DDP, SGD, no metrics. Both train the same model (train.py's build_model) on
the same data with the same per-process batch, launched the same way (`phalanx run
--nproc-per-node 2`), alternately (interleaved, so that the machine's noise hits both alike;
which goes first alternates too), --repeats times each.

Both time the steady state on rank 0 in intervals of --log-every optimizer steps, the first
interval (warm-up) left out: a run's samples/s is the median of its intervals' rates, so that a
burst of a neighbour's load on this shared machine, which slows a few intervals, does not move
the run's figure (the mean rate is kept in the JSON as well). The ranks step in lockstep (every
step all-reduces), so rank 0's clock times the job. Reported: the median samples/s of each loop,
the ratio phalanx / plain (target: >= 0.97) and the median of the pair ratios (each phalanx run
over the plain run next to it).

Also reported: rank 0's process CPU time per optimizer step (all its threads: the stall
watchdog's and gloo's too), per interval likewise: the work each loop does. It misses a cost that
is only waiting (a lock, a later collective), which the wall time catches. It is not free of the
machine's noise either: cache misses under a neighbour's load, and on a virtual machine time
stolen by the host, count as CPU time (on the 2-core machine this was written on, 25 pairs on
digits spread 61% / 42% in CPU time against 82% / 36% in wall time). The phalanx loop's records
get the CPU time from a MetricsLog that stamps each one (--phalanx-worker below), one
process_time() call per logging point. A record is written one step after its logging point
(its all-reduce overlaps that step), the last one right after the last step: the last interval
is one step short in CPU time, and is left out of it for both loops.

Workloads: digits (8x8 images, a ~3 ms step: the worst case for any per-step cost; short runs,
so that the two runs of a pair are seconds apart: use many repeats; an interval is two 28-step
epochs, so every interval holds the same per-epoch work) and synthetic (the tutorial's
3x224x224 images: a step dominated by the gradient all-reduce).

Usage: python benchmarks/loop_overhead.py [--repeats 5] [--workload digits synthetic] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from phalanx.console import format_table

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
#: train.py arguments per workload; the plain loop reads the same ones.
WORKLOADS = {
    "digits": ["--dataset", "digits", "--samples", "1792", "--batch-size", "32", "--epochs", "24", "--log-every", "56"],
    "synthetic": ["--dataset", "synthetic", "--samples", "512", "--batch-size", "32", "--epochs", "6", "--log-every", "8"],
}


WORLD_SIZE = 2


def launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", str(WORLD_SIZE), *argv]


class Interval(NamedTuple):
    """--log-every optimizer steps on rank 0."""

    samples: float  # global
    seconds: float  # wall time
    cpu_seconds: float  # rank 0's process CPU time


Intervals = list[Interval]


def steady_rate(intervals: Intervals) -> float:
    """samples/s of one run: the median over its intervals, the first (warm-up) left out."""
    return statistics.median(i.samples / i.seconds for i in intervals[1:])


def mean_rate(intervals: Intervals) -> float:
    """samples/s of one run as all its samples over all its seconds, the first interval left out."""
    return sum(i.samples for i in intervals[1:]) / sum(i.seconds for i in intervals[1:])


def cpu_ms_per_step(intervals: Intervals, samples_per_step: int) -> float:
    """Rank 0's CPU milliseconds per optimizer step: the median over the intervals, the first and
    the last left out (the warm-up; a phalanx run's last is stamped a step early)."""
    return statistics.median(i.cpu_seconds / (i.samples / samples_per_step) * 1e3 for i in intervals[1:-1])


def compare(runs: dict[str, list[float]]) -> dict[str, object]:
    """The median of each loop's runs, their spread ((max - min) / median), the ratio phalanx /
    plain of the medians, and each phalanx run over the plain run next to it (the two saw the same
    machine state)."""
    medians = {loop: statistics.median(values) for loop, values in runs.items()}
    pairs = [mine / plain for mine, plain in zip(runs["phalanx"], runs["plain"])]
    return {
        "medians": medians, "spread": {loop: (max(v) - min(v)) / medians[loop] for loop, v in runs.items()},
        "ratio": medians["phalanx"] / medians["plain"], "pairs": pairs, "median_pair": statistics.median(pairs),
    }  # fmt: skip


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def run_phalanx(workload: list[str], folder: Path) -> Intervals:
    records = folder / "phalanx.jsonl"
    subprocess.run(launch("--log-dir", str(folder / "logs"), __file__, "--phalanx-worker", *workload, "--metrics-jsonl", str(records)),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    # the first interval's CPU time includes the start-up: it is the warm-up, left out
    cpu_before = [0.0] + [r["process_cpu_s"] for r in lines[:-1]]
    return [Interval(r["samples"], r["samples"] / r["samples_per_second"], r["process_cpu_s"] - before)
            for r, before in zip(lines, cpu_before)]  # fmt: skip


def run_plain(workload: list[str], folder: Path) -> Intervals:
    out = folder / "plain.json"
    subprocess.run(launch("--log-dir", str(folder / "logs"), __file__, "--plain-worker", str(out), *workload),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return [Interval(*interval) for interval in json.loads(out.read_text())]


def phalanx_worker(train_args: list[str]) -> None:
    """examples/train.py itself, its metrics records stamped with rank 0's process CPU time."""
    import phalanx

    class CpuStampedLog(phalanx.MetricsLog):
        def write(self, record: dict[str, object]) -> None:
            super().write({**record, "process_cpu_s": time.process_time()})

    phalanx.MetricsLog = CpuStampedLog  # train.py takes it from the package when it makes its log
    sys.argv = [str(TRAIN), *train_args]
    load_example().main()


def plain_worker(out: Path, train_args: list[str]) -> None:
    """The hand-written loop: DistributedSampler + DDP + SGD, timed on rank 0 every --log-every steps."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    example = load_example()
    sys.argv = [str(TRAIN), *train_args]
    args = example.parse_args()  # the same settings train.py would run with

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    dataset = example.load_dataset(args.dataset, args.samples, args.seed)
    model = DistributedDataParallel(example.build_model(dataset))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    intervals, step, samples = [], 0, 0
    mark, cpu_mark = time.perf_counter(), time.process_time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            step += 1
            samples += len(labels) * world  # the workloads divide evenly: no padding
            if step % args.log_every == 0:
                now, cpu_now = time.perf_counter(), time.process_time()
                intervals.append((samples, now - mark, cpu_now - cpu_mark))
                mark, cpu_mark, samples = now, cpu_now, 0
    if rank == 0:
        out.write_text(json.dumps(intervals))
    del model
    gc.collect()  # DDP holds the group in a reference cycle; destroy it before interpreter exit
    dist.destroy_process_group()


def measure(name: str, repeats: int) -> dict[str, object]:
    workload = WORKLOADS[name]
    per_step = int(workload[workload.index("--batch-size") + 1]) * WORLD_SIZE  # samples per optimizer step
    rates: dict[str, list[float]] = {"plain": [], "phalanx": []}  # a run's median interval rate
    means: dict[str, list[float]] = {"plain": [], "phalanx": []}
    cpu: dict[str, list[float]] = {"plain": [], "phalanx": []}  # a run's median CPU ms per step
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        run_plain(workload, folder)  # warms the file cache and the dataset load, not counted
        for round_ in range(repeats):
            # Which loop goes first alternates: the second run of a pair can meet the first's teardown.
            first, second = (run_plain, run_phalanx) if round_ % 2 == 0 else (run_phalanx, run_plain)
            runs = {first: first(workload, folder)}
            runs[second] = second(workload, folder)
            for loop, run in (("plain", runs[run_plain]), ("phalanx", runs[run_phalanx])):
                rates[loop].append(steady_rate(run))
                means[loop].append(mean_rate(run))
                cpu[loop].append(cpu_ms_per_step(run, per_step))
    wall, cpu_time = compare(rates), compare(cpu)
    step_ms = {loop: per_step / rate * 1e3 for loop, rate in wall["medians"].items()}
    return {
        "workload": name, "train_args": workload, "world_size": WORLD_SIZE, "repeats": repeats,
        "samples_per_second": rates, "median_samples_per_second": wall["medians"], "spread_of_runs": wall["spread"],
        "mean_rate_samples_per_second": means,
        "ratio_of_mean_rates": statistics.median(means["phalanx"]) / statistics.median(means["plain"]),
        "ratio": wall["ratio"], "pair_ratios": wall["pairs"], "median_pair_ratio": wall["median_pair"],
        "step_ms": step_ms, "extra_us_per_step": (step_ms["phalanx"] - step_ms["plain"]) * 1e3,
        "cpu_ms_per_step": cpu, "median_cpu_ms_per_step": cpu_time["medians"], "cpu_ratio": cpu_time["ratio"],
        "cpu_pair_ratios": cpu_time["pairs"], "median_cpu_pair_ratio": cpu_time["median_pair"],
        "cpu_spread_of_runs": cpu_time["spread"],
    }  # fmt: skip


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--plain-worker":
        plain_worker(Path(sys.argv[2]), sys.argv[3:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--phalanx-worker":
        phalanx_worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "loop_overhead.json")
    args = parser.parse_args()
    results = [measure(name, args.repeats) for name in args.workload]
    rows = [
        (r["workload"], f"{r['median_samples_per_second']['plain']:.0f}", f"{r['median_samples_per_second']['phalanx']:.0f}",
         f"{r['ratio']:.3f}", f"{r['ratio_of_mean_rates']:.3f}", f"{r['median_pair_ratio']:.3f} ({min(r['pair_ratios']):.2f}-{max(r['pair_ratios']):.2f})",
         f"{r['step_ms']['plain']:.2f} / {r['step_ms']['phalanx']:.2f}", f"{r['extra_us_per_step']:.0f}",
         f"{r['spread_of_runs']['plain']:.0%} / {r['spread_of_runs']['phalanx']:.0%}")
        for r in results
    ]  # fmt: skip
    headers = ("workload", "plain (samples/s)", "phalanx (samples/s)", "ratio", "ratio (mean rates)", "pair ratio (range)",
               "step ms plain / phalanx", "extra us/step", "spread plain / phalanx")  # fmt: skip
    print(format_table(headers, rows, indent=""))
    print(f"medians of {args.repeats} interleaved runs each, {WORLD_SIZE} processes, steady state; target: ratio >= 0.97")
    print("extra us/step: the phalanx loop's cost per optimizer step over the plain loop's, from the medians")
    print("a run's samples/s: the median of its intervals; ratio (mean rates): the same from each run's total")
    print("samples / total seconds, which a burst of load on a shared machine moves more.")
    print("pair ratio: each phalanx run over the plain run next to it; spread: (max - min) / median of a loop's")
    print("runs. A spread wider than the 3% margin means the machine's noise is larger than what is measured.")
    cpu_rows = [
        (r["workload"], f"{r['median_cpu_ms_per_step']['plain']:.3f}", f"{r['median_cpu_ms_per_step']['phalanx']:.3f}",
         f"{r['cpu_ratio']:.3f}", f"{r['median_cpu_pair_ratio']:.3f} ({min(r['cpu_pair_ratios']):.2f}-{max(r['cpu_pair_ratios']):.2f})",
         f"{r['cpu_spread_of_runs']['plain']:.0%} / {r['cpu_spread_of_runs']['phalanx']:.0%}")
        for r in results
    ]  # fmt: skip
    print()
    print(format_table(("workload", "CPU ms/step plain", "CPU ms/step phalanx", "ratio phalanx / plain", "pair ratio (range)",
                        "spread plain / phalanx"), cpu_rows, indent=""))  # fmt: skip
    print("rank 0's process CPU time per optimizer step (all threads), the median of a run's intervals: the work each")
    print("loop does (a ratio above 1: phalanx's extra work). A neighbour's load moves it too; read it with the spread.")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
