"""A worker's descendants end with the worker: a small guard process stops the worker's process
group as soon as the worker is gone, however it went (docs/launch-design.md)."""

from __future__ import annotations

import fcntl
import os
import sys

#: The guard itself: python -I -c GUARD WORKER_PID GRACE_S PIDFD (docs/launch-design.md). It leaves
#: its first process at once, so that it is no child of the worker: a script that waits for all
#: its children (os.wait() until none is left) would wait for it forever. PIDFD is the worker's
#: pidfd, opened by the worker itself (-1: none here), so it names the worker whoever reuses the pid.
_GUARD = """
import os, select, signal, sys, time
if os.fork():
    os._exit(0)
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
worker, grace, ending = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
group, me = os.getpgid(0), os.getpid()
if ending >= 0:
    select.select([ending], [], [])
else:
    try:
        while True:
            os.kill(worker, 0)
            time.sleep(0.2)
    except ProcessLookupError:
        pass

def others():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
                if os.getpgid(int(name)) == group and state != "Z":  # a zombie waits for its parent, not for us
                    found.append(name)
            except (OSError, IndexError):
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
    torchrun does); returns the pid of its first process, already ended and reaped. Else, or
    where no process can be started, does nothing: None."""
    if os.getpgid(0) != os.getpid():
        return None
    try:
        opened = os.pidfd_open(os.getpid())
        # above the standard streams: with stdin closed it would be fd 0, which the guard's
        # quiet streams replace with /dev/null, readable at once
        ending = fcntl.fcntl(opened, fcntl.F_DUPFD_CLOEXEC, 3)
        os.close(opened)
        os.set_inheritable(ending, True)
    except (AttributeError, OSError):  # no pidfds here: the guard polls the pid
        ending = -1
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    argv = [sys.executable, "-I", "-c", _GUARD, str(os.getpid()), str(GRACE_S), str(ending)]
    try:
        pid = os.posix_spawn(sys.executable, argv, os.environ, file_actions=quiet)
    except OSError:  # no process to spare (a pid limit): the script runs unguarded, as before
        return None
    finally:
        if ending >= 0:
            os.close(ending)
    os.waitpid(pid, 0)  # its first process ends at once; the guard goes on as that one's child
    return pid
