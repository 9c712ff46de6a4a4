"""`phalanx launch` before it connects (host lists, hostfiles, settings), a host that refuses ssh,
and the guard that runs on each host (phalanx.jobs.ssh.remote), with real processes.

The fan-out over real sshd is tested in tests/netns/test_ssh_launch.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from phalanx.cli.main import main
from phalanx.errors import SettingsRefused
from phalanx.jobs.ssh.hosts import SshHost, parse_host_list, read_hostfile
from tests.conftest import kill_group


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return "train.py"


def refusal(capsys, *argv: str) -> str:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and "\nHINT: " in err, err
    return err


def test_host_lists_and_hostfiles(tmp_path):
    assert parse_host_list("gpu1:4, root@gpu2:4") == [SshHost("gpu1", 4), SshHost("root@gpu2", 4)]
    assert parse_host_list("10.0.0.1,10.0.0.2")[1] == SshHost("10.0.0.2")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\ngpu1 slots=8\n\ngpu2   slots=8  # the second\n")
    assert read_hostfile(hostfile) == [SshHost("gpu1", 8), SshHost("gpu2", 8)]
    assert SshHost("root@gpu2").label == "gpu2"


@pytest.mark.parametrize(
    "text, words",
    [
        ("gpu1 slot=4\n", "line 1: 'slot=4' is not understood"),
        ("gpu1 slots=four\n", "slots 'four' is not a positive whole number"),
        ("gpu1 slots=0\n", "slots '0' is not a positive whole number"),
        ("gpu1 slots=2\ngpu1 slots=2\n", "the host gpu1 is named twice"),
        ("# nothing\n", "names no host"),
        ("gpu/1\n", "'gpu/1' is not a host"),
    ],
)
def test_hostfile_mistakes_are_refused_with_the_line(tmp_path, text, words):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(SettingsRefused) as refused:
        read_hostfile(hostfile)
    assert words in refused.value.what and refused.value.hint


@pytest.mark.parametrize("text, words", [("gpu1,,gpu2", "'' is not a host"), ("gpu1:x", "slots 'x'"),
                                         ("gpu1,root@gpu1", "gpu1 is named twice")])  # fmt: skip
def test_host_list_mistakes(text, words):
    with pytest.raises(SettingsRefused) as refused:
        parse_host_list(text)
    assert words in refused.value.what


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train.py"], "no hosts given"),
        (["--hosts", "a,b", "--hostfile", "h", "train.py"], "both --hosts and --hostfile"),
        (["--hostfile", "missing.txt", "train.py"], "--hostfile missing.txt: the file does not exist"),
        (["--hosts", "a,b"], "no training script given"),
        (["--hosts", "a:2,b:4", "train.py"], "the hosts have different slots (a:2, b:4)"),
        (["--hosts", "a:2,b", "train.py"], "the hosts have different slots (a:2, b:-)"),
        (["--hosts", "a:2,b:2", "--nproc-per-node", "4", "train.py"], "--nproc-per-node is 4, but the host list gives"),
        (["--hosts", "a,b", "--nnodes", "3", "train.py"], "--nnodes gives 3 nodes, but 2 hosts are named"),
        (["--hosts", "a,b", "--simulate-nodes", "2", "train.py"], "--simulate-nodes with phalanx launch"),
        (["--hosts", "a,b", "--standalone", "train.py"], "--standalone with phalanx launch"),
        (["--hosts", "a,b", "--env", "NOT_SET_HERE_X", "train.py"], "--env NOT_SET_HERE_X: it is not set here"),
        (["--hosts", "a,b", "--env", "1X=2", "train.py"], "'1X' is not a variable name"),
        (["--hosts", "a,b", "--grace", "0", "train.py"], "--grace 0 is not a positive number of seconds"),
    ],
)
def test_settings_refused_before_connecting(capsys, script, argv, words):
    assert words in refusal(capsys, *argv)


def test_a_host_that_refuses_ssh_is_named_with_a_hint(capsys, script):
    """Nothing listens on port 1 here: ssh fails at once, and the preflight says so for that host."""
    assert main(["launch", "--hosts", "127.0.0.1", "--ssh-option", "Port=1", "--preflight-timeout", "20", script]) == 2
    err = capsys.readouterr().err
    assert "phalanx launch: preflight of 1 host in " in err
    assert "127.0.0.1: ssh failed: " in err and "Connection refused" in err
    assert "HINT: the host is up, but no sshd listens on that port" in err
    assert "127.0.0.1  failed" in err  # the table's ssh column
    assert "nothing was started" in err


def test_a_host_name_that_does_not_resolve_gets_its_own_hint(capsys, script):
    assert main(["launch", "--hosts", "nosuch.invalid", "--preflight-timeout", "20", script]) == 2
    err = capsys.readouterr().err
    assert "nosuch.invalid: ssh failed: ssh: Could not resolve hostname nosuch.invalid" in err, err
    assert "HINT: check the host's name, or give its address" in err and "ssh-copy-id" not in err, err


def test_a_host_that_never_answers_is_named_within_the_preflight_timeout(capsys, script):
    """A port that takes the connection and says nothing (a hung sshd, a firewall's tarpit): ssh
    waits for a banner that never comes. The preflight ends within --preflight-timeout (plus the
    time to end its ssh processes), names the host, and leaves no ssh running."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        started = time.monotonic()
        code = main(["launch", "--hosts", "127.0.0.1", "--ssh-option", f"Port={port}", "--preflight-timeout", "3",
                     "--dry-run", script])  # fmt: skip
        seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert "127.0.0.1: did not answer in time" in err and "127.0.0.1  no answer" in err, err
    assert 3 <= seconds < 3 + 2, seconds
    assert psutil.Process().children(recursive=True) == []


def test_the_command_each_host_runs(script):
    from phalanx.cli.main import build_parser
    from phalanx.jobs.ssh.job import job_from_args

    environ = {"NCCL_DEBUG": "INFO", "HOME": "/root", "TOKEN": "s e"}
    args = build_parser().parse_args(["launch", "--hosts", "gpu1:4,gpu2:4", "--all-ranks", "--env", "TOKEN",
                                      "--max-restarts", "2", "train.py", "--epochs", "3"])  # fmt: skip
    job = job_from_args(args, environ=environ)
    line = job.command("10.0.0.1")
    assert line.startswith(f"cd {os.getcwd()} && exec env NCCL_DEBUG=INFO 'TOKEN=s e' ")
    assert "HOME=" not in line
    assert (f"-m phalanx.jobs.ssh.remote --grace 30 -- {sys.executable} -m phalanx run --nnodes 2 --nproc-per-node 4 "
            f"--rdzv-endpoint 10.0.0.1:29400 --rdzv-id {job.rdzv_id} --max-restarts 2 --all-ranks train.py --epochs 3"
            ) in line  # fmt: skip


@pytest.mark.parametrize("forwarded", [True, False], ids=["default env", "--no-default-env"])
def test_the_hosts_settings_come_from_the_variables_they_get(script, forwarded):
    """The job is planned from the variables every host gets: with --no-default-env, this
    shell's PHALANX_<FLAG> and PET_<FLAG> change nothing, and --env's do."""
    from phalanx.cli.main import build_parser
    from phalanx.jobs.ssh.job import job_from_args

    environ = {"PHALANX_NPROC_PER_NODE": "3", "PET_RDZV_ID": "shell", "PHALANX_MAX_RESTARTS": "2"}
    argv = ["launch", "--hosts", "gpu1,gpu2", "--env", "PHALANX_RDZV_ENDPOINT=h1:29555"]
    args = build_parser().parse_args([*argv, *([] if forwarded else ["--no-default-env"]), "train.py"])
    job = job_from_args(args, environ=environ)
    assert job.port == 29555
    assert (job.nproc, job.rdzv_id == "shell") == (("3", True) if forwarded else ("1", False))
    assert ("PHALANX_MAX_RESTARTS" in job.environment) is forwarded


@pytest.mark.parametrize("extra", [["--env", "PET_NNODES=2"], ["--no-default-env", "--env", "PET_NNODES=2"]])
def test_torchruns_markers_given_by_env_are_refused(capsys, script, extra):
    err = refusal(capsys, "--hosts", "gpu1,gpu2", *extra, "train.py")
    assert "PET_NNODES=2 given by --env" in err and "HINT: leave out --env PET_NNODES;" in err, err


def test_the_config_file_is_not_a_variable_for_the_hosts(capsys, script):
    err = refusal(capsys, "--hosts", "gpu1,gpu2", "--env", "PHALANX_CONFIG=launch.toml", "train.py")
    assert "--env PHALANX_CONFIG=launch.toml: the config file is read here" in err and "--config FILE" in err, err


# -- the guard on each host ---------------------------------------------------------------------
def guard(*command: str, grace: float = 2, silence: float = 30) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        "phalanx.jobs.ssh.remote",
        "--grace",
        str(grace),
        "--silence",
        str(silence),
        "--",
        *command,
    ]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)


