"""Gradient compression as one DDP communication hook, and ``auto``: measure, then keep the fastest.

:class:`GradientCompression` hands every gradient bucket to the current candidate (torch's
all-reduce, fp16, bf16 or PowerSGD hook). With ``auto`` the run's first steps time the
candidates, and every rank takes the same choice from the slowest rank's medians. Checkpoint
:meth:`GradientCompression.state_dict` and :meth:`~GradientCompression.rank_state_dict` (``phalanx.Run``
does): a resume keeps the choice, or the trial so far; resume without them to measure again.
DDP's ``join()`` is not supported. docs/runtime-design.md describes the trial.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from phalanx.errors import SettingsRefused
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.powersgd_state import PowerSGD
from phalanx.worker_env import WorkerEnv

STATE_FORMAT = 1


@dataclass(frozen=True)
class AutoTrial:
    """How ``auto`` measures: a screen of one round, then up to ``phases`` phases of ``rounds``
    turns; a turn is ``steps_per_round`` timed steps of a candidate. After each phase the
    candidates too much slower than the fastest are out (``screen``, then ``close``)."""

    rounds: int = 3
    steps_per_round: int = 2
    #: At most this many phases after the screen; fewer when a single candidate is left.
    phases: int = 4
    #: A candidate this much slower than the fastest (0.25 = 25%) after the first full phase is not
    #: measured again; after the k-th, close / sqrt(k).
    close: float = 0.25
    #: After the screen's single round, a candidate this much slower (1.0 = twice the time) is out.
    #: None: no screen, the first phase is a full one.
    screen: float | None = 1.0
    #: A lossier candidate is taken only when it is at least this much faster (0.05 = 5%).
    min_gain: float = 0.05

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.steps_per_round < 1 or self.phases < 1:
            raise SettingsRefused(
                f"auto compression trial of {self.phases} phase(s) x {self.rounds} round(s) x "
                f"{self.steps_per_round} step(s)",
                "each candidate needs at least one timed step to be compared",
                "use phases >= 1, rounds >= 1 and steps_per_round >= 1 (default 4 x 3 x 2)",
            )
        for name, bar, example in (("close", self.close, "0.25"), ("screen", self.screen, "1.0")):
            if bar is not None and bar <= 0:
                raise SettingsRefused(f"auto compression {name} {bar}", "it is a fraction of a step time",
                                      f"use a value above 0, e.g. {example}")  # fmt: skip
        if not 0 <= self.min_gain < 1:
            raise SettingsRefused(f"auto compression min_gain {self.min_gain}", "it is a fraction of a step time",
                                  "use a value in [0, 1), e.g. 0.05")  # fmt: skip

    @property
    def most_phases(self) -> int:
        """The phases of the longest trial, the screen included."""
        return self.phases + (self.screen is not None)

    def schedule(self, candidates: Sequence[Any]) -> tuple[tuple[str, bool], ...]:
        """(candidate name, timed?) for every step of the first phase, warm-up included, in order."""
        warmup = tuple((c.name, False) for c in candidates for _ in range(c.warmup_steps))
        return warmup + self.phase([c.name for c in candidates], 0)

    def phase(self, names: Sequence[str], number: int) -> tuple[tuple[str, bool], ...]:
        """(candidate name, timed?) for the steps of phase ``number`` (0: the first) among ``names``."""
        rounds = 1 if number == 0 and self.screen is not None else self.rounds
        steps: list[tuple[str, bool]] = []
        for turn in range(rounds):
            for name in [*names[turn % len(names) :], *names[: turn % len(names)]]:
                steps += [(name, True)] * self.steps_per_round
        return tuple(steps)

    def still_in(self, timings_ms: dict[str, float], number: int) -> list[str]:
        """The candidates close enough to the fastest after phase ``number``, in their order."""
        if number == 0 and self.screen is not None:
            bar = self.screen
        else:
            full_phases = number + (self.screen is None)  # those done, this one included
            bar = self.close / math.sqrt(full_phases)
        fastest = min(timings_ms.values())
        return [name for name, ms in timings_ms.items() if ms <= fastest * (1 + bar)]


class HookCandidate:
    """A stateless torch hook (all-reduce, fp16, bf16) on the default process group."""

    warmup_steps = 1

    def __init__(self, name: str, hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]]) -> None:
        self.name = name
        self._hook = hook

    def __call__(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        return self._hook(None, bucket)

    def shared_state(self) -> dict[str, Any]:
        """Nothing: a stateless hook has no state to checkpoint."""
        return {}

    def rank_state(self) -> dict[str, Any]:
        """Nothing: a stateless hook has no state of its own per rank."""
        return {}

    def load(self, shared: dict[str, Any], rank_state: dict[str, Any] | None, device: torch.device) -> None:
        """Nothing to restore."""

    def release(self) -> None:
        """Nothing to free."""


def make_candidate(name: str, names: dict[int, str], powersgd_rank: int) -> HookCandidate | PowerSGD:
    """The candidate that runs compression ``name``: PowerSGD, or one of torch's stateless hooks."""
    if name == "powersgd":
        return PowerSGD(names, powersgd_rank)
    hooks = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}  # fmt: skip
    return HookCandidate(name, hooks[name])


