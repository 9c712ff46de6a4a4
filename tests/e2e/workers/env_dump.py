"""A worker that joins the process group, checks one all-reduce, and writes its environment."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "PHALANX_NODE",
    "PHALANX_BACKEND",
    "OMP_NUM_THREADS",
)
record = {key: os.environ.get(key) for key in keys}
record["allreduce"] = total.item()
record["argv"] = sys.argv[2:]
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
print(f"hello from rank {dist.get_rank()}")
dist.destroy_process_group()
