"""Times DDP training steps of one model and compression, with a 1-process baseline, in one job.

Every round of the measurement runs, one after another:
  1. the baseline: global rank 0 alone trains its own copy of the model without DDP, while the
     other ranks wait in a barrier of a gloo group (which blocks in a socket read: they use no
     CPU, and each round records the CPU time they spent waiting, to show it);
  2. a DDP step on every rank: forward, cross-entropy, backward (with DDP's all-reduce of the
     gradients and the compression hook), SGD step;
  3. the same step inside ``model.no_sync()``: DDP's communication left out, the compute alone.
Interleaving the three kinds of step round by round exposes them to the same noise (other
jobs on the machine, clock changes); each figure is the median over the timed rounds, taken per
rank and then the largest over the ranks, since the slowest rank sets the pace of a job.

The ranks' parameters drift apart during the no_sync steps; that changes no timing.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.bench.ddp_models import CLASSES, BenchModel
from phalanx.bench.ddp_settings import DdpSettings
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.model import wrap_model

SEED = 1234


@dataclass(frozen=True)
class StepTimes:
    """Seconds per step, medians over the timed rounds, the largest over the ranks."""

    step: float  # a DDP step
    compute: float  # the same step with DDP's communication left out (no_sync)
    baseline: float  # rank 0 alone, without DDP
    #: The largest share of one core that a rank waiting out the baseline used (CPU time / wall time).
    waiting_cpu: float


class _TrainingStep:
    """One SGD step on a fixed synthetic batch; returns its wall time in seconds."""

    def __init__(
        self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, local_only: bool = False
    ) -> None:
        self.model, self.inputs, self.labels = model, inputs, labels
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        no_sync = getattr(model, "no_sync", None)  # a DDP model; a single process has nothing to leave out
        self.context: Callable[[], Any] = no_sync if local_only and no_sync else contextlib.nullcontext
        self.device = inputs.device

    def __call__(self) -> float:
        started = time.perf_counter()
        with self.context():
            self.optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(self.inputs), self.labels).backward()
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started


def waiting_group(context: DistributedContext) -> Any:
    """The group the ranks wait in during the baseline: gloo, whose barrier blocks in a socket
    read; an NCCL barrier would keep the waiting ranks' CPUs spinning on their streams."""
    return None if context.backend == "gloo" else dist.new_group(backend="gloo")


def _batch(model: BenchModel, batch_size: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic samples and labels made on the device, from a seed fixed per rank."""
    generator = torch.Generator(device=device).manual_seed(SEED + rank)
    inputs = torch.randn((batch_size, *model.sample_shape), generator=generator, device=device)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator, device=device)
    return inputs, labels


def _fresh(model: BenchModel) -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank and for the baseline
    return model.build()


class _Rounds:
    """Accumulates the timed rounds of one rank."""

    def __init__(self) -> None:
        self.step: list[float] = []
        self.compute: list[float] = []
        self.baseline: list[float] = []
        self.waited_cpu = 0.0
        self.waited_wall = 0.0


def measure(
    model: BenchModel, compression: str, settings: DdpSettings, context: DistributedContext, group: Any
) -> StepTimes:
    """Runs the warm-up and timed rounds on every rank (a collective) and agrees on the figures."""
    inputs, labels = _batch(model, settings.batch_size, context.rank, context.device)
    baseline = _TrainingStep(_fresh(model).to(context.device), inputs, labels) if context.is_main else None
    warmup = settings.warmup_for(compression)
    if baseline is not None and not context.is_distributed:
        # one process: wrap_model makes no DDP, so its step is the baseline's step, with nothing to send
        seconds = statistics.median([baseline() for _ in range(warmup + settings.steps)][warmup:])
        return StepTimes(step=seconds, compute=seconds, baseline=seconds, waiting_cpu=0.0)
    ddp = wrap_model(_fresh(model), context, compression=compression)
    synced, local = _TrainingStep(ddp, inputs, labels), _TrainingStep(ddp, inputs, labels, local_only=True)
    rounds = _Rounds()
    for index in range(warmup + settings.steps):
        timed = index >= warmup
        wall, cpu = time.perf_counter(), time.process_time()
        if baseline is not None:
            seconds = baseline()
            if timed:
                rounds.baseline.append(seconds)
        dist.barrier(group=group)
        if timed and baseline is None:
            rounds.waited_wall += time.perf_counter() - wall
            rounds.waited_cpu += time.process_time() - cpu
        step, compute = synced(), local()
        if timed:
            rounds.step.append(step)
            rounds.compute.append(compute)
    return _agree(rounds, context)


def _agree(rounds: _Rounds, context: DistributedContext) -> StepTimes:
    waiting = rounds.waited_cpu / rounds.waited_wall if rounds.waited_wall > 0 else 0.0
    baseline = statistics.median(rounds.baseline) if rounds.baseline else 0.0  # rank 0's; 0 elsewhere
    mine = [statistics.median(rounds.step), statistics.median(rounds.compute), baseline, waiting]
    figures = torch.tensor(mine, dtype=torch.float64, device=context.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    step, compute, baseline, waiting = figures.tolist()
    return StepTimes(step=step, compute=compute, baseline=baseline, waiting_cpu=waiting)
