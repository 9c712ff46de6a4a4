"""Ignores SIGINT and SIGTERM, joins the group, marks itself ready, then sleeps: a worker that a
stop signal does not end."""

import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
(Path(sys.argv[1]) / f"ready{dist.get_rank()}").touch()
time.sleep(600)
