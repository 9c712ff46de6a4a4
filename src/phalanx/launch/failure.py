"""The root cause of a failed run: which rank died first, where, how, and its last words.

When one worker dies, the others soon fail too (their collectives lose a peer), so torchrun's
list of failures mixes the cause with its consequences. The root cause is the failure whose
log went quiet first: a worker's stderr is written up to the moment it dies, and its peers only
fail, and write their own tracebacks, after that.
"""

from __future__ import annotations

import importlib
import json
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from phalanx.exit_codes import ExitCode

TAIL_LINES = 12


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    node: str
    address: str
    exitcode: int
    time: float
    log: str
    tail: tuple[str, ...]

    @classmethod
    def from_dict(cls, item: dict[str, Any]) -> RankFailure:
        return cls(**{**item, "tail": tuple(item["tail"])})

    @property
    def how(self) -> str:
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"was killed by {name}"
        return f"exited with code {self.exitcode}"


def tail_of(path: Path | None, lines: int = TAIL_LINES) -> tuple[str, ...]:
    """The last lines of a log, starting at its last traceback when there is one."""
    if path is None or not path.is_file():
        return ()
    text = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    chosen = text[starts[-1] :] if starts else text
    return tuple(chosen[-lines:])


def failures_from(error: Any, stderr_of_rank: dict[int, Path], node: str, address: str) -> list[RankFailure]:
    """RankFailures from torchrun's ChildFailedError and the per-rank logs of this node."""
    found = []
    for rank, failure in error.failures.items():
        log = stderr_of_rank.get(rank)
        # The log's mtime is exact; torchrun's own timestamp is whole seconds, too coarse to order.
        written = log.stat().st_mtime if log is not None and log.exists() else float(failure.timestamp)
        found.append(
            RankFailure(
                rank=rank,
                local_rank=failure.local_rank,
                node=node,
                address=address,
                exitcode=failure.exitcode,
                time=written,
                log=str(log) if log else "",
                tail=tail_of(log),
            )
        )
    return found


def is_preemption(failures: list[RankFailure]) -> bool:
    """Workers that stopped for preemption; the agent may have SIGTERMed the slower ones."""
    codes = {f.exitcode for f in failures}
    return ExitCode.PREEMPTED in codes and codes <= {ExitCode.PREEMPTED, -signal.SIGTERM}


def root_cause(failures: list[RankFailure]) -> RankFailure | None:
    # A SIGTERM comes from an agent stopping the survivors: a consequence, never the cause.
    return min(failures, key=lambda f: (f.exitcode == -signal.SIGTERM, f.time, f.rank), default=None)


#: Last words of a worker that phalanx can explain: (text in its log tail, HINT).
KNOWN_ENDINGS = (
    (
        "terminate called without an active exception",
        "the worker aborted while Python shut down: a process group was still alive then (a DDP model "
        "keeps it in a reference cycle). End the script with `del model; gc.collect(); "
        "dist.destroy_process_group()`",
    ),
)


#: The last line of a traceback that a phalanx error ended: "phalanx.errors.SettingsRefused: phalanx:
#: error: ..." (what torch.distributed prefixes a rank's lines with, "[rank1]: ", left out).
_PHALANX_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(phalanx(?:\.\w+)+)\.(\w+): (phalanx: error: .*)$")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


@dataclass(frozen=True)
class PhalanxErrorEnding:
    """A phalanx error that ended a worker (a SettingsRefused from phalanx.init, wrap_model...):
    its message as the user would have read it, and the exit code phalanx gives it."""

    message: tuple[str, ...]  # "phalanx: error: ...", its why lines, "HINT: ..."
    exit_code: int

    @property
    def is_refusal(self) -> bool:
        return self.exit_code == ExitCode.REFUSED


def phalanx_error_of(failure: RankFailure) -> PhalanxErrorEnding | None:
    """The phalanx error a worker's traceback ends with; None when it ended otherwise."""
    lines = [_RANK_PREFIX.sub("", line) for line in failure.tail]
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


def _exit_code_of(module: str, name: str) -> int:
    from phalanx.errors import PhalanxError

    try:
        kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a worker's phalanx is another version than this one
        return ExitCode.FAILED
    return int(kind.exit_code) if isinstance(kind, type) and issubclass(kind, PhalanxError) else ExitCode.FAILED


def exit_code_for(failures: list[RankFailure]) -> int:
    """What phalanx run exits with after these failures: the root cause's own documented code
    when it has one (a refusal: 2; a stall found by the watchdog: 4), else 1."""
    cause = root_cause(failures)
    if cause is None:
        return ExitCode.FAILED
    ending = phalanx_error_of(cause)
    if ending is not None:
        return ending.exit_code
    return ExitCode.STALLED if cause.exitcode == ExitCode.STALLED else ExitCode.FAILED


def hint_for(failure: RankFailure) -> str | None:
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
        lines = [f"{where} {cause.how}: {what} (traceback: {cause.log})"]
    else:
        lines = [f"{where} {cause.how}"]
    others = [f for f in failures if f is not cause and f.exitcode != -signal.SIGTERM]
    refused = [f for f in others if (other := phalanx_error_of(f)) is not None and other.is_refusal]
    groups = (
        ("refused too", refused),
        ("then failed too", [f for f in others if f not in refused]),
        ("stopped by their agent", [f for f in failures if f is not cause and f.exitcode == -signal.SIGTERM]),
    )
    for what, group in groups:
        if group:
            ranks = sorted(f.rank for f in group)
            lines.append(f"  {what}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
    if ending is not None:
        return "\n".join([*lines, *ending.message])
    if cause.tail:
        lines.append(f"  last lines of its stderr ({cause.log}):")
        lines += [f"    {line}" for line in cause.tail]
    elif cause.log:
        lines.append(f"  its stderr ({cause.log}) is empty")
    hint = hint_for(cause)
    if hint:
        lines.append(f"HINT: {hint}")
    return "\n".join(lines)


def save_failures(failures: list[RankFailure], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(f) for f in failures], indent=1))


def load_failures(path: Path) -> list[RankFailure]:
    return [RankFailure.from_dict(item) for item in json.loads(path.read_text())]
