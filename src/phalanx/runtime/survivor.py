"""What a rank does when its loop fails: it keeps the state after the last completed step.

When a peer dies, the survivors still hold the parameters and optimizer state after the last step
every rank completed. A hook on ``sys.excepthook`` (or, for a peer that went silent, the
launcher's request on a FIFO) writes that state for the restart
(:meth:`CheckpointManager.save_last_step`), with the data position and buffers of a mark made as
each step ends, and a random state seeded from the step (docs/runtime-design.md).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.checkpoint import CheckpointManager, folder
from phalanx.runtime.checkpoint.rng import seed_step
from phalanx.runtime.context import DistributedContext
from phalanx.worker_env import keep_report_of

#: Gradient compressions that keep no state between steps: a survivor's copy holds all of theirs.
STATELESS_COMPRESSIONS = ("none", "fp16", "bf16")


@dataclass
class StepMark:
    """What the end of a step fixed: its number, the data position, the model's buffers and
    whose they are (rank 0's, which DDP keeps, or this rank's own until the next forward)."""

    step: int
    data: dict[str, Any] | None
    buffers: dict[str, torch.Tensor]
    buffers_rank: int
    #: In heal mode, the states of the tracked objects besides the model, optimizers and data
    #: (an LR scheduler...), copied: a failed step that went on to step them is rolled back.
    others: dict[str, Any] | None = None


class StepKeeper:
    """Keeps the state after the last completed step when the training loop fails.

    Args:
        checkpoints: where the state goes.
        context: the job.
        state: builds the state to keep from a mark (what a checkpoint of that step holds).
        seeding: the per-step random state (:class:`StepSeeding`).
        launch: this launch's token, the same on every rank (:func:`agreed_start`).
    """

    def __init__(self, checkpoints: CheckpointManager, context: DistributedContext,
                 state: Callable[[StepMark], dict[str, Any]], seeding: StepSeeding, launch: int) -> None:  # fmt: skip
        self.checkpoints, self.context, self.seeding, self.launch = checkpoints, context, seeding, launch
        self._state = state
        self._mark: StepMark | None = None
        self._module: torch.nn.Module | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._optimizer_moved = self._through_ddp = False
        self._hooks: list[Any] = []
        self._previous_hook: Callable[..., Any] | None = None
        # Taken by the mark, the optimizer's step, the buffers' copy and the keep: a keep from the
        # request thread sees a whole mark and parameters no optimizer is changing.
        self._lock = threading.Lock()
        self._request: str | None = None  # the FIFO listened on, and its descriptor (-1: closed)
        self._request_fd = -1
        self._fd_lock = threading.Lock()  # a descriptor closed by the thread is never written to

    def watch(self, module: torch.nn.Module | None, wrapper: torch.nn.Module | None,
              optimizers: list[torch.optim.Optimizer]) -> None:  # fmt: skip
        """Starts watching: the buffers to copy at each mark, the optimizers' steps, the hook.

        Args:
            module: the model (unwrapped), whose buffers are copied.
            wrapper: DDP's wrapper of it when there is one: only a forward through it starts
                with rank 0's buffers (one on ``module`` alone, an evaluation, does not).
            optimizers: the tracked optimizers, whose step after a mark makes the mark stale.
        """
        self._hooks = [optimizer.register_step_pre_hook(self._on_optimizer_step) for optimizer in optimizers]
        self._module = module
        if module is not None and wrapper is not None and getattr(wrapper, "broadcast_buffers", False):
            self._hooks.append(wrapper.register_forward_pre_hook(self._on_ddp_forward))
            self._hooks.append(module.register_forward_pre_hook(self._on_forward))
        self._previous_hook, sys.excepthook = sys.excepthook, self._on_uncaught

    def mark(self, step: int, data: dict[str, Any] | None, others: dict[str, Any] | None = None) -> None:
        """Step ``step`` is complete: its data position and buffers are what a failure keeps
        (and ``others``, copies of other objects' states, in heal mode)."""
        with self._lock:
            self._copy_buffers()
            self._mark = StepMark(step, data, self._buffers, self.context.rank, others)
            self._optimizer_moved = self._through_ddp = False

    @property
    def optimizer_stepped(self) -> bool:
        """Whether an optimizer stepped since the last mark (the step in progress is past it)."""
        return self._optimizer_moved

    def restore_buffers(self, mark: StepMark) -> None:
        """Puts the module's buffers back to those of ``mark`` (heal mode, after a failed step)."""
        if self._module is None:
            return
        with torch.no_grad():
            for name, live in self._module.named_buffers():
                if name in mark.buffers:
                    live.copy_(mark.buffers[name])

    @property
    def last_mark(self) -> StepMark | None:
        """The mark of the last completed step (None once released or kept)."""
        return self._mark

    def listen(self, request: str | None) -> None:
        """Keeps the state when the launcher asks on ``request``; the launcher stops the process.

        Args:
            request: the FIFO to make and listen on (``WorkerEnv.keep_request``); None: no
                launcher asks (a plain torchrun), nothing is started.
        """
        if request is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(request)  # an earlier keeper's, in this process or a killed one
            os.mkfifo(request)
            # Opened for reading and writing: it has a reader from now on (the launcher's
            # non-blocking open finds one), and a writer, so that a read waits for words.
            fd = os.open(request, os.O_RDWR)
        except OSError as error:  # said: a node lost without a word would cost the steps since the checkpoint
            print(f"phalanx: cannot listen for the launcher's keep request at {request} ({error.strerror}): a node "
                  "that goes silent costs the steps since the last checkpoint", file=sys.stderr, flush=True)  # fmt: skip
            return
        self._request, self._request_fd = request, fd
        atexit.register(self._remove_request)  # the process ends with an error: no FIFO left in the log folder
        threading.Thread(target=self._wait_for_request, args=(fd,), name="phalanx-keep-request", daemon=True).start()

    def release(self) -> None:
        """Stops watching (the loop ended): a later exception keeps nothing."""
        with self._lock:
            self._mark = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if sys.excepthook == self._on_uncaught and self._previous_hook is not None:
            sys.excepthook = self._previous_hook
        if self._request is not None:
            with self._fd_lock, contextlib.suppress(OSError):
                if self._request_fd >= 0:
                    os.write(self._request_fd, b"\n")  # no words: the thread ends (and closes it)
            self._remove_request()
            atexit.unregister(self._remove_request)

    def keep_if_failing(self) -> None:
        """Keeps the state now when an exception is on its way out (``run.close()`` in a
        ``finally``, which would release the keeper before ``sys.excepthook`` runs)."""
        error = sys.exc_info()[1]
        if isinstance(error, Exception):
            self._keep_and_say(described(error))

    def keep(self, why: str) -> str:
        """Writes the state after the marked step; returns the line that says where it is.

        Args:
            why: what ended the training (an exception, described; a request's words).
        """
        mark = self._mark
        assert mark is not None
        if self._optimizer_moved:
            return (f"the training failed in step {mark.step + 1} after its optimizer step began, before run.step() "
                    f"({why}): this rank's state is past step {mark.step}, so it keeps none; "
                    f"{self._fallback(mark.step)}")  # fmt: skip
        print(f"phalanx: the training failed after step {mark.step} ({why}); keeping the state after "
              f"step {mark.step} for a restart", file=sys.stderr, flush=True)  # fmt: skip
        try:
            preferred = bool(mark.buffers) and mark.buffers_rank == 0  # other copies' buffers differ
            path, kept = self.checkpoints.save_last_step(mark.step, self.launch, self._state(mark), preferred)
        except Exception as unwritten:  # said, and the error that ended the script is shown as ever
            why = unwritten.strerror if isinstance(unwritten, OSError) and unwritten.strerror else described(unwritten)
            return f"the state after step {mark.step} could not be kept ({why}): {self._fallback(mark.step)}"
        who = "this rank kept" if kept else "another rank had kept"
        return f"{who} the state after step {mark.step} in {path}: a restart resumes there"

    def _keep_and_say(self, why: str) -> None:
        """Keeps the state once (not when kept already, or released), says so, and writes the report."""
        with self._lock:
            if self._mark is None:
                return
            step = self._mark.step
            try:
                line = self.keep(why)
            except Exception as error:  # a folder that cannot be read: said all the same
                line = f"the state after step {step} could not be kept ({described(error)})"
            finally:
                self._mark = None  # once
            print(f"phalanx: {line}", file=sys.stderr, flush=True)
            if self._request is not None:  # for the launcher: this rank is done, and what it kept
                report = keep_report_of(self._request)
                with contextlib.suppress(OSError):
                    report.with_suffix(".tmp").write_text(line + "\n")
                    report.with_suffix(".tmp").replace(report)

    def _wait_for_request(self, fd: int) -> None:
        """The request thread: waits for the launcher's words and keeps the state. The process
        is then left to the launcher, which stops its ranks once each has reported."""
        try:
            why = os.read(fd, 4096).decode(errors="replace").strip()  # one write, under PIPE_BUF: whole
        except OSError:
            return
        finally:
            with self._fd_lock:
                self._request_fd = -1
                os.close(fd)
        if why:  # (none: released)
            if self.context.device.type == "cuda":  # a thread starts on GPU 0: the copies to host come from this rank's
                with contextlib.suppress(RuntimeError):
                    torch.cuda.set_device(self.context.device)
            self._keep_and_say(why)
            sys.stdout.flush()

    def _remove_request(self) -> None:
        request, self._request = self._request, None
        if request is not None:
            with contextlib.suppress(OSError):
                os.unlink(request)

    def _fallback(self, step: int) -> str:
        """Where a restart resumes without this rank's state after ``step``: another rank's, or
        the newest checkpoint (the steps after it are trained again)."""
        newest = folder.committed(self.checkpoints.directory)
        since = newest[0][0] if newest else 0
        where = f"the checkpoint of step {since}" if newest else "the start"
        again = "no step" if since >= step else f"step {step}" if since + 1 == step else f"steps {since + 1}-{step}"
        return f"unless another rank kept it, a restart resumes from {where} and trains {again} again"

    def _copy_buffers(self) -> None:
        """The module's buffers now, looked up by name (a module may replace a buffer)."""
        if self._module is None:
            return
        for name, live in self._module.named_buffers():
            copy = self._buffers.get(name)
            if copy is None or copy.shape != live.shape or copy.dtype != live.dtype or copy.device != live.device:
                self._buffers[name] = live.detach().clone()
            else:
                copy.copy_(live)

    def _on_optimizer_step(self, *_: Any) -> None:
        with self._lock:  # waits for a keep in progress: the parameters stay those it writes
            self._optimizer_moved = True

    def _on_ddp_forward(self, *_: Any) -> None:
        self._through_ddp = True

    def took_rank_0s_buffers(self) -> None:
        """The module's buffers are rank 0's now (a checkpoint broadcast them): the mark takes them."""
        with self._lock:
            if self._mark is not None and self._mark.buffers_rank != 0:
                self._copy_buffers()
                self._mark.buffers_rank = 0

    def _on_forward(self, *_: Any) -> None:
        """A forward through DDP starts with rank 0's buffers (it broadcast them): the first after
        a mark copies them, and the mark's buffers are rank 0's from then on. In heal mode,
        phalanx's own broadcast gives them, which a failure of the step skips: a rank keeps its
        own then."""
        healing = self.context.healing
        shared = healing is None or not healing.health.failed
        if self._through_ddp and shared and self._mark is not None and self._mark.buffers_rank != 0:
            self.took_rank_0s_buffers()
        self._through_ddp = False

    def _on_uncaught(self, kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        """``sys.excepthook``: keeps the state, says so, then shows the error as before."""
        try:
            if isinstance(error, Exception):
                self._keep_and_say(described(error))
        finally:
            (self._previous_hook or sys.__excepthook__)(kind, error, trace)


class StepSeeding:
    """The random state of every step, seeded from (seed, rank, step) or, where every rank
    started alike (one ``torch.manual_seed`` everywhere), from (seed, step): the ranks keep
    drawing the same numbers, as the script had them.

    Args:
        seed: the base seed.
        per_rank: whether each rank draws its own numbers.
        rank: this process's rank.
    """

    def __init__(self, seed: int, per_rank: bool, rank: int) -> None:
        self.seed, self.per_rank, self.rank = seed, per_rank, rank

    def after(self, step: int) -> None:
        """Seeds this rank's random state for the step after ``step``."""
        seed_step(self.seed, self.rank if self.per_rank else 0, step)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "per_rank": self.per_rank}


def agreed_start(context: DistributedContext, carried: dict[str, Any] | None) -> tuple[StepSeeding, int]:
    """The per-step seeding and a launch token, the same on every rank; two small collectives.

    Args:
        context: the job.
        carried: the seeding a checkpoint carried (:meth:`StepSeeding.state_dict`); None for a
            fresh start, which takes rank 0's initial torch seed, per rank unless every rank's
            torch random state is the same.
    """
    state = torch.get_rng_state().numpy().tobytes()  # torch's: the generator a step draws from
    fingerprint = int.from_bytes(hashlib.blake2b(state, digest_size=7).digest(), "little")
    seed = torch.initial_seed() & (2**62 - 1) if carried is None else int(carried["seed"])
    agreed = torch.tensor([seed, secrets.randbits(62), fingerprint], dtype=torch.int64, device=context.device)
    alike = torch.tensor([1], dtype=torch.int64, device=context.device)
    if context.is_distributed:
        dist.broadcast(agreed, src=0)
        alike[0] = int(agreed[2].item() == fingerprint)
        dist.all_reduce(alike, op=dist.ReduceOp.MIN)
    seed, launch, _ = agreed.tolist()
    per_rank = bool(carried["per_rank"]) if carried is not None else not bool(alike.item())
    return StepSeeding(int(seed), per_rank, context.rank), int(launch)


def described(error: BaseException) -> str:
    """An error in one line: its type and the first line of its message (for "failed (...)")."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else 'no message'}"
