"""One timed training run for benchmarks/auto_compression.py: the tutorial's model, a compression.

    auto_compression_worker.py OUT.json --compression auto --steps 300 [--model linear|mlp]

linear is the tutorial's model (one Linear 3x224x224 -> 10, batch 32 per process); mlp is
examples/train.py's synthetic one (150528 -> 128 -> 10). Rank 0 writes the global samples/s over
all steps (the trial of auto included: that is what auto costs), the compression summary and
the loss of the first and last steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.runtime.model import compression_of, wrap_model

FEATURES = 3 * 224 * 224


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--compression", default="auto")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=["linear", "mlp"], default="linear")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    context = phalanx.init()
    torch.manual_seed(0)
    if args.model == "linear":
        network: torch.nn.Module = torch.nn.Linear(FEATURES, 10)
    else:
        network = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = wrap_model(network, context, compression=args.compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1 + context.rank)
    images = torch.randn(4 * args.batch_size, FEATURES, generator=generator)  # cycled: data is not what is timed
    labels = (images @ torch.randn(FEATURES, 10, generator=torch.Generator().manual_seed(0))).argmax(1)
    losses = []
    context.barrier()
    started = time.perf_counter()
    for step in range(args.steps):
        part = slice((step % 4) * args.batch_size, (step % 4 + 1) * args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images[part]), labels[part])
        loss.backward()
        optimizer.step()
        if step in (0, args.steps - 1):
            losses.append(loss.item())
    elapsed = torch.tensor([time.perf_counter() - started])
    if context.is_distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    if context.is_main:
        samples = args.steps * args.batch_size * context.world_size
        result = {"compression": args.compression, "model": args.model, "world_size": context.world_size,
                  "steps": args.steps, "samples_per_second": samples / elapsed.item(),
                  "first_loss": losses[0], "last_loss": losses[-1], "summary": compression_of(model).summary()}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
    context.close()


if __name__ == "__main__":
    main()
