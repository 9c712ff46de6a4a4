"""Ranks 0 and 1 share a process group "pair" beside the default one. After 30 all-reduces of
the default group and 2 of the pair, rank 1 sleeps before the pair's collective #3, where rank
0 waits; rank 2, no member of the pair, sleeps too, outside any collective. Like
examples/train.py, every rank has a PreemptionGuard, which catches the SIGTERM that torchrun's
agent stops the sleepers with: they are SIGKILLed after its grace period (30 s)."""

import time

import torch
import torch.distributed as dist

import phalanx
from phalanx.runtime.preemption import PreemptionGuard

context = phalanx.init()
guard = PreemptionGuard(context)
pair = dist.new_group([0, 1], group_desc="pair")
for step in range(30):
    dist.all_reduce(torch.ones(4))
    context.mark_step(step + 1)
if context.rank in (0, 1):
    for _ in range(2):
        dist.all_reduce(torch.ones(4), group=pair)
if context.rank != 0:
    time.sleep(600)
dist.all_reduce(torch.ones(4), group=pair)
print("not reached")
