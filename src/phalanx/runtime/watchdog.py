"""The stall watchdog: when a rank stops making progress, name it, instead of waiting 30 minutes.

A background thread reads torch's flight recorder and posts this rank's progress on the job's
store; when a collective here stays pending longer than ``stall_timeout``, it names the ranks that
never issued it and ends this process (docs/runtime-design.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.settings.values import seconds_problem
from phalanx.worker_env import STALL_REPORT, WorkerEnv, agent_restarts

DEFAULT_STALL_TIMEOUT_S = 300.0
STALL_TIMEOUT_VARIABLE = "PHALANX_STALL_TIMEOUT"
#: The size of torch's flight recorder, read when the process group is created; 0 switches it off.
#: Unset, torch 2.13 keeps 2000 entries; 2.10 records gloo collectives only when it is set.
FLIGHT_RECORDER_VARIABLE = "TORCH_FR_BUFFER_SIZE"
#: The newest collectives it keeps, unless the user set the size: a full read holds the GIL for
#: all of them, and a stall needs only the oldest pending one.
FLIGHT_RECORDER_ENTRIES = "500"
#: At most this long, a watchdog that found a stall waits for every rank's progress report.
ABORT_GRACE_S = 20.0
#: Polls that read only the counts between two that read every entry, at most: a safety net for a
#: stall the counts cannot show (see StallWatchdog._poll).
COUNTS_ONLY_POLLS = 11
#: How torch's flight recorder describes the default process group.
DEFAULT_GROUP_DESC = "default_pg"


@dataclass(frozen=True)
class Progress:
    """One rank's collectives, per process group. Sequence numbers count within a group (torch's
    collective_seq_id), so a report compares a group's numbers only with that group's."""

    rank: int
    node: str
    issued: dict[str, int]  # per process group (torch's name: "0" is the default group): newest collective called
    completed: dict[str, int]  # per group: newest collective that finished here
    last_completed_op: dict[str, str]  # per group: that collective's name ("gloo:all_reduce")
    pending_group: str | None  # the collective pending the longest here: its group,
    pending_group_desc: str | None  # the group's description (torch's "default_pg" for the default group),
    pending_op: str | None  # its name,
    pending_seq: int | None  # its sequence number in its group,
    pending_for_s: float  # and how long it has been pending
    step: int | None


def _dump_flight_recorder(backend: str, *, collectives: bool = True) -> bytes:
    import torch

    c10d = torch._C._distributed_c10d
    # Without stack traces: symbolizing them imports torch._dynamo and torch._inductor in this
    # thread, which races the training thread's own import of them (DDP's constructor) and can
    # kill the rank with a partially-initialized-module ImportError. The report never reads them.
    options = {"includeCollectives": collectives, "includeStackTraces": False}
    if backend == "nccl":  # NCCL's collectives go to a flight recorder of their own, with CUDA events
        return c10d._dump_nccl_trace(**options)
    return c10d._dump_fr_trace(**options)


#: (process group, newest collective issued, newest completed) for every group: collective_counts()
Counts = tuple[tuple[str, int, int], ...]


def collective_counts(backend: str) -> Counts | None:
    """The flight recorder's status alone, far cheaper than its entries; None when this torch's
    dump has no status (or one of another shape)."""
    status = pickle.loads(_dump_flight_recorder(backend, collectives=False)).get("pg_status")
    try:
        counts = tuple(sorted((str(group), int(s["last_enqueued_collective"]), int(s["last_completed_collective"]))
                              for group, s in status.items()))  # fmt: skip
    except (AttributeError, KeyError, TypeError, ValueError):  # another torch's format: read every entry instead
        return None
    return counts or None


def collectives_issued(backend: str) -> int | None:
    """How many collectives this process issued in all its process groups, destroyed ones too
    (the flight recorder keeps its counts); None where the recorder is off (it registers no
    group then: an empty ``pg_config``) or of another format."""
    dump = pickle.loads(_dump_flight_recorder(backend, collectives=False))
    try:
        if not dump["pg_config"]:
            return None
        return sum(max(0, int(group["last_enqueued_collective"])) for group in dump["pg_status"].values())
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def stood_still(previous: Counts | None, now: Counts | None) -> bool:
    """Whether a poll must read every entry: no counts to go by, nothing moved since the previous
    poll (a stall, or no collective in a poll period), or a group with a collective pending
    completed nothing since (a stall in that group while another one works)."""
    if previous is None or now is None:
        return True
    before = {group: (issued, completed) for group, issued, completed in previous}
    if all(before.get(group) == (issued, completed) for group, issued, completed in now):
        return True
    return any(issued > completed and before.get(group, (0, -1))[1] == completed for group, issued, completed in now)


def flight_recorder_progress(rank: int, node: str, step: int | None, backend: str) -> Progress:
    """This rank's progress as torch's flight recorder shows it: per group, the collectives
    issued and completed, and the one pending longest.
    """
    trace = pickle.loads(_dump_flight_recorder(backend))
    # One pass: this runs while training holds the other share of the GIL.
    issued: dict[str, int] = {}
    completed: dict[str, int] = {}
    last_op: dict[str, str] = {}
    pending = None  # the entry pending the longest
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        group, seq = entry["process_group"][0], entry["collective_seq_id"]
        issued[group] = max(issued.get(group, 0), seq)
        if entry.get("retired") or entry.get("state") == "completed":
            if seq > completed.get(group, 0):
                completed[group], last_op[group] = seq, entry["profiling_name"]
        elif pending is None or entry["time_created_ns"] < pending["time_created_ns"]:
            pending = entry
    age = (time.time_ns() - pending["time_created_ns"]) / 1e9 if pending else 0.0
    return Progress(
        rank=rank, node=node, issued=issued, completed=completed, last_completed_op=last_op,
        pending_group=pending["process_group"][0] if pending else None,
        pending_group_desc=pending["process_group"][1] if pending else None,
        pending_op=pending["profiling_name"] if pending else None,
        pending_seq=pending["collective_seq_id"] if pending else None, pending_for_s=age, step=step,
    )  # fmt: skip


def with_earlier(progress: Progress, earlier: Progress | None) -> Progress:
    """``progress``, keeping what an earlier read saw of groups whose entries have left the
    recorder's buffer since (a group used once an epoch, behind 500 of another's): a group's
    sequence numbers only grow."""
    if earlier is None:
        return progress
    issued = {**earlier.issued, **{g: max(seq, earlier.issued.get(g, 0)) for g, seq in progress.issued.items()}}
    completed, last_op = dict(earlier.completed), dict(earlier.last_completed_op)
    for group, seq in progress.completed.items():
        if seq >= completed.get(group, 0):
            completed[group], last_op[group] = seq, progress.last_completed_op[group]
    return replace(progress, issued=issued, completed=completed, last_completed_op=last_op)


def group_members(name: str) -> frozenset[int] | None:
    """The global ranks of this process's group called ``name``; None when torch cannot say."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        for group, group_name in dist.distributed_c10d._world.pg_names.items():  # every group this process made
            if group_name == name:
                return frozenset(dist.get_process_group_ranks(group))
    return None


