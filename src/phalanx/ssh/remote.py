"""The process ``phalanx launch`` runs on each host over ssh: it runs ``phalanx run`` in a process
group of its own and ends that group when the launcher says so or goes away.

ssh without a terminal gives a remote command no signal when the connection ends: only its
standard input closes. So the launcher talks to this guard through standard input, a word a
line:

- ``INT``: Ctrl-C, sent to the whole group as a terminal sends it;
- ``TERM``: SIGTERM to ``phalanx run``, which stops its workers;
- ``KILL``: SIGKILL to the whole group (a second Ctrl-C, or a host that did not stop in time);
- the end of standard input (the launcher or its connection is gone), or a signal to the guard
  itself: SIGTERM, then after ``--grace`` seconds SIGKILL to the whole group.

When ``phalanx run`` ends, whatever it left in its group is killed too, and the guard exits
with its code (128+N for a signal N), so nothing outlives a launch on any host.

Usage (the launcher writes this line): python -m phalanx.ssh.remote [--grace S] -- COMMAND...
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import threading

from phalanx.launch.signals import die_with_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.ssh.remote")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    ended = threading.Event()
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # sshd's or a user's signal: as a KILL word
        signal.signal(number, lambda *_: threading.Thread(target=_stop, args=(child, args.grace, ended)).start())
    threading.Thread(target=_listen, args=(child, args.grace, ended), daemon=True).start()
    code = child.wait()
    ended.set()
    _kill_group(child.pid)
    return 128 - code if code < 0 else code


def _listen(child: subprocess.Popen[bytes], grace: float, ended: threading.Event) -> None:
    for line in sys.stdin:
        word = line.strip()
        if word == "INT":
            _signal_group(child.pid, signal.SIGINT)
        elif word == "TERM":
            _signal(child, signal.SIGTERM)
        elif word == "KILL":
            _kill_group(child.pid)
            return
    _stop(child, grace, ended)


def _stop(child: subprocess.Popen[bytes], grace: float, ended: threading.Event) -> None:
    _signal(child, signal.SIGTERM)
    if not ended.wait(grace):
        _kill_group(child.pid)


def _signal(child: subprocess.Popen[bytes], number: signal.Signals) -> None:
    if child.poll() is None:
        child.send_signal(number)


def _signal_group(pgid: int, number: signal.Signals) -> None:
    try:
        os.killpg(pgid, number)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    _signal_group(pgid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
