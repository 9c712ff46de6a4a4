"""The process ``phalanx launch`` runs on each host over ssh: it runs ``phalanx run`` in a process
group of its own and ends that group when the launcher says so or goes away.

ssh without a terminal gives a remote command no signal when the connection ends: only its
standard input closes. So the launcher talks to this guard through standard input, a word a
line:

- ``INT``: Ctrl-C, sent to the whole group as a terminal sends it;
- ``TERM``: SIGTERM to ``phalanx run``, which stops its workers;
- ``KILL``: SIGKILL to everything it started (a second Ctrl-C, or a host that did not stop in
  time);
- ``BEAT``, every :data:`BEAT_S` seconds: the launcher is there. Silence for
  :data:`SILENCE_S` counts as its end (a cut link closes no connection);
- the end of standard input (the launcher or its connection is gone), silence, or a signal to
  the guard itself: SIGTERM, then after ``--grace`` seconds SIGKILL to everything it started.

"Everything it started" is the process group and every descendant: the guard is a child
subreaper, so a process that left the group (``setsid``) and lost its parent is still its own.
When ``phalanx run`` ends, whatever it left is killed too, and the guard exits with its code
(128+N for a signal N), so nothing outlives a launch on any host.

Usage (the launcher writes this line): python -m phalanx.jobs.ssh.remote [--grace S] -- COMMAND...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from phalanx.exit_codes import exit_code_of
from phalanx.launch.signals import die_with_parent

#: How often the launcher says BEAT, and how long a guard waits for a word before it stops.
BEAT_S = 5.0
SILENCE_S = 30.0
_PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str] | None = None) -> int:
    """Runs the command after ``--`` until it ends or the launcher says so; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m phalanx.jobs.ssh.remote")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--silence", type=float, default=SILENCE_S)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=functools.partial(die_with_parent, os.getpid()))  # fmt: skip
    guard = _Guard(child, args.grace)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # sshd's or a user's signal: as the end of input
        signal.signal(number, lambda *_: threading.Thread(target=guard.stop).start())
    threading.Thread(target=guard.listen, args=(args.silence,), daemon=True).start()
    code = child.wait()
    guard.ended.set()
    guard.kill_all()
    return exit_code_of(code)


class _Guard:
    def __init__(self, child: subprocess.Popen[bytes], grace: float) -> None:
        self.child = child
        self.grace = grace
        self.ended = threading.Event()
        self.heard = time.monotonic()

    def listen(self, silence: float) -> None:
        """Acts on the launcher's words; stops the job when its input ends or falls silent."""
        threading.Thread(target=self._mind_the_silence, args=(silence,), daemon=True).start()
        for line in sys.stdin:
            self.heard = time.monotonic()
            word = line.strip()
            if word == "INT":
                self._signal_group(signal.SIGINT)
            elif word == "TERM":
                self._signal_child(signal.SIGTERM)
            elif word == "KILL":
                self.kill_all()
                return
        self.stop()

    def _mind_the_silence(self, silence: float) -> None:
        while not self.ended.wait(1.0):
            if time.monotonic() - self.heard > silence:
                self.stop()
                return

    def stop(self) -> None:
        """SIGTERM to the command, then after the grace SIGKILL to everything started."""
        self._signal_child(signal.SIGTERM)
        if not self.ended.wait(self.grace):
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL to the command's group and to every descendant of this guard."""
        self._signal_group(signal.SIGKILL)
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _signal_child(self, number: signal.Signals) -> None:
        if self.child.poll() is None:
            self.child.send_signal(number)

    def _signal_group(self, number: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, number)


if __name__ == "__main__":
    sys.exit(main())
