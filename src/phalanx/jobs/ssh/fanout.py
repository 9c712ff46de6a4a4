"""Runs one command per host over ssh, streams every host's output under its name, and ends the
job everywhere as one: Ctrl-C, SIGTERM or one host's failure stops every host, and the job
exits with one code, its root cause's.

Each remote command runs under :mod:`phalanx.jobs.ssh.remote`, which this launcher talks to. ssh
runs in a session of its own here, so a Ctrl-C in the terminal reaches this launcher only, which
says INT to every host: each ``phalanx run`` sees a Ctrl-C, as if typed on its own terminal.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from phalanx.console import say
from phalanx.exit_codes import ExitCode, exit_code_of
from phalanx.jobs.ssh.hosts import SshHost
from phalanx.jobs.ssh.remote import BEAT_S
from phalanx.jobs.ssh.transport import SSH_FAILED, Ssh


@dataclass
class _Remote:
    host: SshHost
    process: subprocess.Popen[bytes]
    code: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, word: str, close: bool = False) -> None:
        """Writes a word to the host's guard; closing its input ends the host's job."""
        with self.lock:
            stdin = self.process.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(f"{word}\n".encode())
                stdin.flush()
                if close:
                    stdin.close()
            except (BrokenPipeError, OSError):
                pass  # that host's ssh has gone already


def _beat(remotes: list[_Remote], done: threading.Event) -> None:
    """Tells every guard that the launcher is there; one that hears nothing for
    :data:`phalanx.jobs.ssh.remote.SILENCE_S` (a cut link, which closes no connection) stops its job."""
    while not done.wait(BEAT_S):
        for remote in remotes:
            remote.say("BEAT")


class _Streams:
    """Copies each host's output lines to ours, prefixed with its name, whole lines at a time."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, label: str, source: IO[bytes], sink: IO[str]) -> None:
        thread = threading.Thread(target=self._copy, args=(f"{label:<{self.width}}: ", source, sink), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, prefix: str, source: IO[bytes], sink: IO[str]) -> None:
        """Reads to the end whatever happens to ``sink`` (a closed pipe: `| head`): ssh must never
        block on a full pipe, or it would never end."""
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock, contextlib.suppress(OSError, ValueError):
                sink.write(prefix + line + "\n")
                sink.flush()

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def run_on_hosts(hosts: Sequence[SshHost], ssh: Ssh, commands: Sequence[str], grace_s: float) -> int:
    """Runs the shell line ``commands[i]`` on ``hosts[i]`` (each under :mod:`phalanx.jobs.ssh.remote`)
    until all end; after a failure or a stop, hosts get ``grace_s`` to end on their own before
    SIGTERM, and as long again before SIGKILL. Returns the job's exit code: the first failing
    host's, else 130 (Ctrl-C) or 143 (SIGTERM) after a stop (or the code every host ended with,
    such as 75), else 0.
    """
    events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()  # put() is safe in a signal handler
    streams = _Streams(max(len(host.label) for host in hosts))
    remotes = []
    for index, (host, command) in enumerate(zip(hosts, commands)):
        process = subprocess.Popen(ssh.argv(host.name, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        remotes.append(_Remote(host, process))
        assert process.stdout is not None and process.stderr is not None
        streams.follow(host.label, process.stdout, sys.stdout)
        streams.follow(host.label, process.stderr, sys.stderr)
        threading.Thread(target=lambda i=index, p=process: events.put(("exit", i, p.wait())), daemon=True).start()
    previous = {number: signal.signal(number, lambda n, _f: events.put(("signal", 0, n)))
                for number in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    done = threading.Event()
    threading.Thread(target=_beat, args=(remotes, done), daemon=True).start()
    try:
        code = _supervise(remotes, events, grace_s)
    finally:
        done.set()
        for number, handler in previous.items():
            signal.signal(number, handler)
        for remote in remotes:
            remote.say("KILL", close=True)
        streams.drain(timeout_s=5)
    return code


def _supervise(remotes: list[_Remote], events: queue.SimpleQueue[tuple[str, int, int]], grace_s: float) -> int:
    stop: int | None = None  # the signal that stopped the job
    failure: _Remote | None = None
    ladder = _Ladder(grace_s)
    while any(remote.code is None for remote in remotes):
        try:
            kind, index, value = events.get(timeout=ladder.wait_s())
        except queue.Empty:
            ladder.climb([remote for remote in remotes if remote.code is None])
            continue
        if kind == "exit":
            remote = remotes[index]
            remote.code = exit_code_of(value)
            if remote.code != 0 and failure is None and stop is None:
                failure = remote
                _say_failure(remote, grace_s)
                ladder.start(["TERM", "KILL", _ABANDON])
        elif stop is not None:  # a second signal: no more waiting
            say("phalanx launch: stopping every host at once (SIGKILL)")
            ladder.start(["KILL", _ABANDON], now=True)
            ladder.climb([remote for remote in remotes if remote.code is None])
        else:
            stop = value
            word = "INT" if value == signal.SIGINT else "TERM"
            again = "; Ctrl-C again kills them at once" if value == signal.SIGINT else ""
            say(f"phalanx launch: {signal.Signals(value).name}: stopping the job on every host{again}")
            for remote in remotes:
                remote.say(word)
            ladder.start((["TERM"] if word == "INT" else []) + ["KILL", _ABANDON])
    return _job_code(remotes, failure, stop)


#: The last step: the host's ssh connection is closed from here, whatever still runs there.
_ABANDON = "ABANDON"


class _Ladder:
    """What hosts that still run get next, a step every ``grace_s``: TERM, KILL, then their ssh
    connection closed from here, so that the launcher itself always ends."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.steps: list[str] = []
        self.next_at: float | None = None

    def start(self, steps: list[str], now: bool = False) -> None:
        self.steps = steps
        self.next_at = time.monotonic() + (0 if now else self.grace_s)

    def wait_s(self) -> float | None:
        return None if self.next_at is None else max(0.0, self.next_at - time.monotonic())

    def climb(self, running: list[_Remote]) -> None:
        if not self.steps:
            self.next_at = None
            return
        step = self.steps.pop(0)
        names = ", ".join(remote.host.label for remote in running)
        if step == _ABANDON:
            say(f"phalanx launch: {names} did not end after SIGKILL; closing the ssh connection (check what is left "
                f"there: ssh HOST ps -ef)")  # fmt: skip
            for remote in running:
                remote.process.kill()
        else:
            say(f"phalanx launch: {names} still running: {'SIGTERM' if step == 'TERM' else 'SIGKILL'}")
            for remote in running:
                remote.say(step, close=step == "KILL")
        self.next_at = time.monotonic() + self.grace_s


def _say_failure(remote: _Remote, grace_s: float) -> None:
    if remote.code == SSH_FAILED:
        why = "its ssh connection ended (exit 255): the host or its network is gone"
    else:
        why = f"its phalanx run exited with code {remote.code}"
    say(f"phalanx launch: {remote.host.label} failed: {why}; the other hosts get {grace_s:g} s to end on their own")


def _job_code(remotes: list[_Remote], failure: _Remote | None, stop: int | None) -> int:
    codes = ", ".join(f"{remote.host.label} {remote.code}" for remote in remotes)
    if failure is not None:
        code = failure.code or ExitCode.FAILED
        say(
            f"phalanx launch: exit codes {codes}; the job's is {code}, from {failure.host.label}, the first host to end "
            "with a failure (the root cause is in the hosts' output above)"
        )
        return code
    if stop is not None:  # every host's own code where they agree on a clean end (0, or 75 after a checkpoint)
        ended = {remote.code for remote in remotes}
        code = ended.pop() if len(ended) == 1 and ended <= {ExitCode.OK, ExitCode.PREEMPTED} else 128 + stop
        say(f"phalanx launch: stopped by {signal.Signals(stop).name}; exit codes {codes}")
        return int(code)
    return ExitCode.OK
