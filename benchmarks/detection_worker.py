"""One rank of benchmarks/detection.py: a training-like loop (a matrix product, then an all-reduce
of 1 MiB) until killed or --seconds pass. Rank 0 prints "step N" every 20 steps, so that the
benchmark sees the job train before it cuts a host."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

SIDE, GRADIENT_FLOATS = 256, 256 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3600.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    weights, gradient = torch.randn(SIDE, SIDE), torch.zeros(GRADIENT_FLOATS)
    deadline, step = time.monotonic() + args.seconds, 0
    while time.monotonic() < deadline:
        weights = torch.tanh(weights @ weights) * 0.5
        dist.all_reduce(gradient)
        step += 1
        if dist.get_rank() == 0 and step % 20 == 0:
            print(f"step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
