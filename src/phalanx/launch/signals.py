"""Signals between a launcher and the processes it starts: they die with it, and SIGUSR1/SIGUSR2
are passed on to them (docs/launch-design.md)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import psutil

from phalanx.worker_env import WorkerEnv

_PR_SET_PDEATHSIG = 1

#: Signals a launcher passes on to its child processes and otherwise ignores.
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)


def pass_on(signum: int, _frame: FrameType | None = None) -> None:
    """Sends ``signum`` to every child process of this one (a node agent's workers, a
    simulation's node agents); one that is gone already is skipped. With no child yet (the nodes
    are still meeting), it is kept in the environment the children will inherit, where the
    workers' PreemptionGuard finds it (WorkerEnv.early_signal)."""
    children = psutil.Process().children(recursive=False)
    if not children and signum == signal.SIGUSR1:  # the preemption notice; SIGUSR2 is the script's own business
        os.environ.update(WorkerEnv(early_signal=signal.Signals(signum).name).to_env())
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)


@contextlib.contextmanager
def handling(signals: tuple[signal.Signals, ...], handler: Callable[[int, Any], object] = pass_on) -> Iterator[None]:
    """Within, ``handler`` handles these signals (by default they are passed on to the children)."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent(parent: int | None) -> None:
    """Asks the kernel for SIGKILL when the parent process ends; ends now if it already has.

    ``parent`` is the pid of the process that started this one: if it died between the fork and
    this call, this process was handed to another parent and the kernel would never signal it.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a seccomp filter): the launcher's own teardown still applies
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
