"""The state after the last completed step, saved by the ranks that survive a failure.

One file, ``last-step/step-NNNNNNNNN-LAUNCH.pt`` in the checkpoint folder, written to a temporary
file and linked to its name: the first whole copy wins, unless a preferred one replaces it. A
committed checkpoint of a later or equal step makes it obsolete (docs/runtime-design.md).
"""

from __future__ import annotations

import os
import re
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from phalanx.runtime.checkpoint.folder import fsync_folder

FOLDER = "last-step"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{9})-([0-9a-f]{16})\.pt$")
_TEMPORARY = re.compile(r"^\.step-\d{9}-[0-9a-f]{16}\..+\.tmp$")


class Damaged(ValueError):
    """A last-step file that cannot be read back whole, or that another version wrote."""


def path_of(directory: Path, step: int, launch: int) -> Path:
    """Where the state after ``step`` is kept by the survivors of launch ``launch``."""
    return directory / FOLDER / f"step-{step:09d}-{launch:016x}.pt"


def kept(directory: Path) -> list[tuple[int, int]]:
    """(step, launch) of the states kept, newest first."""
    folder = directory / FOLDER
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), int(m.group(2), 16)) for path in folder.iterdir() if (m := _NAME.match(path.name))]
    return sorted(found, reverse=True)


def write(directory: Path, step: int, launch: int, flat: dict[str, torch.Tensor], header: dict[str, Any],
          preferred: bool = False) -> bool:  # fmt: skip
    """Writes the state after ``step`` unless another survivor's copy is there first.

    Args:
        directory: the checkpoint folder.
        step: the last step the state completed.
        launch: the job's launch token (the same on every rank of this launch).
        flat: the state's tensors by key, its skeleton among them (:func:`.encoding.flatten`).
        header: plain values kept beside them (the world size, the writer's rank).
        preferred: this copy replaces one that is there already.

    Returns:
        True when this copy is the one kept, False when another was there first.

    Raises:
        OSError: the file could not be written (a full disk); nothing is left behind.
    """
    folder = directory / FOLDER
    folder.mkdir(exist_ok=True)
    final = path_of(directory, step, launch)
    if final.exists() and not preferred:
        return False
    temporary = folder / f".{final.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    on_host = {key: tensor.detach().cpu() for key, tensor in flat.items()}
    try:
        with temporary.open("wb") as handle:
            try:
                torch.save({"header": {**header, "format": FORMAT, "step": step, "crc32": _crc32(on_host)},
                            "state": on_host}, handle)  # fmt: skip
            except RuntimeError as error:  # torch's zip writer reports a failed write (a full disk) so
                if isinstance(error.__context__, OSError):
                    raise error.__context__ from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        try:
            if preferred:
                os.replace(temporary, final)
            else:
                os.link(temporary, final)
        except FileExistsError:
            return False
        fsync_folder(folder)
        return True
    finally:
        temporary.unlink(missing_ok=True)


def read(path: Path, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and flat state of a last-step file.

    Raises:
        Damaged: truncated, altered (CRC-32), not this format, or of another step.
        OSError: it cannot be read (permissions, the file system).
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # pages, not a second copy
        header, flat = saved["header"], saved["state"]
        if not (isinstance(header, dict) and isinstance(flat, dict)):
            raise TypeError("not a header and a state")
    except OSError:
        raise
    except Exception as error:  # whatever a damaged zip or pickle raises (RuntimeError, UnpicklingError...)
        raise Damaged(
            f"it does not load ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]})"
        ) from None
    if header.get("format") != FORMAT or header.get("step") != step:
        raise Damaged(f"its header says format {header.get('format')}, step {header.get('step')}; "
                      f"this version writes format {FORMAT} and the name says step {step}")  # fmt: skip
    if _crc32(flat) != header.get("crc32"):
        raise Damaged("its tensors are altered (their CRC-32 differs from its header's)")
    return header, flat


def prune(directory: Path, up_to: int) -> None:
    """Removes the states of steps up to ``up_to`` (a checkpoint of that step is committed)."""
    for step, launch in kept(directory):
        if step <= up_to:
            path_of(directory, step, launch).unlink(missing_ok=True)


def remove_temporaries(directory: Path) -> None:
    """Removes the temporary files of writes that never finished (a kill in the middle)."""
    folder = directory / FOLDER
    if folder.is_dir():
        for leftover in folder.iterdir():
            if _TEMPORARY.match(leftover.name):
                leftover.unlink(missing_ok=True)


def _crc32(flat: dict[str, torch.Tensor]) -> int:
    """The CRC-32 of the tensors' bytes, in key order."""
    crc = 0
    for key in sorted(flat):
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(flat[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc
