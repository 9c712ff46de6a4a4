"""Preemption: a signal only sets a flag; all ranks agree at a step boundary to stop together.

SIGTERM, SIGUSR1 (SLURM's --signal) or SIGINT records the request; :meth:`PreemptionGuard.should_stop`
all-reduces it at step boundaries, about every ``period_s``, so every rank stops after the same
step, saves one checkpoint together, and exits with :data:`~phalanx.exit_codes.ExitCode.PREEMPTED`.
docs/runtime-design.md describes the vote's schedule.
"""

from __future__ import annotations

import math
import os
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext
from phalanx.runtime.shared_reduction import ReducedPart, SharedReduction
from phalanx.worker_env import WorkerEnv

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


#: Votes start about this often, in seconds (when steps are longer: at every step boundary).
VOTE_PERIOD_S = 2.0
#: At most this many steps between votes, whatever the step time.
MAX_STEPS_BETWEEN_VOTES = 10_000


class PreemptionGuard:
    """Stops every rank after the same step once any rank got a preemption signal.

    It handles ``signals`` (SIGTERM, SIGUSR1, SIGINT) in this process; :meth:`should_stop`
    holds the vote, started about every ``period_s`` seconds. A second SIGINT raises
    KeyboardInterrupt, as Python's own handler does: a second Ctrl-C stops at once.
    """

    def __init__(
        self, context: DistributedContext, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS,
        period_s: float = VOTE_PERIOD_S,
    ) -> None:  # fmt: skip
        self.context = context
        self.period_s = period_s
        self.received: signal.Signals | None = None
        self.votes = 0  # votes started so far
        self.own_votes = 0  # of them, those in a collective of their own (alone in the all-reduce)
        self.start_votes_over()
        self._voting = context.is_distributed and dist.is_initialized()  # else one process: its own flag decides
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in signals}
        early = os.environ.pop(WorkerEnv.key_of("early_signal"), None)  # came while the worker was starting
        if early in {sig.name for sig in signals}:
            self.received = signal.Signals[early]

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C (after another signal, one rank alone would leave the vote)
        self.received = signal.Signals(signum)

    def release_interrupt(self) -> None:
        """Gives SIGINT back to the handler it had before (once the training loop is over, a
        Ctrl-C interrupts the script's own code at once, as it would without the guard)."""
        previous = self._previous.pop(signal.SIGINT, None)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def start_votes_over(self) -> None:
        """The votes' schedule from its start: a new guard's, or after a heal formed the group
        again (as a replacement rank's new guard; a vote in flight in the old group is dropped)."""
        self._boundary = 0
        self._next_vote = 1  # the boundary of the next vote, the same on every rank
        self._voted_at, self._voted_time = 0, time.perf_counter()
        self._in_flight: ReducedPart | None = None  # the vote started at boundary _voted_at

    def should_stop(self, shared: SharedReduction | None = None) -> bool:
        """True on every rank, after the same step, once any rank got a preemption signal.

        Call it once at every step boundary on every rank: it is a collective at some of them
        (the same ones on every rank), and costs nothing at the others. With ``shared``, call it
        after everything else of the boundary was added, and start ``shared`` after it: a vote
        goes into it, and one rides along whenever it holds something already.
        """
        if not self._voting:
            return self.received is not None
        self._boundary += 1
        if self._in_flight is not None:  # started at the previous boundary: read it now
            stop, proposals = self._in_flight.wait().tolist()
            self._in_flight = None
            if stop:
                return True  # no vote is left in flight once the ranks stop
            self._next_vote = self._voted_at + math.ceil(proposals / self.context.world_size)
        if self._boundary >= self._next_vote or (shared is not None and shared.pending):
            self._start_vote(shared)
        return False

    def _start_vote(self, shared: SharedReduction | None) -> None:
        now = time.perf_counter()
        step_time = (now - self._voted_time) / (self._boundary - self._voted_at)
        proposal = min(MAX_STEPS_BETWEEN_VOTES, max(1, math.ceil(self.period_s / step_time))) if step_time > 0 else 1
        reduction = shared if shared is not None else SharedReduction(self.context)
        if not reduction.pending:
            self.own_votes += 1
        vote = torch.tensor([1.0 if self.received is not None else 0.0, float(proposal)], dtype=torch.float64)
        self._in_flight = reduction.add(vote)
        if shared is None:
            reduction.start()
        self._voted_at, self._voted_time = self._boundary, now
        self.votes += 1
