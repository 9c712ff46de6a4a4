"""Overhead of the phalanx training loop against a hand-written DDP loop, in samples/s.

The phalanx loop below is examples/train.py's, through phalanx's public API only: phalanx.Run
(its ResumableSampler and ResumableLoader, the global loss of the real samples, progress lines,
metrics file, preemption guard, stall watchdog, consistency check; no checkpoints). The plain loop
is the tutorial's own (shared/seed/): DistributedSampler, DDP, SGD, each batch moved to the
device, a CrossEntropyLoss module, rank 0 printing the last batch's loss after each epoch, no
metrics. Both train the same model (build_model: train.py's MLP) on the same data (make_dataset)
with the same per-process batch, launched the same way (`phalanx run --nproc-per-node 2`). Both
loops live here, so no change to examples/ can break the benchmark unnoticed; its smoke run
(--smoke, in `make test`) proves that it still runs.

Both are timed on rank 0 after the same optimizer steps (each loop calls its step timer after
the optimizer step), in intervals of --log-every steps, so that every interval holds
the same per-epoch and per-log work; the first interval, which starts after the first step, is
the warm-up and left out. The ranks step in lockstep (every step all-reduces), so rank 0's clock
times the job. Compared are pairs, phalanx over plain:

- --method turns (the default): both loops are launched together and train in turns of a few
  steps (TURN_STEPS, --turn-steps; benchmarks/turns.py), their clocks stopped while the other
  trains. A pair is the two loops' intervals of the same steps, trained in alternate turns
  well under a second apart, so a neighbour's burst of load on this shared machine hits both
  alike. Which loop starts alternates from launch to launch. A possible price: each turn
  starts with caches the other job has used, which would cost the process with the larger
  working set more. It did not show: on digits, phalanx's CPU time per step came out at
  1.066 x plain's [1.042, 1.099] with 7-step turns (12 launches) and 1.076 x [1.041, 1.133] with
  56-step turns (6 launches), while the shorter turns gave the narrower interval in wall time.
  The preemption guard's votes ride on the logging points' all-reduces here (one per
  --log-every steps, far less than the two seconds between votes), so the pauses, which
  stretch its wall clock, add no collective.
- --method runs: one loop at a time, a run of each per round (which goes first alternates); a
  pair is the two runs of a round, a run's figure the median of its intervals. Runs are seconds
  apart: on the 2-core machine this was written on, their spread is wider than the 3% margin.

Reported: the median pair ratio with its distribution-free 95% confidence interval, and the
median of the launches' median pairs with its own (the intervals of one launch share its memory
layout and placement, so they are not quite independent: with identical loops on both sides,
launch medians of 11 pairs spread 0.92-1.11 on the 2-core machine this was written on). The
target (>= 0.97, overhead at most 3%) is met when both intervals lie above it; at 6 launches the
launches' interval is their whole range, and with launch medians that spread by 5-10%, deciding
a margin of 1-2% takes many launches (on digits, 16 launches twice left it undecided; 60 gave
intervals of about +-1.5%). Beside them: rank 0's process CPU time per step (all its threads:
gloo's and the stall watchdog's too), the work each loop does.
CPU time misses a cost that is only waiting, which the wall time catches, and is not free of the
machine's noise either (cache misses under a neighbour's load, time stolen by the host).

--pin binds each rank to a CPU of its own, the same one in both loops (local rank 0 to the first
CPU the benchmark may use, 1 to the second). Free, the scheduler places the 4 training processes
on the 2-core machine anew in every launch. Free is the default: it is how a job runs when
nothing binds it. On digits, runs of 60 launches gave:

- free, four runs (one per working session): pair medians 0.970-0.982, the last one
  0.981 [0.961, 0.997]; each left the target undecided, an overhead of 1.8-3.0% whose
  intervals reach past 3%;
- pinned, the run chosen beforehand to decide: pairs 0.998 [0.989, 1.013], launches
  0.998 [0.988, 1.019]: met; CPU time per step 1.013 [0.998, 1.025] x plain's; launch medians
  0.91-1.19 (free: 0.81-1.16), so pinning did not narrow the spread.

Free placement seems to cost phalanx about 2% more than plain, and pinned placement not; why
is not known (phalanx's explicit work, measured in place, is about 35-40 us of a 2.1 ms step).

Workloads (random data drawn from a fixed seed): digits (the shape of scikit-learn's digits, 8x8
images in 10 classes, a ~3 ms step: the worst case for any per-step cost; an interval is two
28-step epochs) and synthetic (the tutorial's 3x224x224 images: a ~270 ms step dominated by the
gradient all-reduce of the 19M-parameter model).

Usage: python benchmarks/loop_overhead.py [--repeats 6] [--workload digits synthetic] [--method turns]
       [--turn-steps N] [--pin] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from targets import Target, write_report  # benchmarks/: a script's folder is on its path
from turns import TURN_TIMEOUT_S, BlockClock, Referee, Turns

from phalanx.console import format_table

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A workload's data, model and schedule; both loops read the same one."""

    samples: int
    features: int
    batch_size: int  # per process
    epochs: int
    log_every: int  # optimizer steps per interval
    classes: int = 10
    lr: float = 0.05
    seed: int = 0


