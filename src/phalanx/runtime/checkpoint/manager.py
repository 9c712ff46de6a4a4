"""Checkpoints on torch.distributed.checkpoint: every rank writes its part, none is half-written.

A save is a collective: the replicated state is written once, each rank's own under its rank, in a
staging folder that a commit marker and a rename make complete. With node-local folders every node
keeps a whole copy (docs/runtime-design.md).
"""

from __future__ import annotations

import numbers
import pickle
import shutil
import sys
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import CheckpointNotSaved, SettingsRefused
from phalanx.runtime.checkpoint import encoding, folder, last_step
from phalanx.runtime.checkpoint.errors import describe, not_saved
from phalanx.runtime.checkpoint.lock import FolderLock
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.heal.hook import raised_by_a_collective

_SHARED, _SHARED_SKELETON = "state", "skeleton.state"
# DCP warns at every save and load in one process (or with node-local folders) that it assumes so: it is meant.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")


def _rank_prefix(rank: int) -> str:
    return f"rank{rank}"


def _rank_skeleton(rank: int) -> str:
    return f"skeleton.rank{rank}"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        step: the step it was saved after.
        path: its folder.
        state: the state every rank saved alike (``state`` of :meth:`CheckpointManager.save`).
        rank_state: this rank's own part, or None when the checkpoint was written by another
            number of processes (a rank's own state has no owner then) or is a survivor's.
        world_size: the number of processes that wrote it.
        survivor: whether it is the state a survivor of a failure kept
            (:meth:`CheckpointManager.save_last_step`), not a committed checkpoint.
    """

    step: int
    path: Path
    state: dict[str, Any]
    rank_state: dict[str, Any] | None
    world_size: int
    survivor: bool = False


class CheckpointManager:
    """Saves and loads sharded checkpoints in one folder, keeping the newest ``keep``.

    Args:
        directory: the checkpoint folder; made if missing. Refused (SettingsRefused, exit 2) when
            it is a file, cannot be made or written, or its disk is full, or another job that
            still runs holds it (its ``phalanx.lock``): before the first step.
        context: the job (:func:`phalanx.init`). Every rank makes the manager: a collective.
        keep: complete checkpoints kept; older ones are removed after each save.
        async_save: write in a background thread; :meth:`save` returns once the state is copied
            to host memory, and the next save (or :meth:`wait`) finishes the previous one.

    Example::

        checkpoints = CheckpointManager("ckpt", context)
        latest = checkpoints.load_latest(into={"model": model.state_dict()})
        ...
        checkpoints.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    Raises:
        SettingsRefused: the folder cannot be used (see ``directory``).
    """

    def __init__(
        self, directory: str | Path, context: DistributedContext, keep: int = 3, async_save: bool = False
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or keep < 1:
            raise ValueError(f"keep={keep!r}: a whole number of checkpoints, at least 1 (the newest)")
        self.directory, self.context, self.keep, self.async_save = Path(directory), context, keep, async_save
        self._distributed = context.is_distributed and dist.is_initialized()
        # Checkpoint collectives run in a group of their own: an async save's thread uses it
        # while the training uses the default group (and gloo works for CPU and CUDA tensors).
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        healing = context.healing
        # A rank that replaces one that died joins peers in the middle of a step: it compares
        # nothing with them (they checked the folder at the job's start) and learns from its heal
        # whether the folders are node-local (:meth:`joined`).
        joining = healing is not None and healing.replacement
        # Before anything in the folder is touched: another job's saves in progress are left alone.
        refusal = (self._check_folder() or FolderLock(self.directory).take()) if context.local_rank == 0 else None
        refused = refusal if joining else next((r for r in self._all(refusal) if r is not None), None)
        if refused is not None:  # on every rank: the one that found it says why
            raise SettingsRefused(*(refusal or refused)) from None
        self.node_local = (self._distributed and not joining and context.local_world_size < context.world_size
                           and not self._one_folder())  # fmt: skip
        if self._writes_files and not joining:
            folder.remove_staging(self.directory)
            last_step.remove_temporaries(self.directory)
        if not joining:
            self._barrier()
        if healing is not None:
            healing.on_new_group(self._regroup, self._release_group)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="phalanx-checkpoint") if async_save else None
        self._pending: Future[None] | None = None

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Saves a checkpoint after ``step``; a collective.

        Args:
            step: the step it is saved after (its name).
            state: what every rank holds alike (state_dicts, plain values); written once.
            rank_state: this rank's own part (its RNG states, per-rank buffers).

        Raises:
            CheckpointNotSaved: it could not be written (a full disk...): nothing of it is
                kept and the previous checkpoints are intact. With ``async_save``, the error of
                the previous save is raised here or by :meth:`wait`.
            encoding.NotStorable: a value that is neither a tensor nor a plain value.
        """
        try:
            self.wait()
        except CheckpointNotSaved as failed:  # said, and this save is tried all the same (a preemption's)
            print(failed.render(), file=sys.stderr, flush=True)
        flat = self._flatten(state, rank_state or {})
        if self._executor is None:
            self._write(step, flat)
            return
        staged = {key: _host_copy(tensor) for key, tensor in flat.items()}  # the training stalls for this copy only
        self._pending = self._executor.submit(self._write, step, staged)

    def check(self, state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Refuses, before the first step, what the first save would fail on after training to it.

        Args:
            state, rank_state: what :meth:`save` will be given (its tensors are not copied).

        Raises:
            SettingsRefused: a value that is neither a tensor nor a plain value, or a disk with
                less room than one checkpoint needs (checked by the ranks that write the files).
        """
        try:
            shared, _ = encoding.flatten(state, _SHARED)
            own, _ = encoding.flatten(rank_state or {}, _rank_prefix(self.context.rank))
        except encoding.NotStorable as refused:
            raise SettingsRefused(f"the checkpoint cannot hold {refused}", "",
                                  "give that object a state_dict() of tensors and plain values") from None  # fmt: skip
        needed = _bytes(shared) + self.context.world_size * _bytes(own)
        if self._writes_files:
            # Before the first step an optimizer holds no buffers yet (Adam's moments come with its
            # first step): the newest checkpoint, where there is one, is the better measure.
            newest = folder.committed(self.directory)[:1]
            on_disk = sum(_listed_bytes(checkpoint) for _, checkpoint in newest)
            free = shutil.disk_usage(self.directory).free
            if free < max(needed, on_disk):
                measured = f" (the newest, {newest[0][1].name}, takes that much)" if on_disk > needed else ""
                raise SettingsRefused(
                    f"the disk of the checkpoint folder {self.directory} has {free / 2**20:.0f} MiB free; one checkpoint "
                    f"needs about {max(needed, on_disk) / 2**20:.1f} MiB{measured}",
                    "the first save would fail after training up to it.",
                    "free space on that disk, or give a checkpoint folder on another disk",
                )

    def save_last_step(
        self, step: int, launch: int, state: dict[str, Any], preferred: bool = False
    ) -> tuple[Path, bool]:
        """Keeps the state after ``step`` for a restart, on a rank that survived a failure.

        No collective: the other ranks may be gone. Any survivor may call it; the first whole
        copy is kept (:mod:`.last_step`), and :meth:`load_latest` resumes from it while it is
        newer than every committed checkpoint.

        Args:
            step: the last step that ``state`` completed.
            launch: a token of this launch of the job, the same on every rank and new at each
                start: the survivors of one failure are told from an earlier failure's.
            state: what :meth:`save` takes as ``state``. No rank's own part: a survivor does not
                hold the others' (a run seeds its random state from the step instead).
            preferred: this copy is better than others (its buffers are rank 0's) and replaces
                one kept already.

        Returns:
            (the file, whether this rank's copy is the one kept).

        Raises:
            OSError: it could not be written (a full disk); nothing of it is left.
        """
        shared, skeleton = encoding.flatten(state, _SHARED)
        header = {"world_size": self.context.world_size, "rank": self.context.rank}
        kept = last_step.write(self.directory, step, launch, {**shared, _SHARED_SKELETON: skeleton}, header, preferred)
        return last_step.path_of(self.directory, step, launch), kept

    def wait(self) -> None:
        """Waits for an async save to be committed; raises its error (CheckpointNotSaved)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for an async save, then stops the writing thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()

    def _flatten(self, state: dict[str, Any], rank_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        shared, skeleton = encoding.flatten(state, _SHARED)
        flat = {**shared, _SHARED_SKELETON: skeleton}
        rank = self.context.rank
        own, own_skeleton = encoding.flatten(rank_state, _rank_prefix(rank))
        ranks = {rank: {**own, _rank_skeleton(rank): own_skeleton}}
        if self.node_local:  # every node keeps every rank's own state
            gathered: list[Any] = [None] * self.context.world_size
            dist.all_gather_object(gathered, {key: _host_copy(t) for key, t in ranks[rank].items()}, group=self._group)
            ranks = dict(enumerate(gathered))
        for part in ranks.values():
            flat.update(part)
        return flat

    def _write(self, step: int, flat: dict[str, torch.Tensor]) -> None:
        """Writes, verifies and commits; on every rank (in the writing thread with async_save)."""
        dcp = _dcp()
        if self.context.device.type == "cuda":  # a thread starts on GPU 0: DCP would make a context there
            torch.cuda.set_device(self.context.device)
        staging = self.directory / folder.staging_name(step)
        error: BaseException | None = None
        try:
            if self._writes_files:
                folder.remove_staging(self.directory)
                staging.mkdir()
            self._barrier()
            if self._writes_files or not self._alone:
                dcp.save(
                    flat, storage_writer=dcp.FileSystemWriter(staging), process_group=self._group, no_dist=self._alone
                )
        except (Exception, dcp.api.CheckpointException) as caught:
            error = caught
        if error is not None and self.context.healing is not None and raised_by_a_collective(error):
            raise error  # a peer failed: the group is broken, and the ranks heal (its own collectives could hang)
        failures = self._all(describe(error, self.directory))
        if not any(failures):
            failures = self._all(describe(self._commit(step, staging), self.directory))
        failed = next((f for f in failures if f is not None), None)
        if failed is not None:
            if self._writes_files:
                folder.remove_staging(self.directory)
            kept = folder.committed(self.directory)
            raise not_saved(
                self.directory / folder.committed_name(step), failed, self.keep, kept[0][1] if kept else None
            )
        if self._writes_files:
            folder.prune(self.directory, self.keep)
            last_step.prune(self.directory, step)
        self._barrier()

    def _commit(self, step: int, staging: Path) -> Exception | None:
        """Checks the files between the ranks, then the writing rank writes the marker and renames."""
        try:
            facts = self._facts(staging)
            if self._writes_files:
                marker = {
                    "step": step,
                    "world_size": self.context.world_size,
                    "node_local": self.node_local,
                    "files": facts,
                }
                folder.write_marker(staging, marker)
                folder.commit(staging, step)
        except Exception as error:
            return error
        return None

    def _facts(self, checkpoint: Path) -> dict[str, dict[str, int]]:
        """Size and CRC-32 of every file: each reader of the folder takes its share of the files."""
        readers, me = self._readers()
        mine: dict[str, dict[str, int]] | OSError = {}
        try:
            if me is not None:
                mine = {
                    name: folder.file_facts(checkpoint / name) for name in folder.data_files(checkpoint)[me::readers]
                }
        except OSError as error:  # still joins the collective below: no rank is left waiting in it
            mine = error
        parts = [mine] if self.node_local else self._all(mine)  # node-local: each node's copy is its first process's
        facts: dict[str, dict[str, int]] = {}
        for part in parts:
            if isinstance(part, OSError):
                raise part
            facts.update(part)
        return facts

    # -- loading ------------------------------------------------------------------------------

    def load_latest(self, into: dict[str, Any] | None = None) -> Checkpoint | None:
        """The newest checkpoint that checks out, or None when there is none; a collective.

        Args:
            into: the state as :meth:`save` takes it, or part of it, whose tensors the saved
                values are loaded into in place (a model's ``state_dict()``): no second copy of
                the model is made. Tensors it lacks (an optimizer's, before its first step) are
                made.

        Returns:
            The checkpoint, the same step on every rank. A damaged one (missing or truncated
            files, a CRC mismatch, a marker of another format) is said, renamed ``*.damaged``
            and the previous one tried.

        Raises:
            SettingsRefused: node-local folders that share no complete checkpoint while some
                node has one (a node's folder was emptied or is new): resuming there would start
                that node over.
        """
        self.wait()
        steps = sorted({step for found in self._all([s for s, _ in folder.committed(self.directory)]) for step in found},
                       reverse=True)  # fmt: skip
        kept = self._load_last_step(steps[0] if steps else -1, into)
        if kept is not None:
            return kept
        leaders = self._all(self._readers()[1] == 0)
        somewhere, set_aside = None, 0
        for step in steps:
            path = self.directory / folder.committed_name(step)
            mine = self._problem_with(path)
            problems = self._all(mine)
            if not any(problems):
                return self._load(step, path, into)
            _refuse_unreadable(path, problems)
            if self.node_local and None in [p for p, leader in zip(problems, leaders) if leader]:
                somewhere = somewhere or step  # whole on some nodes, not on all
            damaged = mine if self.node_local else next(filter(None, problems))
            if damaged not in (None, _MISSING):
                set_aside += 1
                if self._writes_files:
                    where = folder.set_aside(path)
                    print(f"phalanx: checkpoint {path} is damaged ({damaged}); {where}, trying the previous one",
                          file=sys.stderr, flush=True)  # fmt: skip
            self._barrier()
        if somewhere is not None:
            raise SettingsRefused(
                f"checkpoint step {somewhere} is complete in the checkpoint folders of some nodes but not of others "
                f"(this node's: {self.directory})",
                "the nodes do not share that folder, so each keeps a copy; a node without one cannot resume with the "
                "others.",
                "copy the newest step-* folder to the nodes that lack it, or give a folder every node sees",
            )
        if set_aside and self.context.rank == 0:  # the damaged ones are kept (*.damaged): nothing is deleted
            print(f"phalanx: WARNING: none of the {set_aside} checkpoint(s) in {self.directory} checks out (each was "
                  "set aside as *.damaged, kept); training starts from step 0", file=sys.stderr, flush=True)  # fmt: skip
        return None

    def _load_last_step(self, newest_committed: int, into: dict[str, Any] | None) -> Checkpoint | None:
        """The state survivors kept after a failure, where newer than every committed
        checkpoint (:meth:`save_last_step`); a collective. A rank whose folder lacks it (a
        node's own folder, a replaced node) gets it from a rank that has it."""
        listed = sorted({tuple(kept) for found in self._all([k for k in last_step.kept(self.directory)
                                                               if k[0] > newest_committed]) for kept in found})  # fmt: skip
        # The newest state's launch failed last; its survivors are at most one step apart (every
        # step all-reduces), and the lower step is one every rank completed.
        launch = listed[-1][1] if listed else 0
        failure = [step for step, of in listed if of == launch]
        if len(failure) > 1 and self.context.rank == 0:
            print(f"phalanx: survivors kept the state after step {failure[0]} and after step {failure[1]}; resuming "
                  f"after step {failure[0]}, which every rank completed", file=sys.stderr, flush=True)  # fmt: skip
        template = encoding.flatten(into, _SHARED)[0] if into else {}
        for step in failure:
            path = last_step.path_of(self.directory, step, launch)
            header, flat, problem = _read_last_step(path, step, template)
            problems = self._all(problem)
            _refuse_unreadable(path, problems)
            holders = [rank for rank, found in enumerate(problems) if found is None]
            if holders:
                if len(holders) < len(problems):
                    sent = [(header, flat)]
                    dist.broadcast_object_list(sent, src=holders[0], group=self._group)
                    header, flat = sent[0]
                state = encoding.unflatten(flat[_SHARED_SKELETON], flat.__getitem__)
                return Checkpoint(step, path, state, None, header["world_size"], survivor=True)
            if self._writes_files and problem not in (None, _MISSING):
                print(f"phalanx: the state a survivor kept after step {step}, {path}, does not check out ({problem}); "
                      f"{folder.set_aside(path)}", file=sys.stderr, flush=True)  # fmt: skip
            self._barrier()
        if failure and self.context.rank == 0:
            print(f"phalanx: WARNING: no state a survivor kept after a failure checks out; resuming from the newest "
                  f"checkpoint instead, so the steps after it and up to step {failure[-1]} are trained again",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None

    def _problem_with(self, path: Path) -> str | None:
        """Why this rank's share of a checkpoint does not check out, or None."""
        readers, me = self._readers()
        if me is None:
            return None
        if not (path / folder.MARKER).is_file():
            return _MISSING
        try:
            marker = folder.read_marker(path)
        except (ValueError, OSError) as error:
            return f"its marker {folder.MARKER} is not readable: {error}"
        try:
            listed, present = set(marker["files"]), set(folder.data_files(path))
            if gone := listed - present:
                return f"{_named(gone)} listed by its marker {folder.MARKER} {'are' if len(gone) > 1 else 'is'} missing"
            if present - listed and me == 0:  # an NFS .nfsXXXX, a note: not the checkpoint's, and not read
                print(f"phalanx: checkpoint {path} holds {_named(present - listed)} that its marker does not list: "
                      "not phalanx's, left in place and not loaded", file=sys.stderr, flush=True)  # fmt: skip
            for name in sorted(marker["files"])[me::readers]:
                if folder.file_facts(path / name) != marker["files"][name]:
                    return f"{name} is truncated or altered (size or CRC-32 differs from its marker)"
            _safe_reader(path).read_metadata()
        except pickle.UnpicklingError as error:
            return f"its {folder.DCP_METADATA} is not DCP's metadata ({error})"
        except OSError as error:  # returned, not raised: every rank joins the collective that compares
            return f"{_UNREADABLE}: {error.strerror or error}"
        except (KeyError, TypeError, ValueError) as error:
            return f"its marker {folder.MARKER} is not one this version writes ({type(error).__name__}: {error})"
        return None

    def _load(self, step: int, path: Path, into: dict[str, Any] | None) -> Checkpoint:
        dcp = _dcp()
        marker = folder.read_marker(path)
        rank, same_world = self.context.rank, marker["world_size"] == self.context.world_size
        stored = _safe_reader(path).read_metadata().state_dict_metadata
        wanted = [key for key in stored if key.startswith(_SHARED + "/") or key == _SHARED_SKELETON]
        if same_world:
            wanted += [key for key in stored if key.startswith(_rank_prefix(rank) + "/") or key == _rank_skeleton(rank)]
        template = encoding.flatten(into, _SHARED)[0] if into else {}
        flat = {key: _destination(template.get(key), stored[key]) for key in wanted}
        dcp.load(flat, storage_reader=_safe_reader(path), process_group=self._group, no_dist=self._alone)
        state = encoding.unflatten(flat[_SHARED_SKELETON], flat.__getitem__)
        own = encoding.unflatten(flat[_rank_skeleton(rank)], flat.__getitem__) if same_world else None
        return Checkpoint(step, path, state, own, marker["world_size"])

    # -- who does what ------------------------------------------------------------------------

    @property
    def _alone(self) -> bool:
        """Whether DCP runs in this process alone: one process, or node-local folders."""
        return self.node_local or not self._distributed

    @property
    def _writes_files(self) -> bool:
        """This rank commits, prunes and sets aside: rank 0, or each node's first with node-local folders."""
        return self.context.local_rank == 0 if self.node_local else self.context.rank == 0

    def _readers(self) -> tuple[int, int | None]:
        """(how many ranks check a folder's files, this rank's index among them or None)."""
        if self.node_local:
            return 1, 0 if self.context.local_rank == 0 else None
        return self.context.world_size, self.context.rank

    def _check_folder(self) -> tuple[str, str, str] | None:
        try:
            folder.check_folder(self.directory)
        except SettingsRefused as refused:
            return refused.what, refused.why, refused.hint
        return None

    def _one_folder(self) -> bool:
        """Whether every rank sees the same folder: rank 0 leaves a file, the others look for it."""
        token = self._all(uuid.uuid4().hex)[0]
        probe = self.directory / f".phalanx-shared-{token}"
        if self.context.rank == 0:
            probe.touch()
        self._barrier()
        seen = self._all(probe.exists())
        if self.context.rank == 0:
            probe.unlink(missing_ok=True)
        return all(seen)

    def _regroup(self) -> None:
        """The job's group was formed again (a heal): the checkpoint group too, on every rank."""
        self._group = dist.new_group(backend="gloo")

    def _release_group(self) -> None:
        """A heal leaves the broken group: the checkpoint group of it is freed with it (a peer
        waiting in a save's collective on this rank then learns that it left)."""
        self._group = None

    def joined(self, node_local: bool) -> None:
        """A replacement rank healed: whether the folders are node-local, as its peers found."""
        self.node_local = node_local

    def _all(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (over the checkpoint group)."""
        if not self._distributed:
            return [value]
        gathered: list[Any] = [None] * self.context.world_size
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)


_MISSING = "missing"
#: How a problem of a checkpoint that could not be read begins: not damage, so not set aside.
_UNREADABLE = "it cannot be read"


def _refuse_unreadable(path: Path, problems: list[str | None]) -> None:
    """A file that could not be read may be whole: nothing older is tried."""
    unreadable = next((p for p in problems if p and p.startswith(_UNREADABLE)), None)
    if unreadable is not None:
        raise SettingsRefused(f"checkpoint {path}: {unreadable}", "it may be whole: it is left as it is, and "
                              "nothing older is tried (that would throw away the newer training).",
                              "check the folder's permissions and its file system, then run the same command "
                              "again")  # fmt: skip


def _read_last_step(path: Path, step: int, template: dict[str, torch.Tensor]) -> tuple[Any, Any, str | None]:
    """(header, flat state, None), or (None, None, why this rank cannot use the file)."""
    if not path.is_file():
        return None, None, _MISSING
    try:
        header, flat = last_step.read(path, step)
    except last_step.Damaged as damaged:
        return None, None, str(damaged)
    except OSError as error:
        return None, None, f"{_UNREADABLE}: {error.strerror or error}"
    for key, tensor in template.items():  # the model and optimizer of this script, or another's
        stored = flat.get(key)
        if stored is not None and (stored.shape != tensor.shape or stored.dtype != tensor.dtype):
            return None, None, (f"it is of another model or job: {key} is {tuple(stored.shape)} {stored.dtype} there, "
                                f"{tuple(tensor.shape)} {tensor.dtype} here")  # fmt: skip
    if _SHARED_SKELETON not in flat or any(key not in flat for key in template if key.startswith(f"{_SHARED}/model/")):
        return None, None, "it is of another model or job: this model's parameters are not all in it"
    return header, flat, None


def _safe_reader(path: Path) -> Any:
    """DCP's reader with a metadata file that cannot run code (:mod:`.reader`), imported with DCP."""
    from phalanx.runtime.checkpoint.reader import SafeReader

    return SafeReader(path)


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported at the first save or load: it imports DTensor,
    which a process that only imports phalanx.runtime (a worker's exit handler) should not pay for."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.api

    return torch.distributed.checkpoint


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory, one copy: pinned for a tensor on a GPU (a faster transfer)."""
    if tensor.is_cuda:
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor.detach())
    return tensor.detach().clone()


def _destination(tensor: torch.Tensor | None, stored: Any) -> torch.Tensor:
    """Where a stored tensor is loaded: the template's own tensor when it fits, else a new one."""
    properties = stored.properties
    if tensor is not None and tuple(tensor.shape) == tuple(stored.size) and tensor.dtype == properties.dtype:
        return tensor
    return torch.empty(tuple(stored.size), dtype=properties.dtype)


def _named(names: set[str]) -> str:
    """'the file a', 'the files a, b', at most five named."""
    shown = sorted(names)
    listed = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    return f"the file{'s' if len(shown) > 1 else ''} {listed}"


def _listed_bytes(checkpoint: Path) -> int:
    """The bytes of a checkpoint's files, as its marker lists them (0 where it cannot be read)."""
    try:
        return sum(int(facts["size"]) for facts in folder.read_marker(checkpoint)["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
