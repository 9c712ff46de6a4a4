"""Timed training runs for benchmarks/auto_compression.py: the tutorial's model, each compression.

    auto_compression_worker.py OUT.json --modes auto,none,fp16,powersgd --steps 2000 --repeats 1
                               [--model linear|mlp] [--steady-from 100]

For each repeat, each mode in turn (the order rotates) trains a freshly built and wrapped model
for --steps steps, so auto runs its whole trial every time. linear is the tutorial's model (one
Linear 3x224x224 -> 10, batch 32 per process); mlp is examples/train.py's synthetic one
(150528 -> 128 -> 10). Rank 0 writes, per mode, the global samples/s of every run over all its
steps (auto's trial included: that is what auto costs), the seconds of its first --steady-from
steps and of the rest (the slowest rank's; after auto's trial, the rest runs its choice alone)
and auto's compression summaries.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.model import compression_of, wrap_model

FEATURES = 3 * 224 * 224
RUN_KEYS = ("samples_per_second", "seconds_head_rest", "summaries")


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return torch.nn.Linear(FEATURES, 10)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def timed_run(context: DistributedContext, mode: str, args: argparse.Namespace, images, labels) -> dict:
    model = wrap_model(build(args.model), context, compression=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    context.barrier()
    started = steady = time.perf_counter()
    for step in range(args.steps):
        if step == args.steady_from:
            steady = time.perf_counter()
        part = slice((step % 4) * args.batch_size, (step % 4 + 1) * args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images[part]), labels[part]).backward()
        optimizer.step()
    now = time.perf_counter()
    elapsed = torch.tensor([now - started, steady - started, now - steady], dtype=torch.float64)
    if context.is_distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    summary = compression_of(model).summary()
    del model, optimizer
    gc.collect()  # DDP holds itself in a reference cycle: free this model before the next is built
    total, head, rest = elapsed.tolist()
    return {"samples_per_second": args.steps * args.batch_size * context.world_size / total,
            "seconds_head_rest": [head, rest], "summaries": summary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--modes", default="auto,none,fp16,powersgd")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", choices=["linear", "mlp"], default="linear")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steady-from", type=int, default=100, help="the head: auto's trial (at most 88 steps)")
    args = parser.parse_args()

    context = phalanx.init()
    generator = torch.Generator().manual_seed(1 + context.rank)
    images = torch.randn(4 * args.batch_size, FEATURES, generator=generator)  # cycled: data is not what is timed
    labels = (images @ torch.randn(FEATURES, 10, generator=torch.Generator().manual_seed(0))).argmax(1)
    modes = args.modes.split(",")
    results: dict[str, dict[str, list]] = {mode: {key: [] for key in RUN_KEYS} for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
            for key, value in timed_run(context, mode, args, images, labels).items():
                results[mode][key].append(value)
    if context.is_main:
        args.out.write_text(json.dumps({"model": args.model, "world_size": context.world_size, "steps": args.steps,
                                        "steady_from": args.steady_from, "modes": results}, indent=1))  # fmt: skip
    context.close()


if __name__ == "__main__":
    main()