def watchdog_unavailable(backend: str, backend_timeout_s: float) -> str | None:
    """Why the watchdog could never see a stall in this process, as a notice with a HINT; None when
    it can. Call it after a collective: torch's flight recorder must show it."""
    import torch

    from phalanx.torch_compat import tested_range

    other_torch = (
        f"use a torch whose flight recorder records {backend} collectives (phalanx is tested with {tested_range()})"
    )
    try:
        issued = any(flight_recorder_progress(0, "", None, backend).issued.values())
    except Exception as error:
        problem = f"torch {torch.__version__} cannot show its flight recorder ({type(error).__name__}: {error})"
        hint = other_torch
    else:
        if issued:
            return None
        if os.environ.get(FLIGHT_RECORDER_VARIABLE, "").strip() == "0":
            problem = f"{FLIGHT_RECORDER_VARIABLE}=0 switches off torch's flight recorder, which the watchdog reads"
            hint = f"unset {FLIGHT_RECORDER_VARIABLE} (phalanx sets {FLIGHT_RECORDER_ENTRIES})"
        else:
            problem = f"torch {torch.__version__}'s flight recorder does not record {backend} collectives"
            hint = other_torch
    return (f"phalanx: the stall watchdog is off: {problem}. A rank that stops holds the others until the "
            f"backend's timeout ({backend_timeout_s:g} s), and no report names it.\nHINT: {hint}")  # fmt: skip


