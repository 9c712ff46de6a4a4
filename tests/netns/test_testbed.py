"""`phalanx testbed`: hosts as network namespaces, built and removed by the command line, also
when interrupted; links cut and restored."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from phalanx.testbed.bed import NETNS_ETC, link_prefix, namespace_prefix, state_file
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]


def run_testbed(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", "testbed", *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)  # fmt: skip


def leftovers(name: str) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    found = [n for n in namespaces if n.startswith(namespace_prefix(name))]
    found += [line.split(":")[1].strip() for line in links.splitlines() if f" {link_prefix(name)}" in line]
    found += [str(p) for p in NETNS_ETC.glob(f"{namespace_prefix(name)}*")] if NETNS_ETC.is_dir() else []
    return found + ([str(state_file(name))] if state_file(name).exists() else [])


@pytest.fixture
def bed_name():
    skip_unless_namespaces_work()
    name = f"tb{os.getpid() % 100000}"
    yield name
    run_testbed("down", "--name", name)
    assert not leftovers(name)


def connects(name: str, host: str, address: str) -> bool:
    probe = f"import socket\ntry:\n socket.create_connection(('{address}', 9), timeout=1)\nexcept ConnectionRefusedError:\n pass\n"
    return run_testbed("exec", host, "--name", name, "--", sys.executable, "-c", probe).returncode == 0


def test_up_exec_cut_restore_down(bed_name):
    up = run_testbed("up", "--hosts", "2", "--name", bed_name, "--rate", "1gbit")
    assert up.returncode == 0, up.stderr
    rows = [line.split() for line in up.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["h1", "h2"] and all(row[3:5] == ["rate", "1gbit"] for row in rows)
    h1, h2 = rows[0][1], rows[1][1]
    resolved = run_testbed("exec", "h2", "--name", bed_name, "--", "getent", "hosts", "h1", "h2")
    assert (
        resolved.returncode == 0 and f"{h1}" in resolved.stdout and "127.0.1.1" in resolved.stdout
    )  # own name: the trap
    # A name the hosts file lacks (c10d looks up a peer's IPv4-mapped address) is answered at
    # once, not after the machine's unreachable name server's timeout (10 s).
    asked = time.monotonic()
    unknown = run_testbed("exec", "h2", "--name", bed_name, "--", "getent", "hosts", f"::ffff:{h1}", "nowhere.invalid")
    assert unknown.returncode == 2 and time.monotonic() - asked < 5, unknown
    # sudo resets PATH: `phalanx` in a command is still this environment's
    found = run_testbed("exec", "h1", "--name", bed_name, "--", "sh", "-c", "command -v phalanx",
                        env={**os.environ, "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert found.stdout.strip() == str(Path(sys.executable).parent / "phalanx"), found
    everywhere = run_testbed("exec", "all", "--name", bed_name, "--", "sh", "-c", "hostname -I; exit 3")
    assert everywhere.returncode == 3
    assert sorted(line.split("|")[0] for line in everywhere.stdout.splitlines()) == ["h1", "h2"]
    assert connects(bed_name, "h1", h2)  # refused by h2's kernel: reachable
    cut = subprocess.Popen([sys.executable, "-m", "phalanx", "testbed", "cut", "h2", "--for", "6", "--name", bed_name],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while " cut " not in run_testbed("status", "--name", bed_name).stdout:
            assert time.monotonic() < deadline, "the link was not cut within 10 s"
            time.sleep(0.2)
        assert not connects(bed_name, "h1", h2)  # the packets vanish: the connect times out
    finally:
        assert cut.wait(timeout=30) == 0
    assert connects(bed_name, "h1", h2)  # restored
    down = run_testbed("down", "--name", bed_name)
    assert down.returncode == 0 and not leftovers(bed_name)


def test_a_data_network_is_cut_and_restored_on_its_own_and_between_two_hosts_only(bed_name):
    up = run_testbed("up", "--hosts", "3", "--name", bed_name, "--data-network", "--names-on", "data")
    assert up.returncode == 0, up.stderr
    header, *rows = [line.split() for line in up.stdout.splitlines()[1:]]
    assert header == ["host", "address", "namespace", "link", "data", "address", "data", "link", "processes"]
    main = {row[0]: row[1] for row in rows}
    data = {row[0]: row[4] for row in rows}
    assert len(set(main.values()) | set(data.values())) == 6 and all(row[5] == "unshaped" for row in rows), rows
    resolved = run_testbed("exec", "h1", "--name", bed_name, "--", "getent", "hosts", "h2")
    assert resolved.returncode == 0 and data["h2"] in resolved.stdout, resolved  # --names-on data
    assert connects(bed_name, "h1", data["h3"]) and connects(bed_name, "h1", main["h3"])

    assert run_testbed("cut", "h3", "--network", "data", "--name", bed_name).returncode == 0
    assert not connects(bed_name, "h1", data["h3"]) and connects(bed_name, "h1", main["h3"])
    assert run_testbed("restore", "h3", "--network", "data", "--name", bed_name).returncode == 0
    assert connects(bed_name, "h1", data["h3"])

    cut = run_testbed("cut", "h1", "--to", "h2", "--network", "data", "--name", bed_name)
    assert cut.returncode == 0 and "h1 and h2 are cut from each other on the data network" in cut.stderr, cut
    assert not connects(bed_name, "h1", data["h2"]) and not connects(bed_name, "h2", data["h1"])
    assert connects(bed_name, "h1", main["h2"]) and connects(bed_name, "h1", data["h3"])  # the rest intact
    status = run_testbed("status", "--name", bed_name).stdout
    assert "unshaped, cut from h2" in status and "unshaped, cut from h1" in status, status
    again = run_testbed("cut", "h2", "--to", "h1", "--network", "data", "--name", bed_name)  # the same pair
    assert again.returncode == 0 and not connects(bed_name, "h1", data["h2"]), again
    assert run_testbed("restore", "h2", "--to", "h1", "--network", "data", "--name", bed_name).returncode == 0
    assert connects(bed_name, "h1", data["h2"]) and connects(bed_name, "h2", data["h1"])  # one restore undid it
    assert "cut from" not in run_testbed("status", "--name", bed_name).stdout

    shaped = run_testbed("shape", "h3", "--network", "data", "--rate", "100mbit", "--name", bed_name)
    assert shaped.returncode == 0, shaped.stderr
    row = next(line.split() for line in shaped.stdout.splitlines() if line.split()[:1] == ["h3"])
    assert row[3] == "unshaped" and row[5:7] == ["rate", "100mbit"], shaped.stdout  # the data link alone


@pytest.mark.parametrize(("argv", "says"), [
    (["cut", "h1", "--to", "h1"], "cannot cut h1 off from itself"),
    (["cut", "h1", "--to", "h9"], "has no host 'h9'"),
    (["cut", "h1", "--network", "data"], "host h1 has no data network"),
    (["shape", "--network", "data", "--rate", "1gbit"], "host h1 has no data network"),
])  # fmt: skip
def test_a_cut_the_bed_cannot_make_is_refused_with_a_hint(bed_name, argv, says):
    assert run_testbed("up", "--hosts", "2", "--name", bed_name).returncode == 0
    refused = run_testbed(*argv, "--name", bed_name)
    assert refused.returncode == 2 and says in refused.stderr and "HINT: " in refused.stderr, refused.stderr
    assert "cut" not in run_testbed("status", "--name", bed_name).stdout.split("\n", 1)[1]


def qdiscs(bed_name: str, host: str) -> str:
    return run_testbed("exec", host, "--name", bed_name, "--", "tc", "qdisc", "show", "dev", "eth0").stdout


def test_a_refused_shape_leaves_the_link_as_it_was(bed_name):
    """Delay needs the kernel's netem, which some kernels lack (this machine's among them): a
    refused --delay must not have removed the rate limit that `status` still shows."""
    assert run_testbed("up", "--hosts", "2", "--name", bed_name, "--rate", "1gbit").returncode == 0
    try:
        shaped = run_testbed("shape", "h2", "--delay", "1ms", "--name", bed_name)
        status = run_testbed("status", "--name", bed_name).stdout
        if shaped.returncode == 0:  # a kernel with netem: the delay is on, with the rate
            assert "netem" in qdiscs(bed_name, "h2") and "delay 1ms" in status
        else:
            assert shaped.returncode == 2 and "cannot add delay or loss" in shaped.stderr, shaped.stderr
            assert "tbf" in qdiscs(bed_name, "h2") and "rate 1gbit" in status.splitlines()[3], status
            assert "delay" not in status
    finally:
        assert run_testbed("down", "--name", bed_name).returncode == 0


@contextlib.contextmanager
def up_held_inside_its_third_host(bed_name: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """`up` of 5 hosts, held inside its third host's `ip link add` (an `ip` in front of the real
    one on its PATH, which waits on a FIFO): a signal then comes while hosts are half built,
    every time. Killed on the way out."""
    gate, reached = tmp_path / "gate", tmp_path / "reached"
    os.mkfifo(gate)
    os.mkfifo(reached)
    shim = tmp_path / "bin" / "ip"
    shim.parent.mkdir()
    shim.write_text(f"""#!/bin/sh
