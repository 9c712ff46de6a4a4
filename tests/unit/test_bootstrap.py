"""The worker's entry point: the script runs as python runs it, dies with its launcher, and
says whether it joined the job's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from phalanx.launch.group_record import GroupRecord, hint_for, solo_ranks
from phalanx.worker_env import WorkerEnv

BOOT = [sys.executable, "-m", "phalanx.launch.bootstrap"]


def run_boot(tmp_path, *argv, env=None, timeout=60):
    return subprocess.run([*BOOT, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})  # fmt: skip


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_argv_main_path_and_exit_code_as_python_gives_them(tmp_path):
    script = write(
        tmp_path,
        "s.py",
        """
        import sys
        print(sys.argv, __name__, sys.path[0])
        sys.exit(3)
    """,
    )
    done = run_boot(tmp_path, script, "a", "--b")
    assert done.returncode == 3
    assert done.stdout.strip() == f"[{script!r}, 'a', '--b'] __main__ {tmp_path}"


def test_a_traceback_reads_as_pythons_own(tmp_path):
    script = write(
        tmp_path,
        "s.py",
        """
        def f():
            raise ValueError("boom")
        f()
    """,
    )
    done = run_boot(tmp_path, script)
    direct = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == direct.returncode == 1
    assert done.stderr == direct.stderr
    assert "runpy" not in done.stderr and "bootstrap" not in done.stderr


def test_a_module_with_arguments(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write(tmp_path, "pkg/tool.py", "import sys; print(sys.argv[1:], __name__)\n")
    done = run_boot(tmp_path, "-m", "pkg.tool", "x", "-m", "y")
    assert done.returncode == 0 and done.stdout.strip() == "['x', '-m', 'y'] __main__"


def ended_within(process: psutil.Process, seconds: float) -> bool:
    """Whether the process ended: gone, or a zombie (its new parent, the machine's init, may never reap it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_a_worker_dies_within_a_second_of_its_launcher(tmp_path):
    # The script runs once the worker asked the kernel to end it with its launcher; the launcher
    # is killed after that. (One killed before that is the next test's case: the worker ends as
    # it gets there, which takes as long as python's start on a loaded machine.)
    ready = tmp_path / "running"
    script = write(
        tmp_path, "sleep.py", f"import pathlib, time\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)\n"
    )
    parent = write(
        tmp_path,
        "parent.py",
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen({BOOT!r} + [{script!r}],
                                 env={{**os.environ, "PHALANX_LAUNCHER_PID": str(os.getpid())}})
        print(child.pid, flush=True)
        time.sleep(120)
    """,
    )
    launcher = subprocess.Popen([sys.executable, parent], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(launcher.stdout.readline()))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.is_running() and time.monotonic() < deadline, "the worker's script did not start"
            time.sleep(0.02)
        launcher.kill()
        launcher.wait()
        assert ended_within(child, 1.0), "the worker outlived its SIGKILLed launcher by more than a second"
    finally:
        launcher.kill()


def test_a_worker_whose_launcher_died_before_it_started_ends_at_once(tmp_path):
    script = write(tmp_path, "sleep.py", "import time\ntime.sleep(120)\n")
    started = time.monotonic()
    done = run_boot(tmp_path, script, env={"PHALANX_LAUNCHER_PID": "1"})  # not this process's parent
    assert done.returncode == -signal.SIGKILL and time.monotonic() - started < 30


def test_a_script_that_joins_a_group_of_its_world_records_it(tmp_path):
    record = tmp_path / "process_group.json"
    script = write(
        tmp_path,
        "join.py",
        """
        import torch.distributed as dist
        from torch.distributed import init_process_group  # the name taken before any call
        init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        dist.destroy_process_group()
    """,
    )
    done = run_boot(tmp_path, script, env={"PHALANX_GROUP_RECORD": str(record), "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr
    found = GroupRecord.read(record)
    assert found.joined_world == 1 and found.collectives == 0 and not found.ran_alone  # a world of one


def test_a_device_mesh_counts_as_joining(tmp_path):
    record = tmp_path / "process_group.json"
    script = write(
        tmp_path,
        "mesh.py",
        """
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0")  # a world of one: any free port
        from torch.distributed.device_mesh import init_device_mesh
        import torch.distributed as dist
        init_device_mesh("cpu", (1,))
        dist.destroy_process_group()
    """,
    )
    done = run_boot(tmp_path, script, env={"PHALANX_GROUP_RECORD": str(record), "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr
    assert GroupRecord.read(record).joined_world == 1


def test_a_script_that_never_joins_records_that_it_ran_alone(tmp_path):
    record = tmp_path / "process_group.json"
    script = write(tmp_path, "alone.py", "import torch\nprint(torch.ones(1).item())\n")
    done = run_boot(tmp_path, script, env={"PHALANX_GROUP_RECORD": str(record), "WORLD_SIZE": "4"})
    assert done.returncode == 0
    found = GroupRecord.read(record)
    assert found == GroupRecord(0, 4, (), None) and found.ran_alone


@pytest.mark.parametrize("collective", [False, True], ids=["idle group", "one all-reduce"])
def test_a_world_of_two_that_never_communicates_ran_alone(tmp_path, collective):
    """Accelerate on CPUs without ACCELERATE_USE_CPU=1 creates the group, then trains alone: the
    group alone is no evidence. One all-reduce is, also after the group was destroyed. The two
    meet through a file: a port probed free and closed can be taken by any outgoing connection of
    a parallel test before rank 0 listens on it. Neither destroys the group before the other has
    formed it (a file each, no collective): gloo's connect of the one would find the other gone."""
    script = write(
        tmp_path,
        "two.py",
        f"""
        import os, sys, time, torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=int(os.environ["RANK"]),
                                world_size=2)
        if sys.argv[1] == "yes":
            dist.all_reduce(torch.ones(1))
        rank = int(os.environ["RANK"])
        open(f"formed{{rank}}", "w").close()
        while not os.path.exists(f"formed{{1 - rank}}"):
            time.sleep(0.01)
        dist.destroy_process_group()
    """,
    )
    ranks = [subprocess.Popen([*BOOT, script, "yes" if collective else "no"], cwd=tmp_path,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
                                   "PHALANX_GROUP_RECORD": str(tmp_path / f"rank{rank}.json")})
             for rank in (0, 1)]  # fmt: skip
    assert [rank.wait(timeout=60) for rank in ranks] == [0, 0]
    records = [GroupRecord.read(tmp_path / f"rank{rank}.json") for rank in (0, 1)]
    assert all(record.joined_world == 2 for record in records)
    assert [record.ran_alone for record in records] == [not collective, not collective]
    assert all((record.collectives > 0) == collective for record in records)


def test_no_claim_without_evidence():
    assert not GroupRecord(2, 2, (), None).ran_alone  # a recorder that was off: the whole group formed
    assert GroupRecord(1, 2, (), None).ran_alone  # a group of one in a job of two


def test_solo_ranks_and_hints():
    records = {0: GroupRecord(0, 2, ("accelerate",)), 1: GroupRecord(2, 2, ()), 2: None}
    assert solo_ranks(records) == [0]
    assert "ACCELERATE_USE_CPU=1" in hint_for([r for r in records.values() if r])
    assert "init_process_group" in hint_for([GroupRecord(0, 2, ())])


def test_a_usr1_before_the_script_handles_it_is_kept_for_the_preemption_guard(tmp_path):
    script = write(
        tmp_path,
        "early.py",
        """
        import os, signal, time
        os.kill(os.getpid(), signal.SIGUSR1)   # as SLURM's notice passed on while the worker starts
        time.sleep(0.2)
        print(os.environ.get("PHALANX_EARLY_SIGNAL"))
    """,
    )
    done = run_boot(tmp_path, script)
    assert done.returncode == 0 and done.stdout.strip() == "SIGUSR1"


def test_heal_modes_supervisor_removes_the_exit_record_of_the_child_before(tmp_path):
    # a replacement killed before its exit handlers must not leave its predecessor's record to be
    # read as its own (the launcher would take that rank for one that ended on its own)
    record = tmp_path / "process_group.json"
    GroupRecord(2, 2).write(record)
    script = write(tmp_path, "s.py", f"import os\nprint('record there:', os.path.exists({str(record)!r}))\n")
    supervise = (
        "import sys; from phalanx.launch.supervisor import Supervisor; sys.exit(Supervisor(sys.argv[1:], 0).run())"
    )
    done = subprocess.run([sys.executable, "-c", supervise, script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, WorkerEnv.key_of("group_record"): str(record)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "record there: False" in done.stdout, done.stdout
