"""Preemption: a signal only sets a flag; all ranks agree at the next step boundary.

A handler that saved a checkpoint itself would run at an arbitrary point of the step, on one
rank. Here SIGTERM (what torchrun's agent, Kubernetes and most schedulers send) or SIGUSR1
(what SLURM sends with --signal) just records the request; :meth:`PreemptionGuard.should_stop`
all-reduces it at a step boundary, so every rank stops after the same step, saves one
consistent checkpoint together, and exits with :data:`~phalanx.exit_codes.ExitCode.PREEMPTED`.

The all-reduce started at one step boundary is read at the next: it travels while the next step
computes, so a blocking round trip is not added to every step (on small steps it was most of
the loop's overhead). The ranks stop one step later than they could, all after the same step.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    def __init__(self, context: DistributedContext, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.context = context
        self.received: signal.Signals | None = None
        self._in_flight: tuple[Any, torch.Tensor] | None = None  # the vote started at the last boundary
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """True on every rank, after the same step, once any rank got a preemption signal.

        Call it once at every step boundary on every rank: each call is a collective (the result
        of the previous boundary's vote, and a new vote).
        """
        mine = 1.0 if self.received is not None else 0.0
        if not (self.context.is_distributed and dist.is_initialized()):
            return bool(mine)
        stop = False
        if self._in_flight is not None:
            work, vote = self._in_flight
            work.wait()
            stop = bool(vote.item())
            self._in_flight = None
        if not stop:  # no vote is left in flight once the ranks stop
            vote = torch.full((1,), mine, device=self.context.device)
            self._in_flight = (dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True), vote)
        return stop
