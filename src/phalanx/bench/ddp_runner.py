"""Times DDP training steps of one model and compression, with a 1-process baseline, in one job.

Each round runs the baseline (rank 0 alone, without DDP, while the others wait in a gloo
barrier), a DDP step, and the same step under ``no_sync()`` (the compute alone): interleaved, the
three see the same noise. Each figure is the median over the rounds, then the largest over the
ranks, since the slowest rank sets a job's pace.
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
from phalanx.bench.device_sync import synchronize
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


def _training_step(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, local_only: bool = False
) -> Callable[[], float]:
    """One SGD step on a fixed synthetic batch, as a call that returns its wall time in seconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    no_sync = getattr(model, "no_sync", None)  # a DDP model; a single process has nothing to leave out
    context: Callable[[], Any] = no_sync if local_only and no_sync else contextlib.nullcontext

    def step() -> float:
        started = time.perf_counter()
        with context():
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        synchronize(inputs.device)
        return time.perf_counter() - started

    return step


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


def measure(
    model: BenchModel, compression: str, settings: DdpSettings, context: DistributedContext, group: Any
) -> StepTimes:
    """Runs the warm-up and timed rounds on every rank (a collective) and agrees on the figures."""
    inputs, labels = _batch(model, settings.batch_size, context.rank, context.device)
    baseline = _training_step(_fresh(model).to(context.device), inputs, labels) if context.is_main else None
    warmup = settings.warmup_for(compression)
    if baseline is not None and not context.is_distributed:
        # one process: wrap_model makes no DDP, so its step is the baseline's step, with nothing to send
        seconds = statistics.median([baseline() for _ in range(warmup + settings.steps)][warmup:])
        return StepTimes(step=seconds, compute=seconds, baseline=seconds, waiting_cpu=0.0)
    ddp = wrap_model(_fresh(model), context, compression=compression)
    synced, local = _training_step(ddp, inputs, labels), _training_step(ddp, inputs, labels, local_only=True)
    steps, computes, baselines = [], [], []  # seconds, of the timed rounds
    waited_cpu = waited_wall = 0.0
    for index in range(warmup + settings.steps):
        timed = index >= warmup
        wall, cpu = time.perf_counter(), time.process_time()
        if baseline is not None:
            seconds = baseline()
            if timed:
                baselines.append(seconds)
        dist.barrier(group=group)
        if timed and baseline is None:
            waited_wall += time.perf_counter() - wall
            waited_cpu += time.process_time() - cpu
        step, compute = synced(), local()
        if timed:
            steps.append(step)
            computes.append(compute)
    mine = [
        statistics.median(steps),
        statistics.median(computes),
        statistics.median(baselines) if baselines else 0.0,  # rank 0's; 0 elsewhere
        waited_cpu / waited_wall if waited_wall > 0 else 0.0,
    ]
    figures = torch.tensor(mine, dtype=torch.float64, device=context.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return StepTimes(*figures.tolist())
