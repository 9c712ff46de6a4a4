"""Joins the group, marks itself ready, then all-reduces forever: a job whose ranks notice a lost peer."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
(Path(sys.argv[1]) / f"ready{dist.get_rank()}").touch()
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
