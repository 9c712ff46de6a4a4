"""Rank STALL_RANK sleeps before its third all-reduce (collective #4: phalanx.init's barrier is #1); the others wait in it."""

import sys
import time

import torch
import torch.distributed as dist

import phalanx

context = phalanx.init()
stall_rank = int(sys.argv[1])
for step in range(2):
    dist.all_reduce(torch.ones(4))
    context.mark_step(step + 1)
if context.rank == stall_rank:
    time.sleep(600)
dist.all_reduce(torch.ones(4))
print("not reached")
