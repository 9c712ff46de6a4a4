"""Inputs the probe found handled badly, each refused before anything starts: what was set, why
it cannot work, a HINT, exit code 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from phalanx.cli.main import main


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def refusal(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and "\nHINT: " in err, err
    return err


def test_zero_processes_per_node(capsys, script):
    assert "--nproc-per-node 0: a node runs at least 1 worker process" in refusal(
        capsys, "run", "--nproc-per-node", "0", script
    )


def test_a_loopback_interface_for_several_nodes(capsys, script):
    err = refusal(capsys, "run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "192.0.2.77:29400",
                  "--interface", "lo", script)  # fmt: skip
    assert "--interface lo is the loopback interface, but the job has several nodes" in err


@pytest.mark.parametrize("kind", ["file", "proc"])
def test_a_log_dir_that_cannot_hold_logs(capsys, tmp_path, script, kind):
    log_dir = tmp_path / "a-file" if kind == "file" else "/proc/phalanx-logs"
    if kind == "file":
        log_dir.write_text("")
    err = refusal(capsys, "run", "--log-dir", str(log_dir), script)
    assert f"--log-dir {log_dir} " + ("is a file, not a folder" if kind == "file" else "cannot be written") in err


def test_a_log_dir_under_a_folder_this_user_cannot_enter_is_refused_not_a_traceback(tmp_path):
    """As an unprivileged user (root enters every folder): the look for what to make already fails."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    tmp_path.chmod(0o755)
    probe = "from pathlib import Path\nfrom phalanx.launch.job import check_log_dir\ncheck_log_dir(Path(%r))\n"
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run([*nobody, sys.executable, "-c", probe % str(locked / "logs")], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    if "Permission denied" in done.stderr and "phalanx" not in done.stderr:
        pytest.skip("this checkout cannot be read by an unprivileged user")
    assert "SettingsRefused: phalanx: error: --log-dir" in done.stderr and "cannot be written" in done.stderr, (
        done.stderr
    )
    assert "PermissionError" not in done.stderr, done.stderr


@pytest.mark.parametrize("simulated", [(), ("--simulate-nodes", "2")], ids=["one-node", "simulated-nodes"])
def test_a_taken_rendezvous_port_is_named_with_its_holder(capsys, script, simulated):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = refusal(capsys, "run", "--dry-run", *simulated, "--rdzv-endpoint", f"127.0.0.1:{port}", script)
    assert f"port {port} on this host is taken (by process" in err and sys.executable.split("/")[-1] in err
    where = "(or leave it out: a free one is picked)" if simulated else "on every node"
    assert f"pick another port in --rdzv-endpoint {where}\n" in err, err


def test_a_holder_command_line_is_shortened_on_one_line(capsys, script):
    # python -c with a program of several lines, longer than the message keeps
    program = "import socket, sys\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
    program += "print(s.getsockname()[1], flush=True)\nsys.stdin.read()\n" + "#" * 200
    holder = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        err = refusal(capsys, "run", "--dry-run", "--rdzv-endpoint", f"127.0.0.1:{port}", script)
    finally:
        holder.communicate("", timeout=30)
    taken = err.splitlines()[0]
    assert f"port {port} on this host is taken (by process {holder.pid}: " in taken, err
    assert "s = socket.socket() s.bind" in taken and taken.endswith(" ...)"), taken


def test_one_simulated_node_reads_as_one(script):
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--dry-run", "--simulate-nodes", "1", script],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "as 1 simulated node\n" in done.stdout and "1 node agent on this host, address 127.0.0.101\n" in done.stdout


def test_a_globally_routable_endpoint(capsys, script):
    """torch's store has no authentication: an endpoint anyone on the internet can reach is refused."""
    err = refusal(capsys, "run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "8.8.8.8:29400", script)
    assert "--rdzv-endpoint 8.8.8.8:29400: 8.8.8.8 is a globally routable address" in err
    assert "--allow-public-endpoint" in err
    assert main(["run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "8.8.8.8:29400", "--allow-public-endpoint",
                 script]) in (0, 2)  # fmt: skip
    assert "globally routable" not in capsys.readouterr().err  # allowed; a missing route may still refuse it
