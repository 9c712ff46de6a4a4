"""Two hosts on one machine: network namespaces joined by a veth pair, each with its own IP.

The hostname still resolves to 127.0.0.1 inside them (/etc/hosts is shared), which is the trap
that real clusters and containers set for plain torchrun.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    device: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def skip_unless_namespaces_work() -> None:
    if os.geteuid() != 0:
        pytest.skip("two-host tests need root to create network namespaces (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("two-host tests need iproute2's `ip` command")
    probe = f"phxprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"network namespaces are not available here: {error}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts(tag: str, rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Creates hosts a and b (10.<n>.0.1 and .2); always removes them, even when the test fails."""
    skip_unless_namespaces_work()
    subnet = 100 + os.getpid() % 100
    base = f"phx{os.getpid() % 100000}{tag}"
    a = Host(f"{base}a", f"10.{subnet}.0.1", f"{base[:10]}a")
    b = Host(f"{base}b", f"10.{subnet}.0.2", f"{base[:10]}b")
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
        _ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        for host in (a, b):
            _ip("link", "set", host.device, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if rate:
                subprocess.run(
                    host.command(["tc", "qdisc", "add", "dev", host.device, "root", "tbf", "rate", rate,
                                  "burst", "256kb", "latency", "50ms"]),
                    check=True, capture_output=True, timeout=10,
                )  # fmt: skip
        yield a, b
    finally:
        for host in (a, b):
            _kill_namespace_processes(host.namespace)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=10)


def _kill_namespace_processes(namespace: str) -> None:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class Outcome:
    returncode: int | None  # None: still running at the deadline (then killed)
    output: str
    seconds: float


def run_on_both(commands: list[list[str]], timeout: float, cwd: str) -> list[Outcome]:
    """Starts one command per host at once; each is killed (with its group) at the deadline."""
    started = time.monotonic()
    processes = [
        subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for argv in commands
    ]
    outcomes = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            code = None
        outcomes.append(Outcome(code, output, time.monotonic() - started))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return outcomes
