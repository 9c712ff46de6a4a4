"""Checkpoints that are never half-written and always resume exactly.

One call saves the training state plus every rank's RNG states. Rank 0 writes it: to a
temporary file, fsync, then a rename, so a crash leaves either the old checkpoint or the new
one, never a torn file. A SHA-256 beside it (written first) lets :meth:`load_latest` reject a
damaged file and fall back to the previous one. Loading uses ``weights_only=True``: a checkpoint
file cannot run code.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.context import DistributedContext

_NAME = re.compile(r"^step-(\d{9})\.pt$")
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


class CheckpointManager:
    def __init__(self, directory: str | Path, context: DistributedContext, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept")
        self.directory = Path(directory)
        self.context = context
        self.keep = keep

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
            self.directory.mkdir(parents=True, exist_ok=True)
            payload = {"format": FORMAT, "step": step, "world_size": self.context.world_size, "state": state, "rng": rngs}
            staging = path.with_name(f".{path.name}.staging-{os.getpid()}")
            _write_atomically(staging, lambda handle: torch.save(payload, handle))
            # The checksum lands first: a data file without its checksum is never trusted.
            _write_atomically(path.with_suffix(".sha256"), lambda handle: handle.write(_sha256(staging).encode()))
            os.replace(staging, path)
            self._fsync_directory()
            self._prune()
        self.context.barrier()  # nobody runs ahead of a checkpoint that is not complete yet
        return path

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
        for leftover in self.directory.glob(".step-*"):  # temporaries of a save that crashed
            if f"-{os.getpid()}" not in leftover.name:
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
            if problem:
                print(f"phalanx: checkpoint {path} is damaged ({problem}); trying the previous one", file=sys.stderr)
                continue
            return step, str(path), torch.load(path, map_location="cpu", weights_only=True)
        return None

    @staticmethod
    def _problem_with(path: Path) -> str | None:
        checksum = path.with_suffix(".sha256")
        if not checksum.is_file():
            return "no checksum file"
        if checksum.read_text().strip() != _sha256(path):
            return "checksum mismatch: truncated or altered"
        return None
