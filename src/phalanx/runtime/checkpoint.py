"""Checkpoints that are never half-written and always resume exactly.

One call saves the training state plus every rank's RNG states. Rank 0 writes it: to a
temporary file, fsync, then a rename, so a crash leaves either the old checkpoint or the new
one, never a torn file. A SHA-256 beside it (written first) lets :meth:`load_latest` reject a
damaged file and fall back to the previous one; the damaged file is set aside (renamed
``*.damaged``), so that pruning never counts it among the checkpoints it keeps. Loading uses
``weights_only=True``: a checkpoint file cannot run code, and one that would is set aside too.
A save that fails (a full disk) removes what it wrote and says so; the previous checkpoints
stay.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import random
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import CheckpointNotSaved, SettingsRefused
from phalanx.runtime.context import DistributedContext

_NAME = re.compile(r"^step-(\d{9})\.pt$")
#: A save's temporary files: ".step-N.pt.staging-PID", its ".tmp-PID", the checksum's ".tmp-PID".
_TEMPORARY = re.compile(r"^\.+step-\d{9}\..*(staging|tmp)-(\d+)")
DAMAGED_SUFFIX = ".damaged"
#: Below this, a checkpoint folder's disk counts as full before anything is trained.
MIN_FREE_BYTES = 64 * 1024
FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    state: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's RNG states, when the checkpoint has them


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # stored as plain lists: weights_only loading accepts no numpy arrays
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, write: Any) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _why_it_does_not_load(path: Path, error: Exception) -> str:
    if not zipfile.is_zipfile(path):
        return "it does not load: it is not a torch checkpoint file"
    if "Weights only load failed" in str(error):  # torch refused an object: loading it could run code
        return "it holds objects that are not tensors or plain values"
    return f"it does not load: {str(error).splitlines()[0] if str(error) else type(error).__name__}"


class CheckpointManager:
    def __init__(self, directory: str | Path, context: DistributedContext, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept")
        self.directory = Path(directory)
        self.context = context
        self.keep = keep
        if context.is_main:
            self._check_folder()

    def _check_folder(self) -> None:
        """Refuses, before the first step rather than at the first save, a folder that cannot take
        a checkpoint: a file, one that cannot be made or written, or a full disk."""
        where = self.directory
        hint = "give --checkpoint-dir (or the manager's folder) as a writable folder on a disk with room"
        if where.exists() and not where.is_dir():
            raise SettingsRefused(f"the checkpoint folder {where} is a file", "checkpoints are files inside a folder.", hint)
        try:
            where.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(where).free
        except OSError as error:
            raise SettingsRefused(f"the checkpoint folder {where} cannot be made ({error.strerror or error})", "",
                                  hint) from None  # fmt: skip
        if not os.access(where, os.W_OK | os.X_OK):
            raise SettingsRefused(f"the checkpoint folder {where} is not writable by this user", "", hint)
        if free < MIN_FREE_BYTES:
            raise SettingsRefused(f"the disk of the checkpoint folder {where} is full ({free} bytes free)",
                                  "the first save would fail after training up to it.", hint)  # fmt: skip

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}.pt"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of the complete checkpoints here, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found, reverse=True)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Saves ``state`` (state_dicts and plain values) and every rank's RNG; a collective."""
        local = rng_state()
        rngs: list[Any] = [local]
        if self.context.is_distributed and dist.is_initialized():
            rngs = [None] * self.context.world_size
            dist.all_gather_object(rngs, local)
        path = self.path_for(step)
        if self.context.is_main:
            payload = {"format": FORMAT, "step": step, "world_size": self.context.world_size, "state": state, "rng": rngs}
            self._write(path, payload)
            self._prune()
        self.context.barrier()  # nobody runs ahead of a checkpoint that is not complete yet
        return path

    def _write(self, path: Path, payload: dict[str, Any]) -> None:
        staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
        checksum_written = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomically(staging, lambda handle: torch.save(payload, handle))
            # The checksum lands first: a data file without its checksum is never trusted.
            _write_atomically(path.with_suffix(".sha256"), lambda handle: handle.write(_sha256(staging).encode()))
            checksum_written = True
            os.replace(staging, path)
            checksum_written = False  # the pair is complete: a failure from here on leaves it whole
            self._fsync_directory()
        except (OSError, RuntimeError) as error:
            self._remove_temporaries(own=True)
            if checksum_written:  # a checksum whose data never landed
                with contextlib.suppress(OSError):
                    path.with_suffix(".sha256").unlink(missing_ok=True)
            # torch's zip writer reports a failed write as a RuntimeError on top of the OSError
            cause = error if isinstance(error, OSError) else error.__context__
            if not isinstance(cause, OSError):
                raise
            raise self._not_saved(path, cause) from None

    def _not_saved(self, path: Path, error: OSError) -> CheckpointNotSaved:
        kept = self.checkpoints()
        previous = f"the previous checkpoint ({kept[0][1].name}) is intact" if kept else "there is no earlier checkpoint"
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = f" ({shutil.disk_usage(self.directory).free / 2**20:.0f} MiB free)"
            except OSError:
                free = ""
            return CheckpointNotSaved(
                f"checkpoint {path} could not be written: the disk is full{free}",
                f"nothing of it was kept; {previous}, and a relaunch resumes from it.",
                f"free space on that disk, or give a checkpoint folder on another disk; keeping fewer checkpoints "
                f"(now {self.keep}) needs less",
            )
        return CheckpointNotSaved(
            f"checkpoint {path} could not be written: {error.strerror or error}",
            f"nothing of it was kept; {previous}.",
            "check that the checkpoint folder is a writable folder (not a file, not read-only)",
        )
    def _fsync_directory(self) -> None:
        descriptor = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def _prune(self) -> None:
        for _, old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)
        self._remove_temporaries(own=False)

    def _remove_temporaries(self, *, own: bool) -> None:
        """The temporary files of saves that crashed (``own``: of this process's failed save)."""
        if not self.directory.is_dir():
            return
        for leftover in self.directory.iterdir():
            match = _TEMPORARY.match(leftover.name)
            if match and (int(match.group(2)) == os.getpid()) == own:
                leftover.unlink(missing_ok=True)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; damaged ones are reported and skipped.

        A collective: rank 0 reads and verifies, every rank receives the same checkpoint. So all
        ranks resume from one step, and only rank 0's node needs the directory (it alone writes).
        """
        found = self._read_newest_valid() if self.context.is_main else None
        if self.context.is_distributed and dist.is_initialized():
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        if found is None:
            return None
        step, path, payload = found
        rngs = payload.get("rng") or []
        same_world = payload.get("world_size") == self.context.world_size and len(rngs) == self.context.world_size
        return Checkpoint(step, Path(path), payload["state"], rngs[self.context.rank] if same_world else None)

    def _read_newest_valid(self) -> tuple[int, str, dict[str, Any]] | None:
        for step, path in self.checkpoints():
            problem = self._problem_with(path)
            if problem is None:
                try:
                    return step, str(path), torch.load(path, map_location="cpu", weights_only=True)
                except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
                    problem = _why_it_does_not_load(path, error)
            print(f"phalanx: checkpoint {path} is damaged ({problem}); {self._set_aside(path)}, trying the previous one",
                  file=sys.stderr)  # fmt: skip
        return None

    @staticmethod
    def _set_aside(path: Path) -> str:
        """Renames a damaged checkpoint (and its checksum) out of the way, so that pruning never
        counts it; says where it went (or why it stays, in a folder that cannot be written)."""
        aside = path.with_name(path.name + DAMAGED_SUFFIX)
        try:
            os.replace(path, aside)
            checksum = path.with_suffix(".sha256")
            if checksum.exists():
                os.replace(checksum, checksum.with_name(checksum.name + DAMAGED_SUFFIX))
        except OSError as error:
            return f"left where it is ({error.strerror or error})"
        return f"kept as {aside.name}"

    @staticmethod
    def _problem_with(path: Path) -> str | None:
        checksum = path.with_suffix(".sha256")
        if not checksum.is_file():
            return "no checksum file"
        if checksum.read_text().strip() != _sha256(path):
            return "checksum mismatch: truncated or altered"
        return None
