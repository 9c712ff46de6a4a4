"""`phalanx launch` over OpenSSH's real sshd, one in each host of a test bed (network namespaces).

The keys are made by the test; the hosts are reached through an ssh config file that gives each
its address, port, user and key, as a user's ~/.ssh/config would. h3 sees a different script at
the same path (a folder mounted over the job's folder for its sessions alone), as machines
without a shared file system can. What runs on a host is what runs in its network namespace:
after each test only its sshd may be left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.testbed import test_bed
from phalanx.testbed.sshd import sshd_on
from tests.conftest import EXAMPLES, finish, run_command
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]

TRAIN = ["train.py", "--epochs", "1", "--samples", "256"]
#: Bound for a host's processes to be gone after the launcher returned.
LEFTOVER_BOUND_S = 10


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    skip_unless_namespaces_work()
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs OpenSSH's sshd (make cluster-deps installs openssh-server)")
    folder = tmp_path_factory.mktemp("launch")
    job, other = folder / "job", folder / "h3-job"
    job.mkdir()
    other.mkdir()
    (job / "train.py").write_text((EXAMPLES / "train.py").read_text())
    (other / "train.py").write_text((EXAMPLES / "train.py").read_text() + "\n# edited on h3 only\n")
    with test_bed(f"s{os.getpid() % 10000}", ["h1", "h2", "h3"]) as bed:
        with sshd_on(bed, folder / "ssh", private={"h3": [(other, job)]}) as ssh_bed:
            with (ssh_bed.config).open("a") as config:  # a host whose ssh refuses connections
                config.write(f"Host nossh\n  HostName {bed.bridge_address}\n  Port 2222\n  BatchMode yes\n")
            yield ssh_bed, job


def launch(ssh_bed, job: Path, *args: str, timeout: float = 150):
    argv = [sys.executable, "-m", "phalanx", "launch", "--ssh-config", str(ssh_bed.config), *args]
    return run_command(argv, timeout=timeout, cwd=job)


def only_sshd_left(ssh_bed) -> dict[str, list[str]]:
    """Each host's processes other than its sshd (by their command lines), once they are gone or
    after LEFTOVER_BOUND_S."""
    deadline = time.monotonic() + LEFTOVER_BOUND_S
    while True:
        left = {name: [_cmdline(pid) for pid in ssh_bed.bed.processes(name) if pid != daemon]
                for name, daemon in ssh_bed.daemons.items()}  # fmt: skip
        left = {name: [command for command in commands if command] for name, commands in left.items()}
        if not any(left.values()) or time.monotonic() > deadline:
            return {name: cmds for name, cmds in left.items() if cmds}
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    if "\nState:\tZ" in status:
        return ""  # a zombie: dead, left to an init that does not reap it
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def test_two_hosts_train_as_one_world_like_two_simulated_nodes(hosts):
    ssh_bed, job = hosts
    launched = launch(ssh_bed, job, "--hosts", "h1,h2", *TRAIN, "--metrics-json", str(job / "launched.json"))
    assert launched.returncode == 0, launched.output[-4000:]
    assert (
        "h1: [10." in launched.stdout
        and "h1: phalanx: rank table: 2 nodes x 1 process = world size 2" in launched.stderr
    )
    assert "phalanx launch: preflight of 2 hosts" in launched.stderr
    simulated = run_command([sys.executable, "-m", "phalanx", "run", "--simulate-nodes", "2", *TRAIN, "--metrics-json",
                             str(job / "simulated.json")], timeout=150, cwd=job)  # fmt: skip
    assert simulated.returncode == 0, simulated.output[-3000:]
    ours, theirs = (json.loads((job / name).read_text()) for name in ("launched.json", "simulated.json"))
    assert ours["world_size"] == theirs["world_size"] == 2
    assert ours["params_sha256"] == theirs["params_sha256"]
    assert only_sshd_left(ssh_bed) == {}


def test_a_host_that_refuses_ssh_is_named_before_anything_starts(hosts):
    ssh_bed, job = hosts
    refused = launch(ssh_bed, job, "--hosts", "h1,nossh", *TRAIN, timeout=60)
    assert refused.returncode == 2, refused.output
    assert "nossh: ssh failed: " in refused.stderr and "Connection refused" in refused.stderr
    assert "nothing was started" in refused.stderr and "joins job" not in refused.output
    assert only_sshd_left(ssh_bed) == {}


def test_a_host_with_a_different_script_is_named_before_anything_starts(hosts):
    ssh_bed, job = hosts
    refused = launch(ssh_bed, job, "--hosts", "h1,h3", *TRAIN, timeout=60)
    assert refused.returncode == 2, refused.output
    assert "h3: train.py differs from this machine's (SHA-256" in refused.stderr
    assert "h1: " not in refused.stderr.split("phalanx: error:")[1]  # h1's copy is the same
    assert only_sshd_left(ssh_bed) == {}


def test_a_host_that_cannot_reach_the_rendezvous_port_is_named(hosts):
    ssh_bed, job = hosts
    h2 = ssh_bed.bed.host("h2")
    block = ["iptables", "-A", "OUTPUT", "-p", "tcp", "--dport", "29400", "-j", "REJECT"]
    subprocess.run(["ip", "netns", "exec", h2.namespace, *block], check=True, timeout=10)
    try:
        refused = launch(ssh_bed, job, "--hosts", "h1,h2", *TRAIN, timeout=60)
    finally:
        subprocess.run(["ip", "netns", "exec", h2.namespace, "iptables", "-F", "OUTPUT"], check=True, timeout=10)
    assert refused.returncode == 2, refused.output
    assert f"h2: cannot reach the rendezvous port {ssh_bed.bed.host('h1').address}:29400: " in refused.stderr
    assert "h1: cannot reach" not in refused.stderr
    assert only_sshd_left(ssh_bed) == {}


def start_long_training(ssh_bed, job: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "phalanx", "launch", "--ssh-config", str(ssh_bed.config), "--hosts", "h1,h2",
            "--grace", "10", "--env", "LAUNCH_MARK=on-every-host", "train.py", "--epochs", "1000", "--log-every", "1"]  # fmt: skip
    return subprocess.Popen(argv, cwd=job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def wait_for_training(process: subprocess.Popen[str], timeout: float) -> list[str]:
    """Reads the launcher's output until rank 0 logs a step; returns what it read."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if "step " in line and "rank0]" in line:
            return seen
        if not line and process.poll() is not None:
            break
    process.kill()
    pytest.fail(
        f"no training step within {timeout} s:\n{''.join(seen)}{process.stderr.read() if process.stderr else ''}"
    )


