"""Runs one command per host over ssh, streams every host's output under its name, and ends the
job everywhere as one: Ctrl-C, SIGTERM or one host's failure stops every host, and the job
exits with one code, its root cause's.

Each remote command runs under :mod:`phalanx.ssh.remote`, which takes a word a line on its
standard input (INT, TERM, KILL) and ends its process group when that input closes. ssh runs in
a session of its own here, so a Ctrl-C in the terminal reaches this launcher only, which then
says INT to every host: each ``phalanx run`` sees a Ctrl-C, as if typed on its own terminal.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from phalanx.console import say
from phalanx.exit_codes import ExitCode
from phalanx.ssh.hosts import SshHost
from phalanx.ssh.preflight import SSH_FAILED
from phalanx.ssh.transport import Ssh


@dataclass
class _Remote:
    host: SshHost
    process: subprocess.Popen[bytes]
    code: int | None = None

    def say(self, word: str, close: bool = False) -> None:
        """Writes a word to the host's guard; closing its input ends the host's job."""
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
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                sink.write(prefix + line + "\n")
                sink.flush()

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def run_on_hosts(hosts: Sequence[SshHost], ssh: Ssh, commands: Sequence[str], grace_s: float) -> int:
    """Runs ``commands[i]`` on ``hosts[i]`` (each under :mod:`phalanx.ssh.remote`) until all end.

    Args:
        hosts: where.
        ssh: how to reach them.
        commands: one remote shell line per host.
        grace_s: how long hosts get to end on their own after a failure or a stop, before SIGTERM
            (and as long again before SIGKILL).

    Returns:
        The job's exit code: the first failing host's, else 130 (Ctrl-C) or 143 (SIGTERM) after
        a stop (or the code every host ended with, such as 75), else 0.

    Example:
        >>> run_on_hosts([SshHost("gpu1"), SshHost("gpu2")], Ssh(), lines, grace_s=30)  # doctest: +SKIP
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
    try:
        code = _supervise(remotes, events, grace_s)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for remote in remotes:
            remote.say("KILL", close=True)
        streams.drain(timeout_s=5)
    return code


def _supervise(remotes: list[_Remote], events: queue.SimpleQueue[tuple[str, int, int]], grace_s: float) -> int:
    stop: int | None = None  # the signal that stopped the job
    failure: _Remote | None = None
    escalate_at: float | None = None  # when the hosts still running get the next, harder word
    words = iter(["TERM", "KILL"])
    while any(remote.code is None for remote in remotes):
        timeout = None if escalate_at is None else max(0.0, escalate_at - time.monotonic())
        try:
            kind, index, value = events.get(timeout=timeout)
        except queue.Empty:
            word = next(words, "KILL")
            running = [remote for remote in remotes if remote.code is None]
            say(f"phalanx launch: {', '.join(r.host.label for r in running)} still running after {grace_s:g} s: {word}")
            for remote in running:
                remote.say(word, close=word == "KILL")
            escalate_at = time.monotonic() + grace_s
            continue
        if kind == "exit":
            remote = remotes[index]
            remote.code = _exit_code(value)
            if remote.code != 0 and failure is None and stop is None:
                failure = remote
                _say_failure(remote, grace_s)
                escalate_at = time.monotonic() + grace_s
        elif value == signal.SIGINT and stop == signal.SIGINT or stop is not None and value != stop:
            say("phalanx launch: stopping every host at once (SIGKILL)")
            for remote in remotes:
                remote.say("KILL", close=True)
        else:
            stop = value
            word = "INT" if value == signal.SIGINT else "TERM"
            again = "; Ctrl-C again kills them at once" if value == signal.SIGINT else ""
            say(f"phalanx launch: {signal.Signals(value).name}: stopping the job on every host{again}")
            for remote in remotes:
                remote.say(word)
            escalate_at = time.monotonic() + grace_s
            words = iter(["TERM" if word == "INT" else "KILL", "KILL"])
    return _job_code(remotes, failure, stop)


def _exit_code(status: int) -> int:
    return 128 - status if status < 0 else status


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
        say(f"phalanx launch: exit codes {codes}; the job's is {code}, from {failure.host.label}, the first host to end "
            "with a failure (the root cause is in the hosts' output above)")
        return code
    if stop is not None:
        ended = {remote.code for remote in remotes}
        code = ended.pop() if len(ended) == 1 else 128 + stop
        say(f"phalanx launch: stopped by {signal.Signals(stop).name}; exit codes {codes}")
        return int(code)
    return ExitCode.OK
