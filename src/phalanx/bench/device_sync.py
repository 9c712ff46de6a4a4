"""Waiting for a device and for the other ranks, as every measurement of a collective must."""

from __future__ import annotations

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """On a GPU, calls return before the work is done: the clock may stop only after this."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device) -> None:
    """Every rank has arrived. An all-reduce rather than dist.barrier(), which on NCCL guesses
    a device and warns."""
    dist.all_reduce(torch.zeros(1, device=device))
    synchronize(device)