WORKLOADS = {
    "digits": Shape(samples=1792, features=64, batch_size=32, epochs=24, log_every=56),
    "synthetic": Shape(samples=512, features=3 * 224 * 224, batch_size=32, epochs=12, log_every=8),
}
#: --smoke: two intervals of the smallest workload, one launch (seconds; it proves the benchmark runs).
SMOKE = dataclasses.replace(WORKLOADS["digits"], epochs=4)
#: Steps per turn (a divisor of --log-every): short turns, so that the two intervals of a pair run
#: close together in time; the figures are per --log-every steps, the sum of consecutive turns.
TURN_STEPS = {"digits": 7, "synthetic": 2}  # ~25 ms and ~0.5 s


WORLD_SIZE = 2
#: The phalanx loop's samples/s over the plain loop's: overhead at most 3%.
TARGET = 0.97
#: Longest one run alone may take (--method runs); a digits run takes seconds, a synthetic one a minute.
RUN_TIMEOUT_S = 600.0
#: The turns' Unix socket, handed to the workers by the benchmark in --method turns.
TURNS_ENV = "LOOP_OVERHEAD_TURNS"
#: Set (by --pin): each worker binds itself to one CPU (pin_to_own_cpu).
PIN_ENV = "LOOP_OVERHEAD_PIN"
LOOPS = ("plain", "phalanx")


def launch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", str(WORLD_SIZE), *argv]


class Interval(NamedTuple):
    """--log-every optimizer steps on rank 0 (the first interval, the warm-up, one step fewer)."""

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


def cpu_ms_per_step(interval: Interval, samples_per_step: int) -> float:
    return interval.cpu_seconds / (interval.samples / samples_per_step) * 1e3


def compare(runs: dict[str, list[float]]) -> dict[str, object]:
    """The median of each loop's figures (a run's or an interval's), their spread ((max - min) /
    median), the ratio phalanx / plain of the medians, and the pairs: each phalanx figure over
    the plain one beside it (the two saw the same machine state), their median with its 95%
    confidence interval."""
    medians = {loop: statistics.median(values) for loop, values in runs.items()}
    pairs = [mine / plain for mine, plain in zip(runs["phalanx"], runs["plain"])]
    return {
        "medians": medians, "spread": {loop: (max(v) - min(v)) / medians[loop] for loop, v in runs.items()},
        "ratio": medians["phalanx"] / medians["plain"], "pairs": pairs, "median_pair": statistics.median(pairs),
        "median_pair_95": median_interval(pairs),
    }  # fmt: skip


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: the pair of order statistics that
    holds it at least this often (a binomial count of the values below the median). None when
    there are too few values for one."""
    ordered, count = sorted(values), len(values)
    below, lower = 0.0, 0  # P(fewer than `lower` values fall below the median) <= (1 - confidence) / 2
    while below + math.comb(count, lower) / 2**count <= (1 - confidence) / 2:
        below += math.comb(count, lower) / 2**count
        lower += 1
    return (ordered[lower - 1], ordered[count - lower]) if lower else None


def make_dataset(shape: Shape):
    """Random inputs, each labelled by a fixed random linear map: learnable, alike on every rank."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(shape.seed)
    inputs = torch.randn(shape.samples, shape.features, generator=generator)
    labels = (inputs @ torch.randn(shape.features, shape.classes, generator=generator)).argmax(1)
    return TensorDataset(inputs, labels)


def build_model(shape: Shape):
    """examples/train.py's model: features -> 128 -> classes."""
    import torch

    torch.manual_seed(shape.seed)
    return torch.nn.Sequential(
        torch.nn.Linear(shape.features, 128), torch.nn.ReLU(), torch.nn.Linear(128, shape.classes)
    )


