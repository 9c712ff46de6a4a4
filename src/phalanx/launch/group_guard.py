"""A worker's descendants end with the worker: a small guard process stops the worker's process
group as soon as the worker is gone, however it went (docs/launch-design.md)."""

from __future__ import annotations

import os
import sys

#: The guard itself: python -I -c GUARD WORKER_PID GRACE_S (docs/launch-design.md).
_GUARD = """
import os, select, signal, sys, time
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
worker, grace, group, me = int(sys.argv[1]), float(sys.argv[2]), os.getpgid(0), os.getpid()
try:
    ending = os.pidfd_open(worker)
except ProcessLookupError:  # it has ended already
    ending = -1
except OSError:  # no pidfds here
    ending = None
if ending is None:
    while os.getppid() == worker:
        time.sleep(0.2)
elif ending >= 0 and os.getppid() == worker:  # still the worker (a pid is reused only once it ended)
    select.select([ending], [], [])

def others():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                if os.getpgid(int(name)) == group:
                    found.append(name)
            except OSError:
                pass
    return found

if others():
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while others() and time.monotonic() < deadline:
        time.sleep(0.05)
os.killpg(group, signal.SIGKILL)
"""
#: What the worker's other processes get between SIGTERM and SIGKILL.
GRACE_S = 2.0


def guard_the_group() -> int | None:
    """Starts the guard, in this process's group, when this process leads it (as each worker of
    torchrun does); returns its pid. Else, or where no process can be started, does nothing: None."""
    if os.getpgid(0) != os.getpid():
        return None
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    argv = [sys.executable, "-I", "-c", _GUARD, str(os.getpid()), str(GRACE_S)]
    try:
        return os.posix_spawn(sys.executable, argv, os.environ, file_actions=quiet)
    except OSError:  # no process to spare (a pid limit): the script runs unguarded, as before
        return None
