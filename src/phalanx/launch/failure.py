"""The root cause of a failed run: which rank died first, where, how, and its last words.

The others soon fail too (their collectives lose a peer), so the root cause is the failure whose
log went quiet first: a worker's peers only fail, and write their tracebacks, after it died.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from phalanx.exit_codes import ExitCode
from phalanx.launch import out_of_memory
from phalanx.launch.group_record import GROUP_RECORD_NAME, GroupRecord
from phalanx.worker_env import STALL_REPORT

TAIL_LINES = 12


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    node: str
    address: str
    exitcode: int
    time: float  # when its log was last written
    log: str
    tail: tuple[str, ...]
    reported: float = 0.0  # when torchrun's agent saw it end (whole seconds)
    error: tuple[str, ...] = ()  # the phalanx error its traceback ended with: the message's lines
    error_code: int = ExitCode.FAILED  # that error's exit code
    out_of_memory: str = ""  # the kernel's words where its out-of-memory killer ended it (:mod:`.out_of_memory`)

    @classmethod
    def from_dict(cls, item: dict[str, Any]) -> RankFailure:
        return cls(**{**item, "tail": tuple(item["tail"]), "error": tuple(item.get("error", ()))})

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            return f"was killed by {signal_name(-self.exitcode)}"
        return f"exited with code {self.exitcode}"


def signal_name(signum: int) -> str:
    """``SIGKILL``, or ``signal 77`` for a number no signal of this system has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def log_lines(path: Path | None) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path is not None and path.is_file() else []


def tail_of(text: list[str]) -> tuple[str, ...]:
    """What a log ended with: the last lines, from its last traceback when there is one; or the
    stall watchdog's report from its first line, which names the collective."""
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line or STALL_REPORT in line]
    if starts and STALL_REPORT in text[starts[-1]]:
        return tuple(text[starts[-1] :][:TAIL_LINES])
    chosen = text[starts[-1] :] if starts else text
    return tuple(chosen[-TAIL_LINES:])


def failures_from(
    failures: Mapping[int, Any], stderr_of_rank: dict[int, Path], node: str, address: str,
    oom_watch: out_of_memory.OomWatch | None = None,
) -> list[RankFailure]:  # fmt: skip
    """RankFailures from torchrun's failures by global rank (a ChildFailedError's, or a RunResult's)
    and the per-rank logs of this node; ``oom_watch``: the kernel's kills since the workers started."""
    found = []
    for rank, failure in failures.items():
        log = stderr_of_rank.get(rank)
        # The log's mtime is exact; torchrun's own timestamp is whole seconds, too coarse to order.
        written = log.stat().st_mtime if log is not None and log.exists() else float(failure.timestamp)
        text = log_lines(log)
        tail = tail_of(text)
        error = phalanx_error_in(_callstack(failure))
        found.append(
            RankFailure(
                rank=rank,
                local_rank=failure.local_rank,
                node=node,
                address=address,
                exitcode=failure.exitcode,
                time=written,
                log=str(log) if log else "",
                tail=tail,
                reported=float(failure.timestamp),
                error=error.message if error else (),
                error_code=error.exit_code if error else ExitCode.FAILED,
                out_of_memory=oom_watch.explain(failure.pid, failure.exitcode, tail) if oom_watch else "",
            )
        )
    return found


def _callstack(failure: Any) -> list[str]:
    """The traceback in the worker's error file (written by the bootstrap, read back by torch's
    ProcessFailure); [] without one."""
    message = (getattr(failure, "error_file_data", None) or {}).get("message")
    if not isinstance(message, dict):
        return []
    return str(message.get("extraInfo", {}).get("py_callstack", "")).splitlines()


def is_preemption(failures: list[RankFailure]) -> bool:
    """Workers that stopped for preemption; the agent may have SIGTERMed the slower ones, or
    SIGKILLed one still saving its checkpoint after the grace period."""
    return {f.exitcode for f in failures if not stopped_by_agent(f, failures)} == {ExitCode.PREEMPTED}


