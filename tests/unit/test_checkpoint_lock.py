"""The checkpoint folder's lock, in one process: whose lock is respected, and whose is taken over.
Two real jobs on one folder: tests/e2e/test_runtime.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil

from phalanx.runtime.checkpoint import lock as lock_module
from phalanx.runtime.checkpoint.lock import LOCK_NAME, STALE_S, FolderLock, Holder, this_job


def holder(job: str, *, host: str | None = None, pid: int | None = None) -> Holder:
    pid = os.getpid() if pid is None else pid
    started = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else 1.0
    return Holder(job, host or socket.gethostname(), pid, started)


def plant(folder, lock_holder: Holder) -> None:
    (folder / LOCK_NAME).write_text(json.dumps(lock_holder.__dict__))


def held_by(folder) -> str:
    return json.loads((folder / LOCK_NAME).read_text())["job"]


def test_a_free_folder_is_taken_and_released(tmp_path):
    lock = FolderLock(tmp_path, holder("mine"))
    assert lock.take() is None and held_by(tmp_path) == "mine"
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_same_job_takes_its_own_lock_again(tmp_path, capsys):
    plant(tmp_path, holder("mine", pid=os.getppid()))  # the same job from an earlier start of its workers
    assert FolderLock(tmp_path, holder("mine")).take() is None
    assert "taking over" not in capsys.readouterr().err


def test_another_live_job_on_this_host_is_respected(tmp_path):
    plant(tmp_path, holder("theirs", pid=os.getppid()))  # a process that runs: pytest's parent
    refusal = FolderLock(tmp_path, holder("mine")).take()
    assert refusal is not None and held_by(tmp_path) == "theirs"
    what, why, hint = refusal
    assert f"is in use by another job: job theirs, on host {socket.gethostname()}, launcher PID {os.getppid()}," in what
    assert "overwrite each other's steps" in why and str(tmp_path / LOCK_NAME) in hint


def test_a_gone_job_on_this_host_is_taken_over_and_said(tmp_path, capsys):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    plant(tmp_path, holder("theirs", pid=ended.pid))
    assert FolderLock(tmp_path, holder("mine")).take() is None
    assert held_by(tmp_path) == "mine"
    assert (
        f"taking over the lock of a job that is gone (job theirs, on host {socket.gethostname()}, launcher PID {ended.pid},"
        in capsys.readouterr().err
    )


def test_a_reused_pid_is_not_the_holder(tmp_path):
    plant(tmp_path, Holder("theirs", socket.gethostname(), os.getppid(), 1.0))  # that PID, but another start
    assert FolderLock(tmp_path, holder("mine")).take() is None


def test_another_hosts_holder_is_alive_while_it_refreshes_the_lock(tmp_path):
    plant(tmp_path, holder("theirs", host="elsewhere", pid=123))
    assert FolderLock(tmp_path, holder("mine")).take() is not None
    long_ago = time.time() - STALE_S - 5
    os.utime(tmp_path / LOCK_NAME, (long_ago, long_ago))
    assert FolderLock(tmp_path, holder("mine")).take() is None and held_by(tmp_path) == "mine"


def test_an_unreadable_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"\xff not json")
    assert FolderLock(tmp_path, holder("mine")).take() is None and held_by(tmp_path) == "mine"


def test_a_job_is_named_by_its_rendezvous_and_its_launcher():
    """phalanx run names the job by its rendezvous ID and endpoint, which stay when a round moves
    the store's address (an elastic change) or torchrun picks a new port; plain torchrun's
    variables name it otherwise."""
    env = {"TORCHELASTIC_RUN_ID": "train", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "PHALANX_LAUNCHER_PID": str(os.getppid())}  # fmt: skip
    me = this_job(env)
    assert me.job == "'train' at 10.0.0.1:29400" and me.pid == os.getppid()
    assert this_job({**env, "PHALANX_JOB": "'train' at 10.0.0.9:29500"}).job == "'train' at 10.0.0.9:29500"
    alone = this_job({})
    assert alone.job == f"of process {os.getpid()}" and alone.pid == os.getpid()


def test_a_lock_put_in_place_while_a_gone_one_is_taken_over_is_respected(tmp_path, monkeypatch):
    """Job B judged the lock of a gone job; before B renamed it away, a live job put its own in
    place. B must put that one back and be refused, not delete it."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    plant(tmp_path, holder("gone", pid=ended.pid))
    live = holder("live", pid=os.getppid())
    read = lock_module._read

    def read_then_race(path):
        found = read(path)
        if path.name == LOCK_NAME and found is not None and found.job == "gone":
            plant(tmp_path, live)  # the other job's takeover lands between B's read and B's rename
        return found

    monkeypatch.setattr(lock_module, "_read", read_then_race)
    refusal = FolderLock(tmp_path, holder("mine")).take()
    assert refusal is not None and "job live" in refusal[0]
    assert held_by(tmp_path) == "live"
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # nothing of B's left
