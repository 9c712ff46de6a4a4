"""Rank 0 finishes at once; rank 1 ends LATE seconds later (default 3), when rank 0's node has
long finished: it fails (as a rank that crashes writing its results after the last collective
would), or with the argument ``finish`` it finishes too. Usage: rank1_late.py [finish]"""

import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")  # a job of one world, whose ranks end at different times
dist.barrier()
dist.destroy_process_group()
if int(os.environ["RANK"]) == 1:
    time.sleep(float(os.environ.get("LATE", "3")))
    if sys.argv[1:] != ["finish"]:
        raise ValueError("rank 1 fails after rank 0 finished")
print(f"rank {os.environ['RANK']} finished", flush=True)
