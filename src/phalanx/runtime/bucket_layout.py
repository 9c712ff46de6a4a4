"""DDP's gradient buckets settled before the first step, so that a resumed run sums exactly as an
uninterrupted one did.

DDP reduces a process's first iteration with every gradient in one bucket, in parameter order,
and then rebuilds its buckets in the order the gradients became ready. An all-reduce of more than
two ranks sums an element in an order that depends on where it sits in its bucket (gloo and NCCL
reduce a bucket in chunks, each chunk starting at another rank), and float sums depend on their
order. So the first step after a resume, reduced with the first-iteration layout, differed in
the last bits from the same step of the run that was never stopped (seen with 4 ranks; two ranks
sum a + b, which has one order only).

Here every process's first training forward is preceded by a settling pass: the same forward, a
backward of zero, so that DDP learns the gradients' order and rebuilds its buckets before the
first real step, in a fresh run and a resumed one alike. What the pass touches is put back: the
random number generators, the module's buffers (batch-norm statistics) and the gradients; and
gradient compression sends the zeros as a plain all-reduce, leaving its state alone. (State a
module keeps in plain attributes during its forward is not: such a module sees one forward more.)
A first forward whose output holds no tensor that needs gradients cannot settle anything; that
is said once, on stderr.
A communication hook registered on the model by its user sees the settling pass's buckets too (a
counting hook counts one reduction more). DDP offers no setting for its bucket order; this relies
on its documented behaviour of rebuilding the buckets once, after the first backward (checked
against torch 2.13).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def settle_before_first_step(ddp: DistributedDataParallel, plain_reduction: Any = None) -> None:
    """Runs a settling pass before the first forward that has gradients enabled.

    Args:
        ddp: the model, just wrapped.
        plain_reduction: a context manager factory under which the model's communication hook
            (if any) reduces plainly and keeps its state; None when the model has no hook.
    """
    settle = _Settle(ddp, plain_reduction)
    settle.handle = ddp.register_forward_pre_hook(settle, with_kwargs=True)


class _Settle:
    def __init__(self, ddp: DistributedDataParallel, plain_reduction: Any) -> None:
        self.ddp = ddp
        self.plain_reduction = plain_reduction or contextlib.nullcontext
        self.handle: Any = None

    def __call__(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation before training: wait for the first training forward
        self.handle.remove()
        ddp = self.ddp
        parameters = [p for p in ddp.parameters() if p.requires_grad]
        gradients = [p.grad for p in parameters]
        buffers = [b.detach().clone() for b in ddp.buffers()]
        syncs = ddp.require_backward_grad_sync
        devices = sorted({p.device.index for p in parameters if p.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices), self.plain_reduction():
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