def stall_timeout_from_env(value: float | None) -> float:
    """``phalanx.init(stall_timeout=...)``, else PHALANX_STALL_TIMEOUT, else the default; refused
    (SettingsRefused, exit code 2) unless it is a positive number of seconds, at most a week."""
    hint = f"give the seconds a collective may stay pending before the job is aborted, for example {DEFAULT_STALL_TIMEOUT_S:g} (the default)"
    if value is None:
        text = os.environ.get(STALL_TIMEOUT_VARIABLE)
        if not text:
            return DEFAULT_STALL_TIMEOUT_S
        setting = f"{STALL_TIMEOUT_VARIABLE}={text!r}"
        try:
            value = float(text)
        except ValueError:
            raise SettingsRefused(setting, "it is not a number of seconds", hint) from None
    else:
        setting = f"stall_timeout={value!r}"
    problem = seconds_problem(float(value))
    if problem:
        raise SettingsRefused(setting, f"a stall timeout {problem}", hint)
    return float(value)


def stall_report(
    me: Progress, everyone: dict[int, Progress], world_size: int, timeout: float, members: frozenset[int] | None = None,
) -> str:  # fmt: skip
    """The report on ``me``'s pending collective: the ranks of its group (``members``, global
    ranks; None: every rank) that never called it are the stalled ones."""
    assert me.pending_seq is not None and me.pending_group is not None
    group, seq = me.pending_group, me.pending_seq
    expected = sorted(members) if members is not None else range(world_size)
    # Without the members of a group other than the default one, only the ranks that called
    # something in it are judged: another rank may be no member.
    judged = members is not None or me.pending_group_desc == DEFAULT_GROUP_DESC
    stalled = [rank for rank in expected
               if rank in everyone and (judged or group in everyone[rank].issued) and everyone[rank].issued.get(group, 0) < seq]  # fmt: skip
    silent = [rank for rank in expected if rank not in everyone]
    described = f" ({me.pending_group_desc})" if me.pending_group_desc not in (None, "", "undefined") else ""
    in_group = "" if me.pending_group_desc == DEFAULT_GROUP_DESC else f" of process group {group}{described}"
    lines = [
        f"{STALL_REPORT} rank {me.rank} has waited {me.pending_for_s:.0f} s (stall timeout {timeout:g} s) in "
        f"collective #{seq} ({me.pending_op}){in_group}",
    ]
    for rank in stalled:
        p = everyone[rank]
        step = f", step {p.step}" if p.step is not None else ""
        lines.append(
            f"  stalled: rank {rank} on {p.node}: never called collective #{seq}; last completed "
            f"#{p.completed.get(group, 0)} ({p.last_completed_op.get(group, 'none')}{step})"
        )
    for rank in silent:
        lines.append(f"  stalled: rank {rank}: its watchdog posted no progress (the process may be frozen or gone)")
    if not stalled and not silent:
        lines.append(
            f"  every rank{' of the group' if in_group else ''} called collective #{seq}, but it does not complete: "
            "a network or backend hang"
        )
    lines.append("HINT: look at what the stalled ranks do before that collective (data loading, a rank-only branch, "
                 f"I/O); py-spy dump --pid shows a live stack. Raise {STALL_TIMEOUT_VARIABLE} for slow steps")  # fmt: skip
    return "\n".join(lines)


def poll_failed_notice(rank: int, action: str, error: Exception, poll_s: float, store: str) -> str:
    """What a rank's log says when its watchdog cannot read the flight recorder or post to the store."""
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"  # not torch's C++ frames
    hint = (f"check that the job's store ({store}, MASTER_ADDR:MASTER_PORT) is reachable from this node"
            if "store" in action else "the flight recorder is torch's: the error above is its own")  # fmt: skip
    return (
        f"phalanx: the stall watchdog of rank {rank} cannot {action} ({why}). Until it can, this rank "
        f"reports no stall, and other ranks' reports use its last post (or none). It tries again every "
        f"{poll_s:g} s and says when it polls again.\nHINT: when the job is not ending, {hint}"
    )


