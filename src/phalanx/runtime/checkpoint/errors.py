"""What a failed save tells the user: the cause found in DCP's wrapped errors, and a HINT."""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

from phalanx.errors import CheckpointNotSaved

#: Less free space than this after a failed write: the disk is full.
NEARLY_FULL_BYTES = 1 << 20
#: (errno or None, what went wrong): picklable, so every rank learns why another one failed.
Failure = tuple[int | None, str]


def describe(error: BaseException | None, folder: Path) -> Failure | None:
    """The OS error under ``error`` (DCP wraps each rank's in a CheckpointException), or its text.

    torch's zip writer reports a write that ran out of space as "unexpected pos" with no OS
    error under it: a disk with almost nothing left under ``folder`` then counts as full.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [error] if error is not None else []
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno, current.strerror or str(current)
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            pending += [f for f in failures.values() if isinstance(f, BaseException)]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    if error is None:
        return None
    with contextlib.suppress(OSError):
        if shutil.disk_usage(folder).free < NEARLY_FULL_BYTES:
            return errno.ENOSPC, "No space left on device"
    return None, str(error).splitlines()[0] if str(error) else type(error).__name__


def not_saved(path: Path, failure: Failure, keep: int, previous: Path | None) -> CheckpointNotSaved:
    """The error a failed save raises: nothing of it was kept; the previous checkpoint is intact."""
    code, text = failure
    kept = f"the previous checkpoint ({previous.name}) is intact" if previous else "there is no earlier checkpoint"
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free)"
        except OSError:
            free = ""
        return CheckpointNotSaved(
            f"checkpoint {path} could not be written: the disk is full{free}",
            f"nothing of it was kept; {kept}, and a relaunch resumes from it.",
            f"free space on that disk, or give a checkpoint folder on another disk; keeping fewer checkpoints (now "
            f"{keep}) needs less",
        )
    return CheckpointNotSaved(
        f"checkpoint {path} could not be written: {text}",
        f"nothing of it was kept; {kept}.",
        "check that the checkpoint folder is a writable folder (not a file, not read-only)",
    )