#: After the first failure torchrun's agent SIGTERMs the other workers, and SIGKILLs those still
#: running after its grace period (30 s): such a SIGKILL comes well after the first failure was seen.
TEARDOWN_KILL_AFTER_S = 5.0


def stopped_by_agent(failure: RankFailure, failures: list[RankFailure]) -> bool:
    """Whether the agent ended this worker while stopping the job: a consequence, never the cause.
    (A worker that handles SIGTERM, as PreemptionGuard does, is SIGKILLed after the grace period.)"""
    if failure.exitcode == -signal.SIGTERM:
        return True
    first_seen = min(f.reported for f in failures)
    return failure.exitcode == -signal.SIGKILL and failure.reported >= first_seen + TEARDOWN_KILL_AFTER_S


def root_cause(failures: list[RankFailure]) -> RankFailure | None:
    """The failure whose log went quiet first, among those the agent did not end itself."""
    return min(failures, key=lambda f: (stopped_by_agent(f, failures), f.time, f.rank), default=None)


#: Why a worker aborts as it tears its process group down (phalanx.runtime.context.destroy_process_group).
_GROUP_TORN_DOWN_TOO_SOON = (
    "the worker aborted while tearing its process group down, most likely because a thread of the backend "
    "still held a Python callback (compression hooks such as fp16 and PowerSGD run theirs in gloo's threads). End the "
    "script with phalanx's `context.close()`, or pause before the group goes: `time.sleep(0.1); "
    "dist.destroy_process_group()`"
)

#: How to give a container's /dev/shm more room (the env report's shm trap says it too).
SHM_REMEDY = (
    "give the container more: docker run --shm-size=16g (or --ipc=host); in Kubernetes mount an emptyDir with "
    "medium: Memory at /dev/shm"
)
#: Why a worker gets SIGBUS from shared memory, or NCCL cannot extend its segment there.
_SHM_FULL = (
    "/dev/shm on that node is full or too small (`df -h /dev/shm` shows it, `ls /dev/shm` what fills it, such as "
    "the torch_* and nccl-* files of a job that died; `phalanx env` warns under 1 GiB): DataLoader workers hand "
    f"their batches over through it, and NCCL passes data between a node's GPUs through it; {SHM_REMEDY}, or "
    "lower num_workers and prefetch_factor"
)

#: Last words of a worker that phalanx can explain: (text in its log tail, HINT).
KNOWN_ENDINGS = (
    ("terminate called without an active exception", _GROUP_TORN_DOWN_TOO_SOON),
    ("Resource deadlock avoided", _GROUP_TORN_DOWN_TOO_SOON),
    ("unable to allocate shared memory(shm)", _SHM_FULL),  # torch's DataLoader worker, where /dev/shm is full
    ("is killed by signal: Bus error", _SHM_FULL),  # the same, where memory there is written before it is reserved
    # NCCL's last error, which torch's DistBackendError quotes after "unhandled system error"
    ("Error while creating shared memory segment /dev/shm", _SHM_FULL),
)


#: The last line of a traceback that a phalanx error ended: "phalanx.errors.SettingsRefused: phalanx:
#: error: ..." (what torch.distributed prefixes a rank's lines with, "[rank1]: ", left out).
_PHALANX_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(phalanx(?:\.\w+)+)\.(\w+): (phalanx: error: .*)$")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class PhalanxErrorEnding:
    """A phalanx error that ended a worker (a SettingsRefused from phalanx.init, wrap_model...):
    its message as the user would have read it, and the exit code phalanx gives it."""

    message: tuple[str, ...]  # "phalanx: error: ...", its why lines, "HINT: ..."
    exit_code: int

    @property
    def is_refusal(self) -> bool:
        return self.exit_code == ExitCode.REFUSED


