"""A host whose name server does not answer: torch's store client waits for it at every connect.

Host b's /etc/resolv.conf names a name server that reads queries and never answers (a UDP socket
on b's own 127.0.0.1:53), and its /etc/nsswitch.conf asks DNS after the hosts file, as most
machines do. `phalanx env` names the trap, and a node whose store client is still waiting for
its lookup when the join deadline comes says so, not "not a rendezvous store".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testbed import phalanx_argv, run_together
from phalanx.testbed.bed import NETNS_ETC
from tests.conftest import kill_group
from tests.netns.hosts import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PORT = "29400"

#: Reads DNS queries on 127.0.0.1:53 and answers none.
SILENT_NAME_SERVER = """
import socket
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind(("127.0.0.1", 53))
print("ready", flush=True)
while True:
    server.recv(4096)
"""

#: A rendezvous store that serves, as the main node's does.
STORE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, use_libuv=True, wait_for_workers=False,
                 timeout=timedelta(seconds=60))
print("ready", flush=True)
time.sleep(120)
"""


def started(argv: list[str]) -> subprocess.Popen[str]:
    """A server on a host, once it says it is ready."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready", argv
    return process


def with_dns(host, argv: list[str], workdir: Path) -> list[str]:
    """``argv`` inside ``host``, whose host names resolve from its hosts file, then its name server."""
    nsswitch = workdir / f"nsswitch-{host.name}.conf"
    nsswitch.write_text("hosts: files dns\n")
    return host.command(["sh", "-c", f'mount --bind {nsswitch} /etc/nsswitch.conf && exec "$@"', "sh", *argv])


def silent_name_server(host, timeout_s: int) -> subprocess.Popen[str]:
    (NETNS_ETC / host.namespace / "resolv.conf").write_text(
        f"nameserver 127.0.0.1\noptions timeout:{timeout_s} attempts:1\n"
    )
    return started(host.command([sys.executable, "-c", SILENT_NAME_SERVER]))


def test_env_names_a_name_server_that_does_not_answer(workdir):
    with two_hosts("d") as (a, b):
        server = silent_name_server(b, 1)
        try:
            quiet, silent = run_together(
                [with_dns(a, phalanx_argv("env"), workdir), with_dns(b, phalanx_argv("env"), workdir)],
                timeout=60,
                cwd=str(workdir),
            )
        finally:
            kill_group(server.pid)
            server.wait()
    assert quiet.returncode == 0 and silent.returncode == 0, (quiet.output[-2000:], silent.output[-2000:])
    # a's resolv.conf names its own loopback, where nothing listens: the query is refused at once
    assert "name server does not answer" not in quiet.output, quiet.output
    assert "(slow: see WARNING below)" in silent.output, silent.output
    assert f"WARNING: looking up the name of {b.address} takes 1." in silent.output, silent.output
    assert "err=-3" in silent.output and "HINT: make the name server in /etc/resolv.conf answer" in silent.output
    assert f"`time getent hosts ::ffff:{b.address}` shows the wait" in silent.output


def test_a_store_client_waiting_for_its_lookup_is_named_at_the_join_deadline(workdir):
    """The store on a serves, but b's client waits 4 s for its lookup before its first request:
    b's join deadline (2 s) comes first. b warns at its start and names the name server then."""
    (workdir / "train.py").write_text("print('trained')\n")
    with two_hosts("l") as (a, b):
        store = started(a.command([sys.executable, "-c", STORE, a.address, PORT]))
        server = silent_name_server(b, 4)
        line = ["run", "--nnodes", "2", "--rdzv-endpoint", f"{a.address}:{PORT}", "--join-timeout", "2", "train.py"]
        try:
            (outcome,) = run_together([with_dns(b, phalanx_argv(*line), workdir)], timeout=60, cwd=str(workdir))
        finally:
            for process in (store, server):
                kill_group(process.pid)
                process.wait()
    assert outcome.returncode == 3, outcome.output[-3000:]
    assert f"warning    looking up the name of {b.address} takes at least 3.0 s here" in outcome.output, outcome.output
    assert (
        f"torch's store client had no answer from the endpoint {a.address}:{PORT} in 2 s: this node's name server "
        "did not answer either" in outcome.output
    ), outcome.output
    assert "not a rendezvous store" not in outcome.output and "Traceback" not in outcome.output, outcome.output
    assert outcome.seconds < 3 + 2 + 15, outcome.seconds  # the probe's limit, the deadline, the interpreter
