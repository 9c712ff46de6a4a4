"""Steps of about 2 ms (a tiny all-reduce and a sleep); rank SIGNAL_RANK signals itself SIGUSR1
after step SIGNAL_STEP. Every rank writes OUT/rank<R>.json: the step it stopped after and how
many votes its guard started. Usage: preemption_votes.py OUT SIGNAL_RANK SIGNAL_STEP PERIOD_S"""

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
out, signal_rank, signal_step, period_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
guard = PreemptionGuard(context, period_s=period_s)
step = 0
while step < 5000:
    dist.all_reduce(torch.ones(4))  # the step's own collective, as DDP's gradient all-reduce
    time.sleep(0.002)
    step += 1
    if context.rank == signal_rank and step == signal_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    if guard.should_stop():
        break
(out / f"rank{context.rank}.json").write_text(json.dumps({"stopped_after": step, "votes": guard.votes}))
context.close()
