"""The launcher's side of a keep request: before it stops workers that wait for a lost node, each
rank gets to keep its state, at most :data:`KEEP_BOUND_S` (docs/launch-design.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from phalanx.worker_env import keep_report_of

#: At most this long, the ranks that were asked get to keep their state before they are stopped.
KEEP_BOUND_S = 60.0
_POLL_S = 0.1


def ask_to_keep(requests: Iterable[Path], why: str) -> list[Path]:
    """Writes ``why`` on every keep request a rank listens on; returns those written.

    A FIFO nobody reads (a script without phalanx.Run, a rank that ended) cannot be opened for
    writing without blocking, so it is passed over (ENXIO), as is one that is not there.
    """
    asked = []
    for request in requests:
        try:
            fd = os.open(request, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, why.encode()[:4096])  # one write of at most PIPE_BUF: read whole
            asked.append(request)
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def wait_for_reports(asked: list[Path], workers: list[psutil.Process], timeout: float = KEEP_BOUND_S) -> None:
    """Waits until every rank asked has written its keep report, or no worker is left, or
    ``timeout`` seconds passed. A worker that ended is not reaped here: torch's agent must still
    read its exit status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(keep_report_of(request).exists() for request in asked) or not any(map(running, workers)):
            return
        time.sleep(_POLL_S)


def read_report(request: Path) -> str | None:
    """The keep report of the rank whose request is ``request``; None where it wrote none."""
    try:
        return keep_report_of(request).read_text(errors="replace").strip() or None
    except OSError:
        return None


def running(process: psutil.Process) -> bool:
    """Whether ``process`` runs (a zombie does not: a pod's PID 1 may leave them)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
