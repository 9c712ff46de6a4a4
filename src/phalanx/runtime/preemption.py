"""Preemption: a signal only sets a flag; all ranks agree at the next step boundary.

A handler that saved a checkpoint itself would run at an arbitrary point of the step, on one
rank. Here SIGTERM (what torchrun's agent, Kubernetes and most schedulers send) or SIGUSR1
(what SLURM sends with --signal) just records the request; :meth:`PreemptionGuard.should_stop`
all-reduces it at a step boundary, so every rank stops after the same step, saves one
consistent checkpoint together, and exits with :data:`~phalanx.exit_codes.ExitCode.PREEMPTED`.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    def __init__(self, context: DistributedContext, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.context = context
        self.received: signal.Signals | None = None
        self._flag = torch.zeros(1, device=context.device)
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """True on every rank once any rank got a preemption signal; a tiny collective."""
        self._flag.fill_(1.0 if self.received is not None else 0.0)
        if self.context.is_distributed and dist.is_initialized():
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())