#: A process that starts a grandchild and reports both pids; it ignores SIGTERM when told to.
FAMILY = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(os.getpid(), child.pid, flush=True)
time.sleep(300)
"""


def kill_all(process: subprocess.Popen[str], pids: list[int]) -> None:
    """The guard's group and the family it started (in a session of its own): nothing left."""
    kill_group(process.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def family(process: subprocess.Popen[str]) -> list[int]:
    assert process.stdout is not None
    return [int(pid) for pid in process.stdout.readline().split()]


def gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stubborn", [False, True])
def test_the_end_of_the_guards_input_ends_its_process_group(stubborn):
    """The launcher or its ssh connection gone: SIGTERM, and SIGKILL after the grace for a
    process that ignores SIGTERM; the grandchild goes too."""
    # The grace applies only to the stubborn one: it ends no sooner than its 2 s; the polite one
    # ends well within its 60 s, with no bound a loaded machine could stretch it past.
    grace = 2 if stubborn else 60
    process = guard(sys.executable, "-c", FAMILY, "stubborn" if stubborn else "polite", grace=grace)
    pids = []
    try:
        pids = family(process)
        started = time.monotonic()
        process.stdin.close()
        assert process.wait(timeout=30) == (128 + signal.SIGKILL if stubborn else 128 + signal.SIGTERM)
        assert gone(pids, within=5)
        if stubborn:
            assert time.monotonic() - started >= grace
    finally:
        kill_all(process, pids)


@pytest.mark.parametrize("word, number", [("INT", signal.SIGINT), ("TERM", signal.SIGTERM), ("KILL", signal.SIGKILL)])
def test_the_guards_words(word, number):
    process = guard(sys.executable, "-c", FAMILY, "polite", grace=60)
    pids = []
    try:
        pids = family(process)
        process.stdin.write(f"{word}\n")
        process.stdin.flush()
        assert process.wait(timeout=10) == 128 + number  # well within the 60 s grace
        assert gone(pids, within=5)
    finally:
        kill_all(process, pids)


def test_a_launcher_that_falls_silent_ends_the_job():
    """A cut link closes no connection: no word (BEAT) for --silence seconds counts as the end."""
    process = guard(sys.executable, "-c", FAMILY, "polite", silence=1)
    pids = []
    try:
        pids = family(process)
        assert process.wait(timeout=10) == 128 + signal.SIGTERM
        assert gone(pids, within=5)
    finally:
        kill_all(process, pids)


def test_the_guard_exits_with_its_commands_code():
    process = guard(sys.executable, "-c", "import sys; sys.exit(75)")
    assert process.wait(timeout=30) == 75


def test_a_guard_killed_outright_takes_its_command_along(tmp_path):
    process = guard(sys.executable, "-c", FAMILY, "stubborn", grace=60)
    pids = []
    try:
        pids = family(process)
        process.kill()
        process.wait(timeout=10)
        assert gone(pids[:1], within=5)  # the command dies with its guard (PR_SET_PDEATHSIG)
    finally:
        kill_all(process, pids)
