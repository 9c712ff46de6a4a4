"""Joins the group, marks itself ready, then sleeps: a job to be stopped from outside."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
(Path(sys.argv[1]) / f"ready{dist.get_rank()}").touch()
time.sleep(600)
