"""Rank FAIL_RANK raises after the first all-reduce; the others block in the second one.

With RECOVER=1 it fails only on the first attempt (TORCHELASTIC_RESTART_COUNT=0). With HOLD=S
the other ranks sleep S seconds before the second all-reduce on that attempt, in no collective,
so that their agent stops them for the restart instead of seeing them fail.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

fail_rank = int(sys.argv[1])
dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} passed the first all-reduce", flush=True)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if dist.get_rank() == fail_rank and (first_attempt or os.environ.get("RECOVER") != "1"):
    time.sleep(0.3)
    raise ValueError(f"rank {fail_rank} fails on purpose")
if first_attempt:
    time.sleep(float(os.environ.get("HOLD", "0")))
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} finished", flush=True)
dist.destroy_process_group()
