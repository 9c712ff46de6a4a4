"""Counts DDP's gradient all-reduces with phalanx.accumulate and without; writes rank<R>.json.

Eight micro-batches in windows of four: with accumulate, only the last backward of a window
all-reduces (2 in all, one bucket each); without, every backward does (8). The gradients at
each window's end must be the same both ways, and the clipped norm the same on every rank.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import phalanx
from phalanx.runtime.gradients import micro_step
from phalanx.runtime.model import wrap_model

EVERY, MICRO_BATCHES = 4, 8
context = phalanx.init()


def run(with_accumulate: bool) -> dict:
    torch.manual_seed(0)
    model = wrap_model(torch.nn.Linear(6, 3), context)
    all_reduces = []

    def counting_allreduce(process_group, bucket):
        all_reduces.append(bucket.index())
        return default_hooks.allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting_allreduce)
    data = torch.Generator().manual_seed(1 + context.rank)  # each rank its own micro-batches
    gradients, norms = [], []
    for index in range(MICRO_BATCHES):
        inputs, target = torch.randn(4, 6, generator=data), torch.randn(4, 3, generator=data)
        if with_accumulate:
            window = phalanx.accumulate(model, index, EVERY)
        else:
            window = contextlib.nullcontext(micro_step(index, EVERY))
        with window as micro:
            (torch.nn.functional.mse_loss(model(inputs), target) * micro.loss_scale).backward()
        if micro.sync:
            gradients.append([p.grad.tolist() for p in model.parameters()])
            norms.append(float(phalanx.clip_gradients(model, max_norm=0.01)))
            model.zero_grad()
    return {"all_reduces": len(all_reduces), "gradients": gradients, "norms": norms}


results = {"accumulate": run(True), "every_backward": run(False)}
Path(sys.argv[1], f"rank{context.rank}.json").write_text(json.dumps(results))
context.close()
