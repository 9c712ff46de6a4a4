"""The root cause of a failed run: which rank died first, where, how, and its last words.

When one worker dies, the others soon fail too (their collectives lose a peer), so torchrun's
list of failures mixes the cause with its consequences. The root cause is the failure whose
log went quiet first: a worker's stderr is written up to the moment it dies, and its peers only
fail, and write their own tracebacks, after that.
"""

from __future__ import annotations

import json
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


def hint_for(failure: RankFailure) -> str | None:
    text = "\n".join(failure.tail)
    return next((hint for words, hint in KNOWN_ENDINGS if words in text), None)


def format_root_cause(failures: list[RankFailure]) -> str:
    cause = root_cause(failures)
    if cause is None:
        return "phalanx: the run failed, but no worker reported a failure"
    lines = [
        f"phalanx: root cause: rank {cause.rank} (local rank {cause.local_rank}) on {cause.node} ({cause.address}) "
        f"{cause.how}",
    ]
    stopped = sorted(f.rank for f in failures if f is not cause and f.exitcode == -signal.SIGTERM)
    failed = sorted(f.rank for f in failures if f is not cause and f.exitcode != -signal.SIGTERM)
    for ranks, what in ((failed, "then failed too"), (stopped, "stopped by their agent")):
        if ranks:
            lines.append(f"  {what}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
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