def _dispatch(compression, bucket):  # no annotations: DDP refuses a hook whose annotations are strings
    return compression.communicate(bucket)


class GradientCompression:
    """What gradient compression a DDP model uses and why; :func:`phalanx.runtime.model.compression_of`.

    ``mode`` is what was asked (``auto``, ``fp16``, ...); ``chosen`` what runs (None while the
    trial of ``auto`` runs); ``timings_ms`` the trial's ms/step per candidate (the slowest rank's
    median).
    """

    def __init__(
        self, mode: str, context: DistributedContext, candidates: Sequence[HookCandidate | PowerSGD],
        trial: AutoTrial | None = None,
    ) -> None:  # fmt: skip
        self.mode = mode
        self.context = context
        self.candidates = {c.name: c for c in candidates}
        self.trial = trial if mode == "auto" and len(candidates) > 1 else None
        self.chosen: str | None = None if self.trial else (candidates[0].name if candidates else "none")
        self.timings_ms: dict[str, float] | None = None
        self.from_checkpoint = False
        self.steps = 0  # steps whose gradients went through the hook (optimizer steps, accumulation aside)
        self.last_used: str | None = None  # the candidate of the latest step
        self._schedule = self.trial.schedule(candidates) if self.trial else ()  # grows by a phase at a time
        self._phases = [list(self.candidates)]  # the candidates each phase so far measures
        self._samples: dict[str, list[float]] = {name: [] for name in self.candidates}
        self._first_bucket = True
        self._fresh = True  # the first step of a process is never timed: it pays for being first
        self._step_started: float | None = None
        self._timed_step: str | None = None  # the candidate whose step is being timed
        self._pending: tuple[Any, torch.Tensor] | None = None  # the decision's all-reduce in flight
        self._plain = False  # see plain_reduction()

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Installs this object as ``ddp``'s communication hook (none when nothing is compressed)."""
        if self.candidates:
            ddp.register_comm_hook(self, _dispatch)

    @contextlib.contextmanager
    def plain_reduction(self) -> Iterator[None]:
        """Within, buckets go through a plain all-reduce and count for nothing: no step, no
        timing, no candidate's state (phalanx.runtime.bucket_layout's settling pass)."""
        self._plain = True
        try:
            yield
        finally:
            self._plain = False

    # -- inside DDP's backward --------------------------------------------------------------

    def communicate(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The hook DDP calls per gradient bucket: reduces it with this step's candidate."""
        if self._plain:
            return default_hooks.allreduce_hook(None, bucket)
        if self._first_bucket:
            self._first_bucket = False
            self.last_used = self._begin_step(bucket.buffer().device)
        future = self.candidates[self.last_used](bucket)
        if self.last_used == "powersgd" and self.context.backend == "gloo":
            # torch's PowerSGD hook issues its later all-reduces from gloo's callback threads: with
            # two buckets in flight the ranks could issue them in different orders.
            future.wait()
        if bucket.is_last():
            self._first_bucket = True
            self.steps += 1
        return future

    def _begin_step(self, device: torch.device) -> str:
        """The candidate for this step: the same on every rank, from the step count alone."""
        if self.chosen is not None:
            return self.chosen
        self._take_time(device)
        self._finish_decision()  # started a step ago: the choice, or one more phase in the schedule
        if self.chosen is not None:
            return self.chosen
        if self.steps < len(self._schedule):
            name, timed = self._schedule[self.steps]
            self._timed_step = name if timed and not self._fresh else None
            self._fresh = False
            return name
        self._timed_step = None
        self._start_decision(device)
        again = self._schedule[-1][0]  # while the decision travels (plain all-reduce: the slowest on a slow link)
        self._schedule += ((again, False),)
        return again

    def _take_time(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the host runs ahead of the GPU: time what the GPU did
        now = time.perf_counter()
        if self._timed_step is not None and self._step_started is not None:
            self._samples[self._timed_step].append(now - self._step_started)
        self._step_started = now

    def _start_decision(self, device: torch.device) -> None:
        medians = [statistics.median(s) * 1000 if s else math.inf for s in self._samples.values()]
        slowest = torch.tensor(medians, dtype=torch.float64, device=device)
        work = dist.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (work, slowest)

    def _finish_decision(self) -> None:
        if self._pending is None:
            return
        work, slowest = self._pending
        work.wait()  # every rank started it a step ago: this returns at once
        self._pending = None
        timings = dict(zip(self.candidates, slowest.cpu().tolist()))
        assert self.trial is not None  # only auto's trial decides
        number = len(self._phases) - 1
        still_in = self.trial.still_in({name: timings[name] for name in self._phases[-1]}, number)
        if len(still_in) > 1 and len(self._phases) < self.trial.most_phases:
            self._phases.append(still_in)
            self._schedule += self.trial.phase(still_in, number + 1)
            return
        self.timings_ms = timings
        # Over the whole last phase: with close below min_gain, still_in alone would skip the rule.
        self.chosen = choose({name: timings[name] for name in self._phases[-1]}, self.trial.min_gain)
        for name, candidate in self.candidates.items():
            if name != self.chosen:
                candidate.release()  # never runs again: its memories would only fill RAM and checkpoints
        self._announce(self.decision_line())

    # -- what users read --------------------------------------------------------------------

    def decision_line(self) -> str:
        """One line: the choice, why when it is not the fastest, and the ms/step of every candidate."""
        if self.timings_ms is None:
            return f"phalanx: compression {self.mode}: {self.chosen or 'still measuring'}"
        measured = ", ".join(self._measured(name, ms) for name, ms in self.timings_ms.items())
        counts = [str(len(samples)) for samples in self._samples.values()]
        if len(set(counts)) > 1:  # fewer: out after an earlier phase, or steps lost to a restart
            timed = f"medians of {', '.join(counts[:-1])} and {counts[-1]} trial steps"
        else:
            timed = f"median of {counts[0]} trial steps each"
        fastest = min(self._phases[-1], key=self.timings_ms.__getitem__)  # those out earlier: older medians
        notes = []
        if fastest != self.chosen:
            gain = 1 - self.timings_ms[fastest] / self.timings_ms[self.chosen]  # type: ignore[index]
            notes.append(f"{fastest} is only {gain:.1%} faster, not worth lossier gradients")
        if self.from_checkpoint:
            notes.append("kept from the checkpoint")
        note = f" ({'; '.join(notes)})" if notes else ""
        return f"phalanx: compression auto chose {self.chosen}{note}: {measured} ms/step ({timed}, slowest rank)"

    def _measured(self, name: str, ms: float) -> str:
        if not math.isfinite(ms):
            return f"{name} (not measured)"
        phases = [number for number, names in enumerate(self._phases, 1) if name in names]
        if phases[-1] < len(self._phases):  # its median is from the phases it was in
            return f"{name} {ms:.1f} (out after phase {phases[-1]})"
        return f"{name} {ms:.1f}"

    def _announce(self, line: str) -> None:
        """Rank 0 prints the decision. Under phalanx run every other rank writes it too: its output
        goes to its own log file (the console shows rank 0), so each rank's log records its choice."""
        if self.context.is_main or WorkerEnv.from_env(os.environ).node is not None:
            print(line, file=sys.stdout, flush=True)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: mode, chosen (None while measuring), ms_per_step (None until decided),
        timed_steps per candidate, trial_steps (the steps before the choice runs), phases (the
        candidates each phase of the trial measured), from_checkpoint.

        A decision still in flight is left to the next step: called on one rank only (rank 0's
        final metrics), finishing it there could report a choice or a phase that never ran."""
        return {
            "mode": self.mode, "chosen": self.chosen, "ms_per_step": self.timings_ms,
            "timed_steps": {name: len(samples) for name, samples in self._samples.items()} if self.trial else {},
            "trial_steps": self._trial_steps(), "phases": self._phases if self.trial else [],
            "from_checkpoint": self.from_checkpoint,
        }  # fmt: skip

    def _trial_steps(self) -> int:
        """The steps before the choice runs (so far, while the trial runs)."""
        if not self.trial:
            return 0
        return len(self._schedule) + (0 if self.chosen is not None or self._pending is not None else 1)

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The choice, the trial so far and the candidates' shared memories: the same on every
        rank. PowerSGD's error feedback differs per rank: :meth:`rank_state_dict`."""
        self._finish_decision()
        return {
            "format": STATE_FORMAT, "mode": self.mode, "candidates": list(self.candidates), "steps": self.steps,
            "chosen": self.chosen, "timings_ms": self.timings_ms, "samples_s": self._samples,
            "schedule": [list(step) for step in self._schedule], "phases": self._phases,
            "shared": {name: c.shared_state() for name, c in self.candidates.items()},
        }  # fmt: skip

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own memories (PowerSGD's error feedback), checkpointed per rank."""
        self._finish_decision()
        return {name: c.rank_state() for name, c in self.candidates.items()}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Continues where ``state`` stopped: the same choice, or the trial at the same step.

        A state from another mode is ignored (said on rank 0). Without ``rank_state`` (a
        checkpoint of another world size) the choice is kept but PowerSGD's error feedback
        starts from zero.
        """
        if state.get("mode") != self.mode or state.get("candidates") != list(self.candidates):
            self._announce_main(f"phalanx: the checkpoint's gradient compression is {state.get('mode')!r} with "
                                f"{state.get('candidates')}; this run uses {self.mode!r} with {list(self.candidates)}, "
                                "so it starts afresh (not an exact continuation)")  # fmt: skip
            return
        for name, candidate in self.candidates.items():
            candidate.load(
                state["shared"][name], rank_state[name] if rank_state is not None else None, self.context.device
            )
        if rank_state is None and "powersgd" in self.candidates:
            self._announce_main("phalanx: the checkpoint was written by another number of processes: PowerSGD's error "
                                "feedback restarts from zero")  # fmt: skip
        self.steps = state["steps"]
        self._samples = {name: list(values) for name, values in state["samples_s"].items()}
        self.chosen, self.timings_ms = state["chosen"], state["timings_ms"]
        self._schedule = tuple((name, timed) for name, timed in state["schedule"])
        self._phases = [list(names) for names in state["phases"]]
        self._step_started, self._timed_step, self._pending, self._fresh = None, None, None, True
        if self.trial and self.chosen is not None:
            self.from_checkpoint = True
            self._announce(self.decision_line())

    def _announce_main(self, line: str) -> None:
        if self.context.is_main:
            print(line, file=sys.stderr, flush=True)


def choose(timings_ms: dict[str, float], min_gain: float) -> str:
    """The fastest candidate, walking from the least lossy; a lossier one must gain ``min_gain``."""
    names = list(timings_ms)
    best = names[0]
    for name in names[1:]:
        if timings_ms[name] < timings_ms[best] * (1 - min_gain):
            best = name
    return best