class Workload(NamedTuple):
    name: str  # in WORKLOADS, or "smoke"
    shape: Shape
    turn_steps: int  # the steps a turn trains (also where --method runs stops its clock)


def worker_argv(loop: str, workload: Workload, folder: Path) -> list[str]:
    return launch("--log-dir", str(folder / f"logs-{loop}"), __file__, f"--{loop}-worker", str(folder / f"{loop}.json"),
                  str(workload.turn_steps), json.dumps(dataclasses.asdict(workload.shape)))  # fmt: skip


def read_intervals(loop: str, workload: Workload, folder: Path) -> Intervals:
    """The run's blocks, summed into intervals of --log-every steps (the first: the warm-up)."""
    blocks = [Interval(*block) for block in json.loads((folder / f"{loop}.json").read_text())]
    per_interval = log_every(workload) // workload.turn_steps
    groups = [blocks[start : start + per_interval] for start in range(0, len(blocks), per_interval)]
    return [Interval(*map(sum, zip(*group))) for group in groups]


def start(loop: str, workload: Workload, folder: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    output = (folder / f"{loop}.out").open("wb")  # the launcher's console: what a failure said
    with output:
        return subprocess.Popen(worker_argv(loop, workload, folder), env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def failure(jobs: dict[str, subprocess.Popen[bytes]], folder: Path, why: str) -> SystemExit:
    """What went wrong, with the end of the console output of every loop that failed."""
    lines = [f"loop_overhead: {why}"]
    for loop, job in jobs.items():
        if job.poll() not in (None, 0):
            tail = (folder / f"{loop}.out").read_text(errors="replace").splitlines()[-15:]
            lines += [f"the {loop} loop exited with {job.returncode}; its last lines:", *("  " + line for line in tail)]
    return SystemExit("\n".join(lines))


def finish(jobs: dict[str, subprocess.Popen[bytes]], folder: Path, name: str, timeout: float) -> None:
    """Waits for the jobs to end; raises the failure when one fails or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        for job in jobs.values():
            job.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise failure(jobs, folder, f"a {name} run took longer than {timeout:g} s") from None
    if any(job.returncode for job in jobs.values()):
        raise failure(jobs, folder, f"a {name} run failed")


def stop(jobs: dict[str, subprocess.Popen[bytes]]) -> None:
    for job in jobs.values():
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def run_alone(loop: str, workload: Workload, folder: Path, env: dict[str, str]) -> Intervals:
    jobs = {loop: start(loop, workload, folder, env)}
    try:
        finish(jobs, folder, workload.name, timeout=RUN_TIMEOUT_S)
    finally:
        stop(jobs)
    return read_intervals(loop, workload, folder)


def run_in_turns(order: tuple[str, ...], workload: Workload, folder: Path, env: dict[str, str]) -> dict[str, Intervals]:
    """Both loops launched together, training their blocks in turns (benchmarks/turns.py)."""
    path = folder / "turns.sock"
    path.unlink(missing_ok=True)
    jobs: dict[str, subprocess.Popen[bytes]] = {}
    referee = Referee(path, order, WORLD_SIZE)
    try:
        for loop in order:
            jobs[loop] = start(loop, workload, folder, env={**env, TURNS_ENV: str(path)})
        try:
            referee.run(
                steps_of(workload) // workload.turn_steps, running=lambda: all(j.poll() is None for j in jobs.values())
            )
        except (OSError, RuntimeError) as error:  # a timeout, a closed connection: a job died or hangs
            time.sleep(1)  # a job that died has exited by now: its code names it
            raise failure(jobs, folder, f"the turns of {workload.name} broke off ({error})") from None
        finish(jobs, folder, workload.name, timeout=TURN_TIMEOUT_S)  # after the last turn
    finally:
        referee.close()
        stop(jobs)
    return {loop: read_intervals(loop, workload, folder) for loop in order}


def log_every(workload: Workload) -> int:
    every = workload.shape.log_every
    assert every % workload.turn_steps == 0, workload  # main refuses a --turn-steps that does not divide it
    return every


def steps_of(workload: Workload) -> int:
    """The optimizer steps of a run (the workloads divide evenly: no padding, no short batch)."""
    shape = workload.shape
    per_step = shape.batch_size * WORLD_SIZE
    assert shape.samples % per_step == 0, workload.name
    steps = shape.epochs * shape.samples // per_step
    assert steps % log_every(workload) == 0, workload.name
    return steps


def is_boundary(step: int, turn_steps: int) -> bool:
    """Where both loops stop their clock: after the first step (the start-up is left out) and
    after every turn_steps steps."""
    return step == 1 or step % turn_steps == 0


def block_clock(loop: str, samples_per_step: int) -> BlockClock:
    path = os.environ.get(TURNS_ENV)
    return BlockClock(samples_per_step, Turns(path, loop, int(os.environ["RANK"])) if path else None)


def step_timer(clock: BlockClock, turn_steps: int) -> Callable[[int], None]:
    """What each loop calls after every optimizer step: one frame, the same in both, so that the
    harness costs them alike."""

    def after_step(step: int) -> None:
        if is_boundary(step, turn_steps):
            clock.boundary(step)

    return after_step


def write_blocks(clock: BlockClock, out: Path) -> None:
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(clock.blocks))


def phalanx_worker(out: Path, turn_steps: int, shape: Shape) -> None:
    """examples/train.py's loop, through phalanx.Run; the step timer after every optimizer step."""
    import torch

    import phalanx

    run = phalanx.Run(log_every=shape.log_every, metrics_jsonl=out.with_name("phalanx.jsonl"))
    dataset = make_dataset(shape)
    model = run.setup_model(build_model(shape))
    optimizer = torch.optim.SGD(model.parameters(), lr=shape.lr, momentum=0.9)
    run.track(optimizer=optimizer)
    loader = run.setup_dataloader(dataset, batch_size=shape.batch_size, seed=shape.seed)
    clock, step = block_clock("phalanx", shape.batch_size * run.world_size), 0
    after_step = step_timer(clock, turn_steps)
    for _epoch in run.epochs(shape.epochs):
        for images, labels in loader:
            losses = torch.nn.functional.cross_entropy(model(images.to(run.device)), labels.to(run.device),
                                                       reduction="none")  # fmt: skip
            losses.mean().backward()
            run.record(losses)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.step()
            step += 1
            after_step(step)
    write_blocks(clock, out)
    run.close()


def plain_worker(out: Path, turn_steps: int, shape: Shape) -> None:
    """The hand-written loop, as the tutorial (shared/seed/) writes it: DistributedSampler, DDP,
    SGD, each batch moved to the device, the loss from a CrossEntropyLoss module, rank 0 printing
    the last batch's loss after each epoch. On the CPU (gloo), timed at the same steps."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")  # the tutorial's cuda:<local rank>, here on gloo
    dataset = make_dataset(shape)
    model = DistributedDataParallel(build_model(shape).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=shape.lr, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=shape.seed)
    loader = DataLoader(dataset, batch_size=shape.batch_size, sampler=sampler)
    clock, step = block_clock("plain", shape.batch_size * world), 0
    after_step = step_timer(clock, turn_steps)
    for epoch in range(shape.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            after_step(step)
        if rank == 0:
            print(f"Epoch {epoch}, Loss: {loss.item():.4f}")
    write_blocks(clock, out)
    del model
    gc.collect()  # DDP holds the group in a reference cycle; destroy it before interpreter exit
    dist.destroy_process_group()


def pin_to_own_cpu() -> None:
    """Binds this worker, and every thread it starts later (gloo's too), to the CPU of its local
    rank among those this process may use: the same CPU for the same rank of both loops."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})


def measure(workload: Workload, repeats: int, method: str, pin: bool) -> dict[str, object]:
    name = workload.name
    env = {**os.environ, PIN_ENV: "1"} if pin else {k: v for k, v in os.environ.items() if k != PIN_ENV}
    per_step = workload.shape.batch_size * WORLD_SIZE  # samples per optimizer step
    runs: dict[str, list[Intervals]] = {loop: [] for loop in LOOPS}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        run_alone("plain", workload, folder, env)  # warms the file cache and the dataset load, not counted
        for round_ in range(repeats):
            # Which loop goes first alternates: the second can meet the first's teardown, or its cache footprint.
            order = LOOPS if round_ % 2 == 0 else LOOPS[::-1]
            if method == "turns":
                intervals = run_in_turns(order, workload, folder, env)
            else:
                intervals = {loop: run_alone(loop, workload, folder, env) for loop in order}
            for loop in LOOPS:
                runs[loop].append(intervals[loop])
    if method == "turns":  # a pair: the two loops' intervals of the same steps, trained in alternate turns
        rates = {loop: [i.samples / i.seconds for run in runs[loop] for i in run[1:]] for loop in LOOPS}
        cpu = {loop: [cpu_ms_per_step(i, per_step) for run in runs[loop] for i in run[1:]] for loop in LOOPS}
    else:  # a pair: the two loops' runs of a round
        rates = {loop: [steady_rate(run) for run in runs[loop]] for loop in LOOPS}
        cpu = {
            loop: [statistics.median(cpu_ms_per_step(i, per_step) for i in run[1:]) for run in runs[loop]]
            for loop in LOOPS
        }
    wall, cpu_time = compare(rates), compare(cpu)
    per_launch = len(wall["pairs"]) // repeats  # the pairs come launch by launch
    launch_medians = [
        statistics.median(wall["pairs"][i : i + per_launch]) for i in range(0, len(wall["pairs"]), per_launch)
    ]
    step_ms = {loop: per_step / rate * 1e3 for loop, rate in wall["medians"].items()}
    return {
        "workload": name, "method": method, "shape": dataclasses.asdict(workload.shape), "turn_steps": workload.turn_steps,
        "world_size": WORLD_SIZE, "repeats": repeats, "pinned": pin,
        "intervals": {loop: [[list(i) for i in run] for run in runs[loop]] for loop in LOOPS},
        "ratio_of_mean_rates": statistics.median(map(mean_rate, runs["phalanx"])) / statistics.median(map(mean_rate, runs["plain"])),
        "samples_per_second": rates, "wall": wall, "step_ms": step_ms, "launch_medians": launch_medians,
        "launch_median": statistics.median(launch_medians), "launch_median_95": median_interval(launch_medians),
        "extra_us_per_step": (step_ms["phalanx"] - step_ms["plain"]) * 1e3,
        "cpu_ms_per_step": cpu, "cpu": cpu_time,
    }  # fmt: skip


def verdict(*intervals: tuple[float, float] | None, target: float = TARGET) -> str:
    """Whether the median ratio is above the target with 95% confidence by every interval given:
    met when each lies at or above it, missed when each lies below."""
    if any(interval is None for interval in intervals):
        return "too few runs"
    if all(low >= target for low, _ in intervals):
        return "met"
    return "not met" if all(high < target for _, high in intervals) else "not decided"


def interval_cell(median: float, interval: tuple[float, float] | None) -> str:
    return f"{median:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def ratio_cell(figures: dict[str, object]) -> str:
    return interval_cell(figures["median_pair"], figures["median_pair_95"])


def report(results: list[dict[str, object]], repeats: int, method: str, pin: bool) -> None:
    pairs = "interval pairs" if method == "turns" else "run pairs"
    rows = [
        (r["workload"], f"{r['wall']['medians']['plain']:.0f}", f"{r['wall']['medians']['phalanx']:.0f}",
         ratio_cell(r["wall"]), str(len(r["wall"]["pairs"])), interval_cell(r["launch_median"], r["launch_median_95"]),
         verdict(r["wall"]["median_pair_95"], r["launch_median_95"]),
         f"{min(r['launch_medians']):.3f}-{max(r['launch_medians']):.3f}", f"{r['ratio_of_mean_rates']:.3f}",
         f"{r['step_ms']['plain']:.2f} / {r['step_ms']['phalanx']:.2f}", f"{r['extra_us_per_step']:.0f}",
         f"{r['wall']['spread']['plain']:.0%} / {r['wall']['spread']['phalanx']:.0%}")
        for r in results
    ]  # fmt: skip
    headers = ("workload", "plain (samples/s)", "phalanx (samples/s)", "pair ratio [95%]", pairs, "launch ratio [95%]",
               f"ratio >= {TARGET}", "launches", "ratio of totals", "step ms plain / phalanx", "extra us/step", "spread plain / phalanx")  # fmt: skip
    print(format_table(headers, rows, indent=""))
    if method == "turns":
        print(
            f"{repeats} launch{'es' if repeats != 1 else ''} of both loops together, {WORLD_SIZE} processes each, training in turns of a few steps: a"
        )
        print("pair is the two loops' intervals of the same --log-every steps (the first of a launch left out).")
    else:
        print(
            f"{repeats} round{'s' if repeats != 1 else ''} of one run of each loop, {WORLD_SIZE} processes; a run's samples/s: the median of its"
        )
        print("intervals of --log-every steps (the first left out); a pair: the two runs of a round.")
    print(
        "Each rank bound to a CPU of its own, the same one in both loops (--pin)."
        if pin
        else "Placed by the scheduler, as a job runs when nothing binds it (--pin binds each rank to a CPU of its own)."
    )
    print(
        "pair ratio: the median of phalanx / plain over the pairs, with its distribution-free 95% confidence interval."
    )
    print("launch ratio: the same over each launch's median pair: the pairs of one launch share its memory layout and")
    print("placement, which this interval covers and the pairs' does not. The target (overhead at most 3%) is met when")
    print(
        f"both intervals lie at or above {TARGET}, not met when both lie below. launches: the lowest and highest launch"
    )
    print("median. ratio of totals: each run's samples over its seconds, the median over the runs, phalanx / plain: it")
    print(
        "counts a cost that comes in few intervals, which the pairs' median passes over, and a neighbour's bursts too."
    )
    print(
        "samples/s, step ms, extra us/step: the medians over all intervals or runs of each loop; spread: (max - min) /"
    )
    print("median of them.")
    cpu_rows = [
        (r["workload"], f"{r['cpu']['medians']['plain']:.3f}", f"{r['cpu']['medians']['phalanx']:.3f}",
         ratio_cell(r["cpu"]), f"{r['cpu']['spread']['plain']:.0%} / {r['cpu']['spread']['phalanx']:.0%}")
        for r in results
    ]  # fmt: skip
    print()
    print(format_table(("workload", "CPU ms/step plain", "CPU ms/step phalanx", "pair ratio [95%]", "spread plain / phalanx"),
                       cpu_rows, indent=""))  # fmt: skip
    print("rank 0's process CPU time per optimizer step (all its threads: gloo's and the stall watchdog's too): the")
    print("work each loop does (a ratio above 1: phalanx's extra work). It misses a cost that is only waiting, which")
    print("the wall time catches; a neighbour's load moves it too (cache misses, time stolen by the host).")


def main() -> None:
    for flag, worker in (("--plain-worker", plain_worker), ("--phalanx-worker", phalanx_worker)):
        if len(sys.argv) > 2 and sys.argv[1] == flag:
            if os.environ.get(PIN_ENV):
                pin_to_own_cpu()  # before torch starts a thread
            worker(Path(sys.argv[2]), int(sys.argv[3]), Shape(**json.loads(sys.argv[4])))
            return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="launches (turns) or rounds of one run each (runs)")
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--method", choices=("turns", "runs"), default="turns",
                        help="turns: both loops launched together, training their blocks in turns (the default: "
                             "a neighbour's load hits both alike); runs: one loop at a time, rounds interleaved")  # fmt: skip
    parser.add_argument(
        "--turn-steps",
        type=int,
        metavar="N",
        help=f"steps per turn, a divisor of the workload's --log-every (default: {TURN_STEPS})",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="bind each rank to a CPU of its own, the same one in both loops (default: the scheduler places them)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one launch of a small digits run (seconds): proves that the benchmark runs, judges nothing",
    )
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/loop_overhead_<method>.json")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, workloads = 1, [Workload("smoke", SMOKE, args.turn_steps or TURN_STEPS["digits"])]
    else:
        workloads = [Workload(name, WORKLOADS[name], args.turn_steps or TURN_STEPS[name]) for name in args.workload]
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least one launch")
    if args.pin and len(os.sched_getaffinity(0)) < WORLD_SIZE:
        parser.error(f"--pin: {WORLD_SIZE} ranks need {WORLD_SIZE} CPUs of their own; this process may use "
                     f"{len(os.sched_getaffinity(0))}")  # fmt: skip
    for workload in workloads:
        every = workload.shape.log_every
        if workload.turn_steps < 2 or every % workload.turn_steps:
            parser.error(f"--turn-steps {workload.turn_steps}: a turn must be at least 2 steps and divide "
                         f"the {workload.name} workload's --log-every {every}")  # fmt: skip
    results = [measure(workload, args.repeats, args.method, args.pin) for workload in workloads]
    report(results, args.repeats, args.method, args.pin)
    targets = [Target(f"samples/s, phalanx.Run loop / hand-written DDP loop ({r['workload']}, pairs)", r["wall"]["median_pair"],
                      TARGET, at_least=True, decided=verdict(r["wall"]["median_pair_95"], r["launch_median_95"]))
               for r in results]  # fmt: skip
    write_report(args.json or REPO / "benchmarks" / "results" / f"loop_overhead_{args.method}.json", results, targets,
                 smoke=args.smoke)  # fmt: skip


if __name__ == "__main__":
    main()
