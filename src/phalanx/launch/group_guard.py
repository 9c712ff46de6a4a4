"""A worker's descendants end with the worker: a small guard process SIGKILLs the worker's
process group as soon as the worker is gone, however it went (an exit 0, an exception, the
kernel's SIGKILL when its launcher was killed).

torch starts every worker in a session and process group of its own, and what the script starts
(a subprocess, a server, a shell pipeline) joins that group unless it makes one of its own. The
kernel ends a worker with its launcher (:func:`phalanx.launch.signals.die_with_parent`), but not
the worker's children: they would run on after the job, holding ports, files and GPUs. The guard
waits on a pidfd of the worker, which becomes readable when the worker ends, then kills the group,
itself included (its last member). It ignores the stop signals that a launcher sends the whole
group, so that it outlives the worker it guards. A descendant that left the group (``setsid``, a
daemon) is out of its reach.
"""

from __future__ import annotations

import os
import sys

#: The guard itself: python -c GUARD WORKER_PID. It imports nothing beyond the interpreter's own.
_GUARD = """
import os, select, signal, sys
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(number, signal.SIG_IGN)
worker = int(sys.argv[1])
try:
    ending = os.pidfd_open(worker)
except OSError:  # it has ended already
    ending = None
if ending is not None and os.getppid() == worker:  # still the worker (a pid is reused only once it ended)
    select.select([ending], [], [])
os.killpg(os.getpgid(0), signal.SIGKILL)
"""


def guard_the_group() -> int | None:
    """Starts the guard, in this process's group, when this process leads it (as each worker of
    torchrun does); returns its pid. Else, or where pidfds are missing, does nothing: None.

    Spawned, not a :class:`subprocess.Popen`: nothing here waits for it, and it outlives this
    process by design."""
    if not hasattr(os, "pidfd_open") or os.getpgid(0) != os.getpid():
        return None
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    return os.posix_spawn(sys.executable, [sys.executable, "-I", "-c", _GUARD, str(os.getpid())], os.environ,
                          file_actions=quiet)  # fmt: skip
