"""One command per host of a bed, started at once and bounded by one deadline: how a multi-node
job is started by hand on every host, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def phalanx_argv(*args: str) -> list[str]:
    """The argv of ``phalanx ARGS`` with this Python, as each host of a bed runs it.

    Example:
        >>> phalanx_argv("run", "--nnodes", "2", "train.py")[1:]
        ['-m', 'phalanx', 'run', '--nnodes', '2', 'train.py']
    """
    return [sys.executable, "-m", "phalanx", *args]


@dataclass
class Outcome:
    """How one host's command ended."""

    returncode: int | None  # None: still running at the deadline, then killed
    output: str  # stdout and stderr, interleaved
    seconds: float  # from the start of all the commands to its end


def run_together(
    commands: Sequence[Sequence[str]], timeout: float, cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Outcome]:  # fmt: skip
    """Starts every command at once, each in a process group of its own; one :class:`Outcome` each.

    Whatever still runs ``timeout`` seconds after the start is killed with its whole group, and so
    is whatever a command left running behind it: nothing outlives the call. On a test bed, each
    argv is ``host.command(line)`` with the same ``line`` for every host.

    Example:
        >>> outcomes = run_together([["sh", "-c", "echo one"], ["sh", "-c", "exit 3"]], timeout=10)
        >>> [(o.returncode, o.output) for o in outcomes]
        [(0, 'one\\n'), (3, '')]
    """
    started = time.monotonic()
    processes = [
        subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)
        for argv in commands
    ]  # fmt: skip
    outcomes: list[Outcome | None] = [None] * len(processes)

    def wait_for(index: int, process: subprocess.Popen[str]) -> None:
        # One thread per command: each pipe is read as it fills, so no chatty host blocks on
        # its output while another is waited for.
        try:
            output, _ = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            output, _ = process.communicate()
            code = None
        outcomes[index] = Outcome(code, output, time.monotonic() - started)

    waiters = [threading.Thread(target=wait_for, args=item, daemon=True) for item in enumerate(processes)]
    try:
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join()
    finally:
        for process in processes:
            signal_group(process, signal.SIGKILL)
            if process.poll() is None:
                process.wait()
    return [outcome for outcome in outcomes if outcome is not None]


def signal_group(process: subprocess.Popen[Any], signum: int) -> None:
    """Sends ``signum`` to the process group that ``process`` leads, while there is one."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