@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_mid_training_stops_every_host_and_leaves_nothing(hosts, number, code):
    ssh_bed, job = hosts
    process = start_long_training(ssh_bed, job)
    wait_for_training(process, timeout=120)
    os.kill(process.pid, number)  # a terminal's Ctrl-C reaches the launcher alone (ssh runs in its own session)
    done = finish(process, timeout=60)
    assert done.returncode == code, done.stderr[-3000:]
    assert f"phalanx launch: {signal.Signals(number).name}: stopping the job on every host" in done.stderr
    assert only_sshd_left(ssh_bed) == {}
    print(f"MEASURED: {signal.Signals(number).name} to the end of phalanx launch: {done.seconds:.1f} s")


def test_a_launcher_killed_outright_leaves_nothing_on_the_hosts(hosts):
    """SIGKILL gives the launcher no say: its ssh clients see their input close, and so does each
    host's guard, which stops phalanx run (SIGTERM, then SIGKILL after --grace)."""
    ssh_bed, job = hosts
    process = start_long_training(ssh_bed, job)
    wait_for_training(process, timeout=120)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert only_sshd_left(ssh_bed) == {}


def test_a_worker_killed_on_one_host_ends_the_job_everywhere(hosts):
    ssh_bed, job = hosts
    process = start_long_training(ssh_bed, job)
    wait_for_training(process, timeout=120)
    workers = [pid for pid in ssh_bed.bed.processes("h2") if "phalanx.launch.bootstrap" in _cmdline(pid)]
    assert workers, "no worker found on h2"
    assert b"LAUNCH_MARK=on-every-host\0" in Path(f"/proc/{workers[0]}/environ").read_bytes()  # --env got there
    h1 = ssh_bed.bed.host("h1")
    listening = subprocess.run(["ip", "netns", "exec", h1.namespace, "ss", "-ltnH"], capture_output=True, text=True,
                               timeout=10).stdout  # fmt: skip
    assert f"{h1.address}:29400 " in listening and ":29400 " not in listening.replace(f"{h1.address}:29400 ", "")
    os.kill(workers[0], signal.SIGKILL)
    done = finish(process, timeout=90)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "was killed by SIGKILL" in done.stderr  # the root cause, as phalanx run names it
    assert only_sshd_left(ssh_bed) == {}
    print(f"MEASURED: worker SIGKILL to the end of phalanx launch: {done.seconds:.1f} s")


def test_preflight_of_eight_hosts(tmp_path):
    skip_unless_namespaces_work()
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs OpenSSH's sshd (make cluster-deps installs openssh-server)")
    names = [f"h{k}" for k in range(1, 9)]
    (tmp_path / "train.py").write_text((EXAMPLES / "train.py").read_text())
    with test_bed(f"p{os.getpid() % 10000}", names) as bed, sshd_on(bed, tmp_path / "ssh") as ssh_bed:
        for hosts_given in ("h1,h2", ",".join(names)):
            done = launch(ssh_bed, tmp_path, "--hosts", hosts_given, "--dry-run", "train.py", timeout=60)
            assert done.returncode == 0, done.output
            assert done.stdout.count("phalanx.jobs.ssh.remote") == 1 and "--nnodes" in done.stdout
            seconds = float(done.stderr.split(" hosts in ")[1].split(" s\n")[0])
            print(f"MEASURED: preflight of {hosts_given.count(',') + 1} hosts: {seconds:.1f} s")
            assert seconds < 30
