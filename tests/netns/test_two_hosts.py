"""Two hosts for real: the same `phalanx run --nnodes 2` line on each, over a veth link.

Skipped where network namespaces cannot be made (not root); CI runs as root.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from phalanx.testbed import phalanx_argv, run_together
from tests.conftest import EXAMPLES, WORKERS, kill_group
from tests.netns.hosts import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PORT = "29400"
TRAIN = [str(EXAMPLES / "tutorial_ddp.py"), "--epochs", "3", "--samples", "128", "--image-size", "16"]


def phalanx_line(host, endpoint: str, *extra: str, script=TRAIN) -> list[str]:
    return host.command(phalanx_argv("run", "--nnodes", "2", "--rdzv-endpoint", f"{endpoint}:{PORT}", *extra, *script))


@pytest.mark.compat
def test_plain_torchrun_fails_where_phalanx_trains(workdir):
    with two_hosts("t") as (a, b):
        # Plain torchrun, the tutorial's line on both hosts. Its timeouts are shortened so that
        # the failure shows within the test's bound; with the defaults it hangs longer.
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.address}:{PORT}",
            "--rdzv-conf", "read_timeout=15,join_timeout=15", *TRAIN,
        ]  # fmt: skip
        plain = run_together([a.command(torchrun), b.command(torchrun)], timeout=60, cwd=str(workdir))
        assert all(o.returncode != 0 for o in plain), [o.output[-2000:] for o in plain]
        assert not any("epoch 3/3" in o.output for o in plain)

        ours = run_together([phalanx_line(a, a.address), phalanx_line(b, a.address)], timeout=120, cwd=str(workdir))
        for outcome in ours:
            assert outcome.returncode == 0, outcome.output[-4000:]
        main, other = ours
        assert "this host hosts it" in main.output and f"advertising {a.address}" in main.output
        assert f"hosted by {a.address}" in other.output and f"advertising {b.address}" in other.output
        assert re.search(r"not the hostname '.+': it resolves to 127\.", other.output), other.output
        assert f"interface  {b.device}" in other.output
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", main.output)]
        assert len(losses) == 3 and losses[-1] < losses[0], main.output
        assert re.search(rf"0\s+{a.address}\s+{a.address}\s+0\s+0", main.output), main.output  # the rank table
        assert re.search(rf"1\s+{b.address}\s+{b.address}\s+1\s+0", main.output), main.output


@pytest.mark.parametrize("setting, value_a, value_b", [("nproc-per-node", "1", "2"), ("nnodes", "2", "3")])
def test_nodes_with_different_settings_all_stop_with_a_table(workdir, setting, value_a, value_b):
    with two_hosts("m") as (a, b):
        outcomes = run_together(
            [
                phalanx_line(a, a.address, f"--{setting}", value_a),
                phalanx_line(b, a.address, f"--{setting}", value_b),
            ],
            timeout=60,
            cwd=str(workdir),
        )
        for outcome in outcomes:
            assert outcome.returncode == 2, outcome.output[-3000:]
            assert outcome.seconds < 60
            assert "were started with different settings" in outcome.output
            row = re.search(rf"^\s*{setting}\s+(\d)\s+(\d)\s*$", outcome.output, re.M)
            assert row and sorted(row.groups()) == [value_a, value_b], outcome.output
            assert a.address in outcome.output and b.address in outcome.output
            assert "HINT:" in outcome.output
            assert "epoch" not in outcome.output  # stopped before the first step


def test_a_node_alone_times_out_naming_the_endpoint(workdir):
    with two_hosts("j") as (a, b):
        # b has no default route: nothing routes to an address off its network
        subprocess.run(["ip", "-n", b.namespace, "route", "del", "default"], check=True, timeout=10)
        alone, unreachable = run_together(
            [
                phalanx_line(a, a.address, "--join-timeout", "4"),
                phalanx_line(b, "10.254.254.254", "--join-timeout", "4"),  # nothing routes there
            ],
            timeout=40,
            cwd=str(workdir),
        )
        assert alone.returncode == 3, alone.output
        assert f"only 1 of 2 nodes joined job 'phalanx' at {a.address}:{PORT}" in alone.output
        assert f"joined: {a.address}" in alone.output
        assert unreachable.returncode == 2, unreachable.output  # refused up front: no route
        assert "no route to 10.254.254.254" in unreachable.output


#: Answers every connection with bytes that are no store's, and keeps it open.
GARBAGE_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])), reuse_port=True)
kept = []
while True:
    connection, _ = server.accept()
    connection.sendall(bytes(range(256)) * 4)
    kept.append(connection)
"""


