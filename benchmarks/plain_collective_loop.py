"""The hand-written reference for benchmarks/collectives_vs_torch.py: a plain torch.distributed
all_reduce timing loop, run under torchrun. Same method as nccl-tests (warm-up, a barrier, -n
calls back to back, the mean over ranks); busbw = bytes / time x 2(n-1)/n. Rank 0 prints one
JSON line {size_bytes: busbw GB/s}.

Usage: torchrun --nproc-per-node 2 benchmarks/plain_collective_loop.py SIZE_BYTES... [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sizes", type=int, nargs="+")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    busbw = {}
    for size in args.sizes:
        tensor = torch.ones(size // 4)
        for _ in range(args.warmup):
            dist.all_reduce(tensor)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(tensor)
        seconds = torch.tensor([(time.perf_counter() - started) / args.iters], dtype=torch.float64)
        dist.all_reduce(seconds)
        mean = seconds.item() / ranks
        busbw[size] = size / mean / 1e9 * 2 * (ranks - 1) / ranks
    if dist.get_rank() == 0:
        print(json.dumps(busbw), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
