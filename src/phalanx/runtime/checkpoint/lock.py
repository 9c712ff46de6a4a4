"""One job per checkpoint folder: a lock file that names its holder.

A job that finds the lock of another job still alive is refused; a lock whose holder is gone is
taken over, and that is said. Races are closed by link and rename, not by timing
(docs/runtime-design.md).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from phalanx.worker_env import WorkerEnv, job_name

LOCK_NAME = "phalanx.lock"
REFRESH_S = 30.0
STALE_S = 120.0


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint folder."""

    job: str  # the same on every rank and every restart of one job
    host: str
    pid: int  # the launcher's (phalanx run's, torchrun's agent's), else the process's own
    started: float  # that process's start, seconds since the epoch (a PID can be reused)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"job {self.job}, on host {self.host}, launcher PID {self.pid}, started {since}"

    def same_job(self, other: Holder) -> bool:
        """One job: the same rendezvous, or the same launcher (whose workers restarted)."""
        return self.job == other.job or (self.host, self.pid, self.started) == (other.host, other.pid, other.started)

    def alive(self, lock: Path) -> bool:
        if self.pid <= 0:  # an unreadable lock: no holder to wait for
            return False
        if self.host != socket.gethostname():
            try:
                return time.time() - lock.stat().st_mtime < STALE_S
            except OSError:
                return False
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.Error:
            return False


def this_job(environ: Mapping[str, str] = os.environ) -> Holder:
    """The holder this process writes: its job (as phalanx run names it, else as torchrun's
    variables do: one node's store port stays for the whole launch), and its launcher."""
    worker = WorkerEnv.from_env(environ)
    if worker.job:
        job = worker.job
    elif "MASTER_PORT" in environ:
        job = job_name(
            environ.get("TORCHELASTIC_RUN_ID", ""), f"{environ.get('MASTER_ADDR', '')}:{environ['MASTER_PORT']}"
        )
    else:
        job = f"of process {os.getpid()}"
    launcher = worker.launcher_pid or (os.getppid() if "TORCHELASTIC_RUN_ID" in environ else os.getpid())
    try:
        started = psutil.Process(launcher).create_time()
    except psutil.Error:
        launcher, started = os.getpid(), psutil.Process().create_time()
    return Holder(job, socket.gethostname(), launcher, started)


def _link_or_create(written: Path, lock: Path) -> None:
    """Puts ``written`` in place as ``lock`` whole; FileExistsError where ``lock`` exists. A file
    system without hard links gets an exclusive create, then the text."""
    try:
        os.link(written, lock)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network and FUSE file systems)
        descriptor = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(written.read_text())


def _read(lock: Path) -> Holder | None:
    try:
        data = json.loads(lock.read_text())
        return Holder(str(data["job"]), str(data["host"]), int(data["pid"]), float(data["started"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # damaged or foreign: no holder to respect
        return Holder("(unreadable)", "", 0, 0.0)


class FolderLock:
    """The lock of one checkpoint folder, taken by :meth:`take` and held while the process runs."""

    def __init__(self, directory: Path, me: Holder | None = None) -> None:
        self.path = directory.absolute() / LOCK_NAME  # the refresh and the release outlive a chdir
        self.me = me or this_job()
        self._stop = threading.Event()

    def take(self) -> tuple[str, str, str] | None:
        """Takes the lock; returns a refusal (what, why, hint) when another live job holds it."""
        try:
            refusal = self._take()
        except OSError as error:
            return (f"the checkpoint folder {self.path.parent} cannot hold its lock ({error.strerror or error})",
                    "the lock keeps a second job from writing into the same folder.",
                    "give a checkpoint folder this user can write, on a disk with room")  # fmt: skip
        if refusal is None:
            threading.Thread(target=self._refresh, name="phalanx-checkpoint-lock", daemon=True).start()
            atexit.register(self.release)
        return refusal

    def _take(self) -> tuple[str, str, str] | None:
        """Linked into place whole (link(2) fails where the name exists): of two jobs, one creates
        it. A gone holder's lock is first renamed away: of two jobs taking it over, one renames it,
        the other finds it gone and starts again."""
        written = self.path.with_name(f".{LOCK_NAME}.{socket.gethostname()}.{os.getpid()}")
        written.write_text(json.dumps(asdict(self.me)))
        try:
            for _ in range(3):
                with contextlib.suppress(FileExistsError):
                    _link_or_create(written, self.path)
                    return None
                holder = _read(self.path)
                if holder is None:
                    continue
                if holder.same_job(self.me):
                    return None
                if holder.alive(self.path):
                    return self._refusal(holder)
                gone = written.with_name(written.name + ".gone")
                try:
                    os.rename(self.path, gone)
                except FileNotFoundError:
                    continue  # another job took it over first: its lock is read next time round
                if _read(gone) != holder:  # another job's, put in place since it was read: back, and look again
                    with contextlib.suppress(FileExistsError):
                        _link_or_create(gone, self.path)
                    gone.unlink()
                    continue
                gone.unlink()
                print(f"phalanx: checkpoint folder {self.path.parent}: taking over the lock of a job that is gone "
                      f"({holder.describe()})", file=sys.stderr, flush=True)  # fmt: skip
            holder = _read(self.path)
            if holder is not None:
                return self._refusal(holder)
            return (f"the lock of the checkpoint folder {self.path.parent} changed three times while this job took it",
                    "other jobs are starting on the same folder at this moment.",
                    "give this job a checkpoint folder of its own")  # fmt: skip
        finally:
            written.unlink(missing_ok=True)

    def release(self) -> None:
        """Removes the lock if it is still this job's (the job ended)."""
        self._stop.set()
        if _read(self.path) == self.me:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _refusal(self, holder: Holder) -> tuple[str, str, str]:
        return (
            f"the checkpoint folder {self.path.parent} is in use by another job: {holder.describe()}",
            "two jobs in one folder delete each other's saves in progress and overwrite each other's steps.",
            f"give this job a checkpoint folder of its own, or stop the other job first (if it is gone, remove {self.path})",
        )
