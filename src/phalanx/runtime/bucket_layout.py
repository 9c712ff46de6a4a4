"""DDP's gradient buckets settled before the first step, so that a resumed run sums exactly as an
uninterrupted one did.

DDP rebuilds its buckets after the first backward, and where an element sits in its bucket sets
the order of its all-reduce's sum. A settling pass before the first training forward (the same
forward, a backward of zero) has DDP rebuild them before the first real step, in a fresh run and
a resumed one alike; what it touches is put back (docs/runtime-design.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def settle_before_first_step(
    ddp: DistributedDataParallel, plain_reduction: Callable[[], AbstractContextManager[Any]]
) -> None:
    """Runs a settling pass before the first forward that has gradients enabled.

    Args:
        ddp: the model, just wrapped.
        plain_reduction: a context manager factory under which the model's communication hook
            (if any) reduces plainly and keeps its state.
    """

    def settle(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation before training: wait for the first training forward
        handle.remove()
        parameters = [p for p in ddp.parameters() if p.requires_grad]
        gradients = [p.grad for p in parameters]
        buffers = [b.detach().clone() for b in ddp.buffers()]
        syncs = ddp.require_backward_grad_sync
        devices = sorted({p.device.index for p in parameters if p.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices), plain_reduction():
                ddp.require_backward_grad_sync = True  # also under no_sync(): the rebuild needs the reduction
                outputs = [t for t in _tensors(ddp(*args, **kwargs)) if t.requires_grad]
                if outputs:
                    (sum(t.sum() for t in outputs) * 0).backward()
                else:
                    print("phalanx: the model's first forward returned no tensor that needs gradients, so DDP's "
                          "gradient buckets could not be settled before the first step: a resumed run may differ "
                          "from an uninterrupted one in the last bits", file=sys.stderr)  # fmt: skip
        finally:
            ddp.require_backward_grad_sync = syncs
            for parameter, gradient in zip(parameters, gradients):
                parameter.grad = gradient
            with torch.no_grad():
                for buffer, saved in zip(ddp.buffers(), buffers):
                    buffer.copy_(saved)

    handle = ddp.register_forward_pre_hook(settle, with_kwargs=True)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