@pytest.mark.parametrize("service", ["http", "garbage"])
def test_a_port_that_is_no_store_is_refused_within_the_join_timeout(workdir, service):
    """The endpoint's port is held by another service on host a: an HTTP server (which never
    answers torch's store client) or one that answers garbage. Host b's phalanx run ends within
    its --join-timeout, exit code 3, naming the endpoint, with no traceback."""
    with two_hosts("s") as (a, b):
        server_argv = ([sys.executable, "-m", "http.server", PORT, "--bind", a.address] if service == "http" else
                       [sys.executable, "-c", GARBAGE_SERVER, a.address, PORT])  # fmt: skip
        server = subprocess.Popen(a.command(server_argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # fmt: skip
        try:
            (outcome,) = run_together([phalanx_line(b, a.address, "--join-timeout", "8")], timeout=60, cwd=str(workdir))
        finally:
            kill_group(server.pid)
            server.wait()
        assert outcome.returncode == 3, outcome.output[-3000:]
        assert outcome.seconds < 8 + 15, outcome.seconds  # the bound, and the interpreter's start
        assert (
            f"something listens at the endpoint {a.address}:{PORT}, but it is not a rendezvous store" in outcome.output
        )
        assert "HINT:" in outcome.output and "Traceback" not in outcome.output, outcome.output


def test_both_hosts_name_the_rank_that_failed_first(workdir):
    worker = str(WORKERS / "fail_on_rank.py")
    with two_hosts("f") as (a, b):
        outcomes = run_together(
            [phalanx_line(a, a.address, script=[worker, "1"]), phalanx_line(b, a.address, script=[worker, "1"])],
            timeout=90,
            cwd=str(workdir),
        )
        for outcome in outcomes:
            assert outcome.returncode == 1, outcome.output[-3000:]
            cause = outcome.output[outcome.output.index("phalanx: root cause:") :]
            assert cause.startswith(
                f"phalanx: root cause: rank 1 (local rank 0) on {b.address} ({b.address}) exited with code 1"
            )
            assert "ValueError: rank 1 fails on purpose" in cause


def test_the_host_whose_workers_finished_does_not_wait_for_the_failed_one(workdir):
    """Two real hosts: a's workers finish, b's rank fails seconds later, with a restart left. a
    (which hosts the store) exits with 0 once b posted its failure, not 5 minutes later; b does
    not restart for a's ranks, and still names the root cause with the store's help."""
    worker = str(WORKERS / "rank1_late.py")
    with two_hosts("l") as (a, b):
        outcomes = run_together(
            [phalanx_line(host, a.address, "--max-restarts", "1", script=[worker]) for host in (a, b)],
            timeout=60,
            cwd=str(workdir),
        )
    finished, failed = outcomes
    assert finished.returncode == 0, finished.output[-3000:]
    assert (f"phalanx: {a.address}: its workers finished; exiting without waiting for the other nodes, since "
            f"{b.address}'s workers failed: rank 1 exited with code 1") in finished.output, finished.output[-3000:]  # fmt: skip
    assert failed.returncode == 1, failed.output[-3000:]
    assert (f"not restarting the workers (--max-restarts 1): the workers of {a.address} already finished"
            in failed.output), failed.output[-3000:]  # fmt: skip
    assert f"phalanx: root cause: rank 1 (local rank 0) on {b.address}" in failed.output
