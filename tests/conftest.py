"""Shared fixtures: run phalanx as a real process with a hard timeout, and fail on leftovers."""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
#: The small training programs the tests run as workers.
WORKERS = REPO / "tests" / "e2e" / "workers"


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, `kill`) ends the session as Ctrl-C does: fixtures tear down, so
    test beds, daemons and their processes are removed instead of left running."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs two pytest-xdist workers (`--dist loadgroup`); the tests that make test
    beds run on one of them, one at a time: a bed takes the first subnet that no route uses, and
    two beds made at the same moment could take the same one."""
    for item in items:
        if item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.xdist_group("netns"))


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_command(argv: list[str], *, timeout: float, cwd: Path, env: dict[str, str] | None = None) -> Completed:
    """Runs argv in a session of its own; on timeout the whole process group is killed."""
    process = subprocess.Popen(
        argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    return finish(process, timeout)


def finish(process: subprocess.Popen[str], timeout: float) -> Completed:
    """Waits for a process started in a session of its own; fails the test, its group killed, if
    it does not end within ``timeout``. ``seconds`` counts from this call."""
    started = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{process.args} did not finish within {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finally:
        kill_group(process.pid)
    return Completed(process.returncode, stdout, stderr, time.monotonic() - started)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_RECORDER_PROBE = """
import os, pickle, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeCollectives=False, includeStackTraces=False))
dist.destroy_process_group()  # a group left to the interpreter's exit can abort it (torch 2.14.1)
print(bool(dump["pg_config"]))
"""


@functools.cache
def gloo_flight_recorder_on() -> bool:
    """Whether this torch's flight recorder, as the release sets it up (TORCH_FR_BUFFER_SIZE
    unset), records gloo's process groups: 2.13 does, 2.10 does not. Asked of torch itself, in a
    process of its own."""
    env = {key: value for key, value in os.environ.items() if key != "TORCH_FR_BUFFER_SIZE"}
    probe = subprocess.run([sys.executable, "-c", _RECORDER_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.split()[-1] == "True"


def phalanx_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *args]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder for one test's scripts and logs; any process still naming it afterwards is a leak."""
    yield tmp_path
    deadline = time.monotonic() + 10
    while True:
        leaked = [
            p for p in psutil.process_iter(["pid", "cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for process in leaked:
        process.kill()
    assert not leaked, f"processes left behind: {[(p.pid, p.info['cmdline']) for p in leaked]}"


@pytest.fixture
def phalanx(workdir: Path):
    """Runs `python -m phalanx ARGS` in the test's folder with a hard timeout."""

    def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Completed:
        return run_command(phalanx_argv(*args), timeout=timeout, cwd=workdir, env=env)

    return run


@pytest.fixture(scope="session")
def train_example():
    """examples/train.py as a module (it is a script, not in a package): its Reporter, its parser."""
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_script(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path
