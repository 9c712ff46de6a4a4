"""A checkpoint folder: the names in it, the commit marker, and what may be removed.

Each checkpoint is a folder ``step-NNNNNNNNN`` of DCP's files plus ``phalanx.json``, the commit
marker: the size and CRC-32 of every file, written last. A save writes into
``.step-NNNNNNNNN.staging`` and renames it only once the marker is there, so a folder without
the dot is complete unless damaged later; a damaged one is renamed ``step-NNNNNNNNN.damaged``
and no longer counts, for loading or for pruning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

from phalanx.errors import SettingsRefused

FORMAT = 2
MARKER = "phalanx.json"
DCP_METADATA = ".metadata"
DAMAGED_SUFFIX = ".damaged"
#: Below this, a checkpoint folder's disk counts as full before anything is trained.
MIN_FREE_BYTES = 64 * 1024
_COMMITTED = re.compile(r"^step-(\d{9})$")
_STAGING = re.compile(r"^\.step-\d{9}\.staging$")
_REPLACED = re.compile(r"^\.(step-\d{9})\.replaced$")
_EARLIER_FORMAT = re.compile(r"^step-\d{9}\.pt$")  # phalanx 0.1.0's single files


def committed_name(step: int) -> str:
    """The folder name of the checkpoint saved after ``step``: ``step-`` and nine digits."""
    return f"step-{step:09d}"


def staging_name(step: int) -> str:
    """The hidden folder a checkpoint is written in before its commit."""
    return f".{committed_name(step)}.staging"


def committed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the folders with a commit marker, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in directory.iterdir() if (m := _COMMITTED.match(path.name))]
    return sorted(((step, path) for step, path in found if (path / MARKER).is_file()), reverse=True)


def check_folder(directory: Path) -> None:
    """Refuses, before the first step rather than at the first save, a folder that cannot take a
    checkpoint: a file, one that cannot be made or written, or a full disk."""
    hint = "give Run or CheckpointManager a checkpoint folder that can be written, on a disk with room"
    if directory.exists() and not directory.is_dir():
        raise SettingsRefused(
            f"the checkpoint folder {directory} is a file", "checkpoints are folders inside it.", hint
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory).free
    except OSError as error:
        raise SettingsRefused(f"the checkpoint folder {directory} cannot be made ({error.strerror or error})", "",
                              hint) from None  # fmt: skip
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SettingsRefused(f"the checkpoint folder {directory} is not writable by this user", "", hint)
    if free < MIN_FREE_BYTES:
        raise SettingsRefused(f"the disk of the checkpoint folder {directory} is full ({free} bytes free)",
                              "the first save would fail after training up to it.", hint)  # fmt: skip
    earlier = sorted(path.name for path in directory.iterdir() if _EARLIER_FORMAT.match(path.name))
    if earlier:
        raise SettingsRefused(
            f"the checkpoint folder {directory} holds checkpoints of an earlier phalanx format ({earlier[-1]})",
            "this version keeps each checkpoint as a torch.distributed.checkpoint folder (step-NNNNNNNNN) and "
            "cannot resume from those files; it would start the training over.",
            "give a new checkpoint folder, or move those files away to start over in this one",
        )


def file_facts(path: Path) -> dict[str, int]:
    """A file's size and CRC-32, as the commit marker keeps them. CRC-32 finds truncation and
    accidental damage at several GB/s; loading is safe without it (nothing loaded runs code)."""
    crc = 0
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def data_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder that its marker covers, in a fixed order."""
    return sorted(path.name for path in folder.iterdir() if path.name != MARKER and path.is_file())


def write_marker(folder: Path, facts: dict[str, Any]) -> None:
    """The commit marker, durably: the checkpoint counts as complete from the rename on."""
    temporary = folder / f".{MARKER}.tmp"
    with temporary.open("w", encoding="utf-8") as handle:
        json.dump({"format": FORMAT, **facts}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, folder / MARKER)
    fsync_folder(folder)


def read_marker(folder: Path) -> dict[str, Any]:
    """The commit marker's contents. Raises ValueError when it is not one this version writes."""
    marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(
            f"format {marker.get('format') if isinstance(marker, dict) else '?'}, this version reads {FORMAT}"
        )
    return marker


def commit(staging: Path, step: int) -> Path:
    """Renames a staging folder whose marker is written to its final name.

    The same step saved again replaces the earlier copy, which is first renamed
    ``.step-N.replaced``: a crash between the two renames leaves it, and the next start
    (:func:`remove_staging`) puts it back.
    """
    final = staging.with_name(committed_name(step))
    replaced = staging.with_name(f".{final.name}.replaced")
    if final.exists():
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_folder(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def set_aside(path: Path) -> str:
    """Renames a damaged checkpoint (a folder, or a last-step file) out of the way, replacing an
    earlier one set aside; says where it went (or why it stays)."""
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    try:
        if aside.is_dir():
            shutil.rmtree(aside)
        os.replace(path, aside)
    except OSError as error:
        return f"left where it is ({error.strerror or error})"
    return f"kept as {aside.name}"


def prune(directory: Path, keep: int) -> None:
    """Removes the complete checkpoints beyond the newest ``keep``."""
    for _, old in committed(directory)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def remove_staging(directory: Path) -> None:
    """Removes the staging folders of saves that never committed (a crash, a kill, a full disk),
    and puts back a checkpoint whose replacement never landed (:func:`commit`)."""
    if not directory.is_dir():
        return
    for leftover in directory.iterdir():
        replaced = _REPLACED.match(leftover.name)
        if replaced and not (directory / replaced.group(1)).exists():
            os.replace(leftover, directory / replaced.group(1))
        elif replaced or _STAGING.match(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)


def fsync_folder(folder: Path) -> None:
    """Flushes a folder's entries (a rename, a new file in it) to the disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
