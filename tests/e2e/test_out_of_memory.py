"""A worker that ran out of memory is named as such: the kernel's out-of-memory killer in the
kernel's own words, a full /dev/shm with its remedy.

The failures are real: the worker (or its DataLoader's worker) joins a memory cgroup of 64 MiB
made for the test and fills memory past it, or hands batches over through a /dev/shm of 1 MiB.
Needs root, and for the first a memory cgroup this process can make a child of (CI runs as root
on such a machine); skipped elsewhere, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.testbed import phalanx_argv
from tests.conftest import WORKERS, run_command

LIMIT_BYTES = 64 * 1024**2
#: One test at a time: the kernel's count of kills is the whole machine's.
pytestmark = pytest.mark.xdist_group("out_of_memory")


def _own_memory_cgroup() -> Path | None:
    """This process's memory cgroup folder: cgroup v1's memory controller, or v2's unified tree."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    unified = [
        line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
    ]
    return Path("/sys/fs/cgroup") / unified[0].lstrip("/") if unified else None


@pytest.fixture
def memory_cgroup():
    """A child cgroup of this process's memory cgroup limited to 64 MiB (no swap), removed after."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root (CI runs as root)")
    parent = _own_memory_cgroup()
    if parent is None or not parent.is_dir():
        pytest.skip("this machine has no memory cgroup to make a child of")
    folder = parent / f"phalanx-test-oom-{os.getpid()}"
    limits = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max", "memory.swap.max"]
    try:
        folder.mkdir()
        written = [name for name in limits if (folder / name).exists()]
        for name in written:
            (folder / name).write_text("0" if name == "memory.swap.max" else str(LIMIT_BYTES))
    except OSError as error:
        written, why = [], f"cannot make a memory cgroup under {parent}: {error}"
    else:
        why = f"{folder} has no memory limit to set"
    if not written:
        if folder.is_dir():
            folder.rmdir()
        pytest.skip(why)
    try:
        yield folder
    finally:
        deadline = time.monotonic() + 10
        while True:  # the killed processes leave it as they are reaped
            try:
                folder.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _kernel_log_readable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def test_a_worker_the_kernel_killed_for_memory_is_named_with_the_kernels_words(phalanx, workdir, memory_cgroup):
    shutil.copy(WORKERS / "over_memory.py", workdir)
    done = phalanx("run", "--nproc-per-node", "1", "over_memory.py", "worker", str(memory_cgroup), timeout=120)
    assert done.returncode == 1, done.output[-3000:]
    assert "phalanx: root cause: rank 0 (local rank 0)" in done.output and "was killed by SIGKILL" in done.output
    assert "not killed" not in done.output, done.output[-3000:]
    if _kernel_log_readable():
        assert re.search(r"the kernel's out-of-memory killer ended it: .*Killed process \d+ \(python", done.output)
    else:
        assert re.search(r"most likely the kernel's out-of-memory killer: it ended \d+ process", done.output)
    assert "HINT: give each worker less to hold" in done.output, done.output[-3000:]


def test_a_dataloader_worker_the_kernel_killed_is_named_too(phalanx, workdir, memory_cgroup):
    if not _kernel_log_readable():
        pytest.skip("only the kernel's log names the process it killed, and /dev/kmsg cannot be read here")
    shutil.copy(WORKERS / "over_memory.py", workdir)
    done = phalanx("run", "--nproc-per-node", "1", "over_memory.py", "dataloader", str(memory_cgroup), timeout=120)
    assert done.returncode == 1, done.output[-3000:]
    named = re.search(
        r"the kernel's out-of-memory killer ended its process (\d+): .*Killed process (\d+) ", done.output
    )
    assert named and named.group(1) == named.group(2), done.output[-3000:]
    assert re.search(rf"DataLoader worker \(pid\(s\) {named.group(1)}\) exited unexpectedly", done.output)
    assert "HINT: give each worker less to hold" in done.output


def test_heal_modes_supervisor_says_so_at_each_replacement(workdir, memory_cgroup):
    """--heal's supervisor replaces a failed worker in place (its launcher never sees the kill):
    it names the kernel's kill at each failure. Run here as its own process, with one replacement."""
    shutil.copy(WORKERS / "over_memory.py", workdir)
    supervise = (
        "import sys; from phalanx.launch.supervisor import Supervisor; sys.exit(Supervisor(sys.argv[1:], 1).run())"
    )
    restarts = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"}  # as torch's agent sets them
    done = subprocess.run([sys.executable, "-c", supervise, "over_memory.py", "worker", str(memory_cgroup)],
                          cwd=workdir, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **restarts})  # fmt: skip
    assert done.returncode == 137, done.stderr[-3000:]
    why = "the kernel's out-of-memory killer ended it: " if _kernel_log_readable() else "most likely the kernel's"
    replaced = "phalanx: the script failed (exit code 137); starting replacement 1 of this rank"
    assert f"{replaced}, which joins the surviving ranks\n  {why}" in done.stderr, done.stderr[-3000:]
    allowed = (
        "phalanx: the script failed (exit code 137) and this rank was replaced 1 time(s) already, as many as allowed"
    )
    restart = "the launcher (1 of --max-restarts 2 left on this node)"
    assert f"{allowed}: leaving it to {restart}\n  {why}" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("HINT: give each worker less to hold") == 2


def test_a_dataloader_worker_out_of_shared_memory_gets_the_remedy(workdir):
    """The worker runs in a mount namespace whose /dev/shm is a tmpfs of 1 MiB (Docker gives
    64 MiB): its DataLoader worker's batch of 8 MiB cannot go there (torch reserves the room and
    fails with ENOSPC, as torch 2.13 does here)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a /dev/shm of its own needs root and util-linux's unshare (CI runs as root)")
    shutil.copy(WORKERS / "shm_batches.py", workdir)
    small = 'mount -t tmpfs -o size=1m phalanx-test-shm /dev/shm && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", small, "sh",
            *phalanx_argv("run", "--nproc-per-node", "1", "shm_batches.py")]  # fmt: skip
    done = run_command(argv, timeout=120, cwd=workdir)
    assert done.returncode == 1, done.output[-3000:]
    assert "unable to allocate shared memory(shm)" in done.output and "batch of" not in done.output, done.output[-3000:]
    assert "HINT: /dev/shm on that node is full or too small (`df -h /dev/shm` shows it" in done.output
    assert "docker run --shm-size=16g" in done.output
