"""phalanx launch's fan-out (phalanx.jobs.ssh.fanout) with real processes: "ssh" here runs the
remote line in a local shell, so that the supervision, the words to the guards and the
escalation are tested without hosts (tests/netns/test_ssh_launch.py has the real sshd)."""

from __future__ import annotations

import io
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from phalanx.jobs.ssh.fanout import run_on_hosts
from phalanx.jobs.ssh.hosts import SshHost
from phalanx.jobs.ssh.transport import Ssh

PYTHON = sys.executable


class LocalShell(Ssh):
    """ssh to nowhere: the remote line runs in ``sh -c`` on this machine."""

    def argv(self, host: str, remote_command: str) -> list[str]:
        return ["sh", "-c", remote_command]


def guarded(code: str, grace: float = 1.0) -> str:
    """The remote line phalanx launch writes: the guard, then Python running ``code``."""
    return shlex.join([PYTHON, "-m", "phalanx.jobs.ssh.remote", "--grace", str(grace), "--", PYTHON, "-c", code])


HOSTS = [SshHost("a"), SshHost("b")]
SLEEP = "import time; time.sleep(300)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def no_process_named(marker: str) -> bool:
    return not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
                and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip


def test_the_job_exits_with_the_first_failing_hosts_code_and_the_others_are_stopped(capsys):
    started = time.monotonic()
    code = run_on_hosts(HOSTS, LocalShell(), [guarded("import sys; sys.exit(3)"), guarded(SLEEP + " # marker-d")], 1.0)
    assert code == 3 and time.monotonic() - started < 10  # b got SIGTERM after the 1 s grace
    err = capsys.readouterr().err
    assert "phalanx launch: a failed: its phalanx run exited with code 3" in err
    assert "b still running: SIGTERM" in err and "exit codes a 3, b 143; the job's is 3, from a" in err
    assert no_process_named("marker-d")


def test_output_comes_back_prefixed_and_a_closed_output_does_not_stop_the_job(monkeypatch, capsys):
    chatty = "import sys\nfor i in range(20000): print('line', i)\nsys.exit(0)"
    assert run_on_hosts(HOSTS[:1], LocalShell(), [guarded("print('hello')")], 1.0) == 0
    assert capsys.readouterr().out == "a: hello\n"
    closed = io.StringIO()
    closed.close()  # `phalanx launch ... | head -1`: the reader is gone
    monkeypatch.setattr(sys, "stdout", closed)
    started = time.monotonic()
    assert run_on_hosts(HOSTS[:1], LocalShell(), [guarded(chatty)], 1.0) == 0  # ssh never blocked on a full pipe
    assert time.monotonic() - started < 20


def test_a_process_that_left_the_group_is_killed_with_the_rest():
    """It calls setsid and keeps the guard's output open: the guard (a child subreaper) still
    finds it, so the host's connection closes when the command ends."""
    escape = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([{PYTHON!r}, "-c", "import os, time; os.setsid(); time.sleep(300)  # marker-e"])
        sys.exit(0)
    """)
    started = time.monotonic()
    assert run_on_hosts(HOSTS[:1], LocalShell(), [guarded(escape)], 1.0) == 0
    assert time.monotonic() - started < 10
    assert no_process_named("marker-e")


def test_a_host_that_ignores_every_word_is_let_go_so_the_launcher_ends(capsys):
    """No guard on the far side (as a broken host): TERM, KILL, then the connection is closed."""
    line = shlex.join(["exec", PYTHON, "-c", STUBBORN + " # marker-f"])
    started = time.monotonic()
    code = run_on_hosts(HOSTS, LocalShell(), [guarded("import sys; sys.exit(1)"), line], 0.5)
    assert code == 1 and time.monotonic() - started < 10
    assert "b did not end after SIGKILL; closing the ssh connection" in capsys.readouterr().err
    assert no_process_named("marker-f")


def test_ctrl_c_asks_every_host_and_a_second_one_kills_at_once(tmp_path):
    """In a process of its own (the launcher's signal handlers belong to its main thread); the
    remote command ignores SIGINT and SIGTERM, so only the second Ctrl-C ends it."""
    from tests.conftest import REPO

    deaf = ("import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (2, 15)]; print('deaf', flush=True); "
            "time.sleep(300)  # marker-g")  # fmt: skip
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from phalanx.jobs.ssh.fanout import run_on_hosts
        from tests.unit.test_fanout import HOSTS, LocalShell, guarded
        print("started", flush=True)
        sys.exit(run_on_hosts(HOSTS, LocalShell(), [guarded({deaf!r}, grace=60)] * 2, 60))
    """)
    )
    launcher = subprocess.Popen([PYTHON, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
    try:
        assert launcher.stdout.readline() == "started\n"
        # both commands ignore the signals now (a Ctrl-C before that would end them at once)
        assert sorted(launcher.stdout.readline() for _ in HOSTS) == ["a: deaf\n", "b: deaf\n"]
        launcher.send_signal(signal.SIGINT)
        time.sleep(1)
        assert launcher.poll() is None  # the commands ignore it, and the grace is 60 s
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=20) == 130
        err = launcher.communicate()[1]
        assert "SIGINT: stopping the job on every host; Ctrl-C again kills them at once" in err, err
        assert "phalanx launch: stopping every host at once (SIGKILL)" in err
        assert no_process_named("marker-g")
    finally:
        launcher.kill()