def phalanx_error_in(text: list[str]) -> PhalanxErrorEnding | None:
    """The phalanx error the log's last traceback ends with; None when it ends with another (one
    raised while handling a phalanx error, say) or there is none."""
    lines = _last_traceback(text)
    starts = [(i, match) for i, line in enumerate(lines) if (match := _PHALANX_ERROR.match(line))]
    if not starts:
        return None
    index, match = starts[-1]
    message = [match.group(3)]
    for line in lines[index + 1 :]:  # the error's own lines; whatever the process printed after, not
        if not line.startswith(("  ", "HINT: ")):
            break
        message.append(line)
    return PhalanxErrorEnding(tuple(message), _exit_code_of(match.group(1), match.group(2)))


def _last_traceback(text: Sequence[str]) -> list[str]:
    """The lines from the last "Traceback" header on (all of them when there is none), without
    torch's "[rankN]: " prefix."""
    lines = [_RANK_PREFIX.sub("", line) for line in text]
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
    return lines[starts[-1] :] if starts else lines


def last_words(tail: tuple[str, ...]) -> str:
    """A log tail's last words: the exception that ended its last traceback (not a warning printed
    after it), else its last line; without torch's "[rankN]: " prefix."""
    lines = _last_traceback(tail)
    if lines and lines[0].startswith(_TRACEBACK):
        ended = [line for line in lines[1:] if line and not line.startswith(" ")]
        if ended:
            return ended[0]
    return lines[-1].strip() if lines else ""


def _exit_code_of(module: str, name: str) -> int:
    from phalanx.errors import PhalanxError

    try:
        kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a worker's phalanx is another version than this one
        return ExitCode.FAILED
    return int(kind.exit_code) if isinstance(kind, type) and issubclass(kind, PhalanxError) else ExitCode.FAILED


def phalanx_error_of(failure: RankFailure) -> PhalanxErrorEnding | None:
    """The phalanx error that ended a worker: only when it exited as an uncaught exception does
    (code 1), not when a signal or its own exit code ended it after printing one."""
    if not failure.error or failure.exitcode != ExitCode.FAILED:
        return None
    return PhalanxErrorEnding(failure.error, failure.error_code)


def is_stall_report(failure: RankFailure) -> bool:
    return failure.exitcode == ExitCode.STALLED and any(STALL_REPORT in line for line in failure.tail)


def exit_code_for(failures: list[RankFailure]) -> int:
    """What phalanx run exits with after these failures: the root cause's own documented code
    when it has one (a refusal: 2; a stall found by the watchdog: 4), else 1."""
    cause = root_cause(failures)
    if cause is None:
        return ExitCode.FAILED
    ending = phalanx_error_of(cause)
    if ending is not None:
        return ending.exit_code
    return ExitCode.STALLED if is_stall_report(cause) else ExitCode.FAILED


def in_one_line(failures: list[RankFailure]) -> str:
    """The root cause as one line, for a failure the workers are restarted after: the rank, how it
    ended, its last words (a traceback's last line, a phalanx error's first) and its log."""
    cause = root_cause(failures)
    if cause is None:
        return "a worker failed"
    ending = phalanx_error_of(cause)
    if ending is not None:
        words = ending.message[0]
    elif cause.out_of_memory:
        words = cause.out_of_memory
    else:
        words = cause.tail[0] if is_stall_report(cause) else last_words(cause.tail)
    return f"rank {cause.rank} {cause.how}" + (f": {words}" if words else "") + (f" ({cause.log})" if cause.log else "")


def restart_cannot_help(failures: list[RankFailure]) -> str | None:
    """Why restarting the workers after these failures would only end the same way (a refusal of
    the settings, a stop for preemption), as words that follow "not restarting the workers:";
    None when a restart may help (a crash, a kill, a stall)."""
    if is_preemption(failures):
        return "they stopped for preemption (exit 75), which asks for the job to be started again later"
    causes = [f for f in failures if not stopped_by_agent(f, failures)]
    endings = [phalanx_error_of(f) for f in causes]
    if causes and all(ending is not None and ending.is_refusal for ending in endings):
        ranks = ", ".join(str(f.rank) for f in sorted(causes, key=lambda f: f.rank))
        whose = "ranks {} refused their" if len(causes) > 1 else "rank {} refused its"
        return f"{whose.format(ranks)} settings; a restart would refuse them again"
    return None


