"""Steps of about 2 ms (a tiny all-reduce and a sleep); rank SIGNAL_RANK signals itself SIGUSR1
after step SIGNAL_STEP. Until step LOG_UNTIL, every LOG_EVERY-th boundary is a logging point: a
GlobalMean of the rank's number plus one (the global mean is known: (world_size + 1) / 2) goes
into the boundary's shared all-reduce, with the vote riding along. Every rank writes
OUT/rank<R>.json: the step it stopped after, how many votes its guard started (and how many of
them in a collective of their own, before LOG_UNTIL and in all), and the global means it read.
Usage: preemption_votes.py OUT SIGNAL_RANK SIGNAL_STEP PERIOD_S LOG_EVERY LOG_UNTIL"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx
from phalanx.runtime.preemption import PreemptionGuard

context = phalanx.init()
out, period_s = Path(sys.argv[1]), float(sys.argv[4])
signal_rank, signal_step, log_every, log_until = (int(argument) for argument in (*sys.argv[2:4], *sys.argv[5:7]))
guard = PreemptionGuard(context, period_s=period_s)
boundary = phalanx.SharedReduction(context)
numbers = phalanx.GlobalMean(context, "number")
pending, means, own_votes_while_logging = None, [], 0
step = 0
while step < 5000:
    dist.all_reduce(torch.ones(4))  # the step's own collective, as DDP's gradient all-reduce
    time.sleep(0.002)
    numbers.add_mean(1, number=float(context.rank + 1))
    step += 1
    if context.rank == signal_rank and step == signal_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    if pending is not None:  # the logging point of the previous boundary
        means.append(pending.result()["number"])
        pending = None
    if step <= log_until and step % log_every == 0:
        pending = numbers.compute_async(shared=boundary)
    if guard.should_stop(boundary):
        break
    boundary.start()
    if step == log_until:
        own_votes_while_logging = guard.own_votes
record = {"stopped_after": step, "votes": guard.votes, "own_votes": guard.own_votes,
          "own_votes_while_logging": own_votes_while_logging, "means": means}  # fmt: skip
(out / f"rank{context.rank}.json").write_text(json.dumps(record))
context.close()