class StallWatchdog:
    """A thread that posts this rank's progress on the job's store and, when a collective
    stays pending past ``stall_timeout``, ends the job with a report of the stalled ranks.
    """

    def __init__(
        self, rank: int, world_size: int, stall_timeout: float, backend: str, poll_s: float | None = None,
        group: int = 0,
    ) -> None:  # fmt: skip
        """``group``: which process group of this start of the workers it watches (a script may
        form several, one after the other): the posts of each have keys of their own."""
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.stall_timeout = stall_timeout
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.5, stall_timeout / 5))
        launched = WorkerEnv.from_env(os.environ)
        self.node = launched.node or os.uname().nodename
        # this start's name under phalanx run (alike on every node); plain torchrun's restart count
        start = launched.start_name or f"restart-{agent_restarts(os.environ)[0]}"
        self.prefix = f"phalanx/watchdog/{start}/{group}/"
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-stall-watchdog", daemon=True)
        self._store: Any = None
        self._store_address = ""
        self._counts: Counts | None = None  # at the last poll
        self._first_poll = True
        self._counts_only = 0  # polls since the last that read every entry
        self._progress: Progress | None = None  # from the last poll that read every entry
        # Held while this thread reads the flight recorder: a process forked meanwhile (a
        # DataLoader worker) would inherit a C-level lock torch's code held, and hang on it. Not
        # held for a store post, which an unreachable store holds for its timeout.
        self._in_torch = threading.Lock()
        os.register_at_fork(before=self._in_torch.acquire, after_in_parent=self._in_torch.release,
                            after_in_child=self._in_torch.release)  # fmt: skip

    def start(self) -> None:
        """Connects to the job's store and starts the polling thread."""
        from torch.distributed import TCPStore

        # A connection of its own: the training thread's store traffic is never interleaved with ours.
        self._store_address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self._store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30), use_libuv=True,
        )  # fmt: skip
        collective_counts(self.backend)  # the recorder's statics are initialized here, not in the thread
        self._store.check([f"{self.prefix}{self.rank}"])  # and the store client's
        self._thread.start()

    def stop(self) -> None:
        """Stops the polling thread, waiting for it at most a poll period and 5 s, then lets go of
        its store connection (a script may form groups one after another)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 5)
        if not self._thread.is_alive():
            self._store = None  # torch's client closes its connection when it is freed

    def _run(self) -> None:
        failing = False  # the last poll failed: said once, not at every poll
        while not self._stop.wait(self.poll_s):
            action = "read the flight recorder"
            try:
                with self._in_torch:
                    me = self._poll()
                if me is not None:  # (None: collectives complete, nothing a report could use)
                    action = "post to the job's store"
                    self._store.set(f"{self.prefix}{self.rank}", json.dumps(asdict(me)))
                    if me.pending_seq is not None and me.pending_for_s > self.stall_timeout:
                        self._abort(me)
            except Exception as error:
                if self._stop.is_set():  # the job is ending and the store went first
                    return
                if not failing:
                    print(poll_failed_notice(self.rank, action, error, self.poll_s, self._store_address),
                          file=sys.stderr, flush=True)  # fmt: skip
                failing = True
            else:
                if failing:
                    print(f"phalanx: the stall watchdog of rank {self.rank} polls again", file=sys.stderr, flush=True)
                failing = False

    def _poll(self) -> Progress | None:
        """This rank's progress from every entry of the flight recorder, to post; None while its
        counts show collectives completing (:func:`stood_still`), which costs microseconds
        instead of milliseconds holding the GIL.

        Only a full read is posted (the counts include point-to-point work, the entries'
        sequence does not). A stall stops every rank's counts, so each rank posts within two
        polls of its start. Every COUNTS_ONLY_POLLS + 1 polls the entries are read anyway: a
        launch blocked in one group while another works shows moving counts.
        """
        counts, previous, first = collective_counts(self.backend), self._counts, self._first_poll
        self._counts, self._first_poll = counts, False
        # The first poll has no counts to compare with: it keeps them for the next one. Reading
        # every entry instead would pause every run, seconds into it, for nothing a report needs.
        if counts is not None and (
            first or self._counts_only < COUNTS_ONLY_POLLS and not stood_still(previous, counts)
        ):
            self._counts_only += 1
            return None
        self._counts_only = 0
        self._progress = with_earlier(
            flight_recorder_progress(self.rank, self.node, self.step, self.backend), self._progress
        )
        return self._progress

    def _abort(self, me: Progress) -> None:
        members = group_members(me.pending_group) if me.pending_group is not None else None
        expected = sorted(members) if members is not None else range(self.world_size)  # the pending collective's group
        keys = {rank: f"{self.prefix}{rank}" for rank in expected}
        # A rank's first post can lag (its watchdog shares the CPU and the GIL with training):
        # give every rank a few polls to report before calling the silent ones frozen.
        deadline = time.monotonic() + min(ABORT_GRACE_S, 3 * self.poll_s + 5)
        while not self._store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(0.2)
        everyone = {
            rank: Progress(**json.loads(self._store.get(key))) for rank, key in keys.items() if self._store.check([key])
        }
        print(stall_report(me, everyone, self.world_size, self.stall_timeout, members), file=sys.stderr, flush=True)
        os._exit(ExitCode.STALLED)