case " $* " in *" link add {link_prefix(bed_name)}v3 "*) echo here > {reached}; read line < {gate};; esac
exec {shutil.which("ip")} "$@"
""")
    shim.chmod(0o755)
    up = subprocess.Popen([sys.executable, "-m", "phalanx", "testbed", "up", "--hosts", "5", "--name", bed_name],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"})  # fmt: skip
    try:
        reader = os.open(reached, os.O_RDONLY | os.O_NONBLOCK)
        try:
            assert select.select([reader], [], [], 30)[0], "up never reached its third host"
        finally:
            os.close(reader)
        assert state_file(bed_name).exists() and leftovers(bed_name), "nothing was built before the third host"
        yield up
    finally:
        up.kill()
        up.wait()
        _release(gate, shim)


def _release(gate: Path, shim: Path) -> None:
    """Lets a shim still held at the gate go on (its `ip` then ends), so that no process outlives the test."""
    with contextlib.suppress(OSError):  # ENXIO: nobody waits at the gate
        writer = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer, b"go\n")
        os.close(writer)
    deadline = time.monotonic() + 10
    while any(str(shim) in " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"])):
        assert time.monotonic() < deadline, "the ip shim outlived the test"
        time.sleep(0.05)


def test_down_removes_a_bed_whose_up_was_killed(bed_name, tmp_path):
    with up_held_inside_its_third_host(bed_name, tmp_path) as up:
        up.kill()
        up.wait(timeout=10)
    assert leftovers(bed_name)
    assert run_testbed("down", "--name", bed_name).returncode == 0
    assert not leftovers(bed_name)


def test_sigterm_during_up_leaves_nothing(bed_name, tmp_path):
    with up_held_inside_its_third_host(bed_name, tmp_path) as up:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 130, up.stderr.read()
    assert not leftovers(bed_name)


def test_without_root_it_says_so(tmp_path):
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run([*nobody, sys.executable, "-m", "phalanx", "testbed", "up", "--hosts", "1", "--name", "nr"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    if "Permission denied" in done.stderr and "phalanx" not in done.stderr:
        pytest.skip("this checkout cannot be read by an unprivileged user")
    assert done.returncode == 2, done.stderr
    assert "a test bed needs root" in done.stderr and "HINT: run it with sudo" in done.stderr