def hint_for(failure: RankFailure) -> str | None:
    if failure.out_of_memory:
        return out_of_memory.HINT
    text = "\n".join(failure.tail)
    return next((hint for words, hint in KNOWN_ENDINGS if words in text), None)


def format_root_cause(failures: list[RankFailure]) -> str:
    cause = root_cause(failures)
    if cause is None:
        return "phalanx: the run failed, but no worker reported a failure"
    ending = phalanx_error_of(cause)
    where = f"phalanx: root cause: rank {cause.rank} (local rank {cause.local_rank}) on {cause.node} ({cause.address})"
    if ending is not None:  # phalanx's own message says it all; the traceback stays in the log
        what = "it refused its settings" if ending.is_refusal else "it stopped with a phalanx error"
        lines = [f"{where} {cause.how}: {what}" + (f" (traceback: {cause.log})" if cause.log else "")]
    else:
        lines = [f"{where} {cause.how}"]
    early = ended_before(cause, failures)
    if early:
        ranks = f"ranks {', '.join(map(str, early))}" if len(early) > 1 else f"rank {early[0]}"
        lines.append(f"  before it, {ranks} had ended on {'their' if len(early) > 1 else 'its'} own while the "
                     "others trained on: their collectives lost a peer")  # fmt: skip
    stopped = [f for f in failures if f is not cause and stopped_by_agent(f, failures)]
    others = [f for f in failures if f is not cause and f not in stopped]
    refused = [f for f in others if (other := phalanx_error_of(f)) is not None and other.is_refusal]
    groups = (
        ("refused too", refused),
        ("then failed too", [f for f in others if f not in refused]),
        ("stopped by their agent", stopped),
    )
    for what, group in groups:
        if group:
            ranks = sorted(f.rank for f in group)
            lines.append(f"  {what}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
    if ending is not None:
        return "\n".join([*lines, *ending.message])
    if cause.out_of_memory:
        lines.append(f"  {cause.out_of_memory}")
    if cause.tail:
        lines.append(f"  the end of its stderr ({cause.log}):")  # a traceback, or the stall watchdog's report
        lines += [f"    {line}" for line in cause.tail]
    elif cause.log:
        lines.append(f"  its stderr ({cause.log}) is empty")
    hint = hint_for(cause) or (_ENDED_EARLY if early else None)
    if hint:
        lines.append(f"HINT: {hint}")
    return "\n".join(lines)


#: What to do about ranks that left the training before the others.
_ENDED_EARLY = (
    "where a rank leaves the training before the others (a stop only it decided, such as early stopping, or "
    "fewer batches), the others wait for it in their next collective: every rank must take the same steps"
)


#: How a collective ends whose peer process is gone: gloo's words, and NCCL's (via torch).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def ended_before(cause: RankFailure, failures: list[RankFailure]) -> list[int]:
    """Where the cause's collective lost its peer: the ranks of its start of the workers (in
    the log folders this host sees) that had ended on their own before, neither failed nor
    stopped: their exit record is older than its log's last line."""
    from phalanx.launch.logs import rank_folders  # (torch's, and only where a failure is told)

    if not cause.log or not any(words in line for line in cause.tail for words in _LOST_PEER):
        return []
    failed = {failure.rank for failure in failures}
    early = []
    for rank, folder in sorted(rank_folders(Path(cause.log).parent.parent).items()):
        path = folder / GROUP_RECORD_NAME
        record = GroupRecord.read(path)
        if rank in failed or record is None or record.stopped is not None or record.ran_alone:
            continue
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cause.time:
                early.append(rank)
    return early


def save_failures(failures: list[RankFailure], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(f) for f in failures], indent=1))


def load_failures(path: Path) -> list[RankFailure]:
    return [RankFailure.from_dict(item) for item in json.loads(path.read_text())]
