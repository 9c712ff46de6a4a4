"""`phalanx run --simulate-nodes`: real torchrun agents, real c10d rendezvous, real gloo sockets."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import EXAMPLES, WORKERS, gloo_flight_recorder_on, kill_group, phalanx_argv

pytestmark = pytest.mark.slow


def copy_worker(workdir: Path, name: str) -> str:
    shutil.copy(WORKERS / name, workdir / name)
    return str(workdir / name)


def rank_table(output: str) -> dict[int, tuple[str, str, str]]:
    """node -> (address, global ranks, local ranks), parsed from the printed table."""
    rows = re.findall(r"^\s+(\d+)\s+(node\d+)\s+([\d.]+)\s+([\d,-]+)\s+([\d,-]+)\s*$", output, re.M)
    return {int(node): (address, ranks, local) for node, _, address, ranks, local in rows}


@pytest.mark.compat
def test_two_simulated_nodes_of_two_processes(phalanx, workdir):
    script = copy_worker(workdir, "env_dump.py")
    result = phalanx("run", "--simulate-nodes", "2", "--nproc-per-node", "2", script, str(workdir), "--flag", "x")
    assert result.returncode == 0, result.output
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in workdir.glob("rank*.json")}
    assert sorted(records) == [0, 1, 2, 3]
    for env in records.values():
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["allreduce"] == 0 + 1 + 2 + 3
        assert env["argv"] == ["--flag", "x"]  # script arguments untouched
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["MASTER_ADDR"] == "127.0.0.101"  # node0's advertised address, not the hostname
        assert env["PHALANX_BACKEND"] == "gloo"
    by_node: dict[str, list[int]] = {}
    for rank, env in sorted(records.items()):
        by_node.setdefault(env["PHALANX_NODE"], []).append(rank)
    assert by_node == {"node0": [0, 1], "node1": [2, 3]}  # contiguous global ranks per node
    for ranks in by_node.values():
        assert [int(records[r]["LOCAL_RANK"]) for r in ranks] == [0, 1]
        assert len({records[r]["GROUP_RANK"] for r in ranks}) == 1

    plan = rank_table(result.stderr)
    assert plan == {0: ("127.0.0.101", "0-1", "0-1"), 1: ("127.0.0.102", "2-3", "0-1")}, result.stderr
    assert "world size 4" in result.stderr
    for node, (_, ranks, _) in plan.items():
        first, last = (int(r) for r in ranks.split("-"))
        assert by_node[f"node{node}"] == list(range(first, last + 1)), (node, ranks, by_node)

    # the console shows rank 0 only, prefixed; every rank has its own log file
    assert "[node0 rank0]: hello from rank 0" in result.stdout
    assert "hello from rank 1" not in result.stdout and "hello from rank 3" not in result.stdout
    logs = list(workdir.glob("phalanx-logs/*/attempt_0/rank3/stdout.log"))
    assert len(logs) == 1 and "hello from rank 3" in logs[0].read_text()
    assert result.stderr.count("rank table:") == 1  # printed once, by the node that holds rank 0
    assert result.stderr.count("phalanx 0.") == 1  # the decision block, once


def test_a_failing_worker_gives_its_root_cause(phalanx, workdir):
    script = copy_worker(workdir, "fail_on_rank.py")
    result = phalanx("run", "--simulate-nodes", "2", "--nproc-per-node", "2", "--all-ranks", script, "3")
    assert result.returncode == 1, result.output
    last = result.stderr[result.stderr.index("phalanx: root cause:") :]
    assert last.startswith("phalanx: root cause: rank 3 (local rank 1) on node1 (127.0.0.102) exited with code 1")
    assert "ValueError: rank 3 fails on purpose" in last
    assert "Traceback" in last
    # --all-ranks: every rank's lines reach the console, each with its node and rank
    for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"[node{node} rank{rank}]: rank {rank} passed the first all-reduce" in result.stdout


def test_max_restarts_recovers_and_keeps_each_attempts_logs(phalanx, workdir):
    script = copy_worker(workdir, "fail_on_rank.py")
    result = phalanx("run", "--simulate-nodes", "2", "--max-restarts", "1", script, "1", env={"RECOVER": "1"})
    assert result.returncode == 0, result.output
    assert "restart 1" in result.stderr  # the rank table of the second attempt
    assert re.search(
        r"phalanx: node1: rank 1 exited with code 1: ValueError: rank 1 fails on purpose \(\S+"
        r"/attempt_0/rank1/stderr.log\); restarting the workers \(restart 1 of 1\)\n",
        result.stderr,
    ), result.stderr
    run_dir = next((workdir / "phalanx-logs").iterdir())
    assert "fails on purpose" in (run_dir / "attempt_0" / "rank1" / "stderr.log").read_text()
    assert "rank 1 finished" in (run_dir / "attempt_1" / "rank1" / "stdout.log").read_text()


def test_a_refusal_on_one_node_ends_the_job_on_every_node_without_a_restart(phalanx, workdir):
    """node1's rank refuses its settings; node0's rank then fails because it is gone, a crash
    that alone would be restarted. node1 tells node0 that the job ends, so neither restarts, and
    both name the refusal as the root cause."""
    script = copy_worker(workdir, "refuse_on_rank.py")
    result = phalanx("run", "--simulate-nodes", "2", "--max-restarts", "1", script, "1")
    assert result.returncode == 2, result.output  # ExitCode.REFUSED
    assert "phalanx: node1: not restarting the workers (--max-restarts 1): rank 1 refused its settings" in result.stderr
    assert ("phalanx: node0: not restarting the workers (--max-restarts 1): node1 ends the job: rank 1 refused its "
            "settings") in result.stderr, result.stderr  # fmt: skip
    assert "phalanx: root cause: rank 1 (local rank 0) on node1" in result.stderr
    assert [path.name for path in workdir.glob("phalanx-logs/*/attempt_*")] == ["attempt_0"]


def test_a_node_stopped_for_another_nodes_restart_counts_the_same_attempt(phalanx, workdir):
    """Rank 0 is healthy (asleep, in no collective) when rank 1 fails, so node0's agent stops it
    for node1's restart instead of seeing it fail; torchrun's restart count stays 0 there. The
    attempts are still numbered alike on both nodes: no log is overwritten, the plan is right."""
    script = copy_worker(workdir, "fail_on_rank.py")
    result = phalanx(
        "run", "--simulate-nodes", "2", "--max-restarts", "1", script, "1", env={"RECOVER": "1", "HOLD": "4"}
    )
    assert result.returncode == 0, result.output
    assert "world size 2, restart 1" in result.stderr, result.stderr
    run_dir = next((workdir / "phalanx-logs").iterdir())
    first, second = (run_dir / f"attempt_{n}" / "rank0" / "stdout.log" for n in (0, 1))
    assert "rank 0 passed the first all-reduce" in first.read_text() and "finished" not in first.read_text()
    assert "rank 0 finished" in second.read_text()


@pytest.mark.parametrize("max_restarts", ["0", "1"])
def test_a_node_whose_workers_finished_does_not_wait_for_a_failed_one(phalanx, workdir, max_restarts):
    """node0's workers finish; node1's rank fails seconds later. torchrun's agent on node0 would
    wait 5 minutes in its exit barrier for node1, which never comes; with a restart left, node1
    would wait in the rendezvous for node0, which never comes back. Both end within seconds
    (the 60 s timeout is the bound), and node1 names why it does not restart."""
    script = copy_worker(workdir, "rank1_late.py")
    result = phalanx("run", "--simulate-nodes", "2", "--max-restarts", max_restarts, script, timeout=60)
    assert result.returncode == 1, result.output
    finished = (
        "phalanx: node0: its workers finished; exiting without waiting for the other nodes, since node1's "
        "workers failed: rank 1 exited with code 1: ValueError: rank 1 fails after rank 0 finished ("
    )
    assert finished in result.stderr, result.stderr
    assert "phalanx: root cause: rank 1 (local rank 0) on node1" in result.stderr
    if max_restarts == "1":
        assert ("phalanx: node1: not restarting the workers (--max-restarts 1): the workers of node0 already "
                "finished and cannot join a restart") in result.stderr, result.stderr  # fmt: skip
    assert [path.name for path in workdir.glob("phalanx-logs/*/attempt_*")] == ["attempt_0"]


def test_a_node_whose_workers_finished_first_waits_for_the_others(phalanx, workdir):
    """The other half of torchrun's exit barrier, kept: node0 finishes seconds before node1 and
    waits for it (the store it hosts serves node1's agent until then); the job succeeds."""
    script = copy_worker(workdir, "rank1_late.py")
    result = phalanx("run", "--simulate-nodes", "2", "--all-ranks", script, "finish", timeout=60)
    assert result.returncode == 0, result.output
    assert "[node1 rank1]: rank 1 finished" in result.stdout
    assert "exiting without" not in result.stderr


def test_single_node_picks_a_free_port(phalanx, workdir):
    script = copy_worker(workdir, "env_dump.py")
    result = phalanx("run", "--nproc-per-node", "2", script, str(workdir))
    assert result.returncode == 0, result.output
    records = [json.loads(p.read_text()) for p in workdir.glob("rank*.json")]
    assert len(records) == 2 and all(r["MASTER_PORT"] != "29500" for r in records)
    assert "1 node x 2 processes = world size 2" in result.stderr


@pytest.mark.parametrize("given_endpoint", [False, True], ids=["free-port", "loopback-endpoint"])
def test_a_single_node_s_rendezvous_store_listens_on_loopback_only(phalanx, workdir, given_endpoint):
    """torch's store has no authentication: one node needs no other address. (The workers' store,
    MASTER_PORT, is torch's agent's own, on every address: docs/failures.md says so.)"""
    script = copy_worker(workdir, "launcher_listeners.py")
    endpoint = []
    if given_endpoint:  # --rdzv-endpoint 127.0.0.1:PORT, with a port free here
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoint = ["--rdzv-endpoint", f"127.0.0.1:{probe.getsockname()[1]}"]
    result = phalanx("run", *endpoint, script, str(workdir / "found.json"))
    assert result.returncode == 0, result.output
    found = json.loads((workdir / "found.json").read_text())
    stores = [(ip, port) for ip, port in found["listeners"] if port != found["master_port"]]
    assert stores and all(ip == "127.0.0.1" for ip, _ in stores), found
    if endpoint:
        assert int(endpoint[1].rsplit(":", 1)[1]) in [port for _, port in stores], found
        assert "listening on 127.0.0.1 only" in result.stderr


def ended_within(pid: int, seconds: float) -> bool:
    """Whether the process ended: gone, or a zombie (its new parent may not have reaped it yet)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_what_a_worker_started_ends_with_it_after_exit_0(phalanx, workdir):
    script = copy_worker(workdir, "starts_a_child.py")
    result = phalanx("run", script, "301.5", str(workdir / "child.pid"))
    assert result.returncode == 0, result.output
    assert ended_within(int((workdir / "child.pid").read_text()), 5.0), "the worker's child outlived the job"


def test_what_a_worker_started_ends_with_it_after_kill_9_of_the_launcher(workdir):
    script = copy_worker(workdir, "starts_a_child.py")
    ready = workdir / "child.pid"
    launcher = subprocess.Popen(phalanx_argv("run", script, "302.5", str(ready), "--hold"), cwd=workdir,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, "the script did not start its child"
            time.sleep(0.02)
        launcher.kill()  # the launcher alone, as kill -9 does
        launcher.wait()
        assert ended_within(int(ready.read_text()), 5.0), "the worker's child outlived its SIGKILLed launcher"
    finally:
        kill_group(launcher.pid)


def test_dry_run_starts_nothing(phalanx, workdir):
    script = copy_worker(workdir, "env_dump.py")
    result = phalanx("run", "--dry-run", "--simulate-nodes", "2", script, str(workdir))
    assert result.returncode == 0, result.output
    assert result.stdout.count("torchrun --nnodes=2") == 2
    assert "is_host=1" in result.stdout and "is_host=0" in result.stdout
    assert not list(workdir.glob("rank*.json")) and not (workdir / "phalanx-logs").exists()


@pytest.mark.compat
@pytest.mark.parametrize("recorder", ["default", "off"])
def test_tutorial_example_under_phalanx(phalanx, workdir, recorder):
    """A plain DDP script, with torch's flight recorder as the release has it and switched off
    (as torch 2.10 has it for gloo): the check that every rank communicated cannot count the
    collectives then, and says so instead of calling the job solo."""
    script = str(EXAMPLES / "tutorial_ddp.py")
    env = {"TORCH_FR_BUFFER_SIZE": "0"} if recorder == "off" else {}
    result = phalanx("run", "--simulate-nodes", "2", script, "--epochs", "4", "--samples", "256", "--image-size", "16",
                     env=env)  # fmt: skip
    assert result.returncode == 0, result.output
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], result.stdout
    assert "training on 2 process(es)" in result.stdout
    uncounted = (
        "flight recorder did not count the collectives of rank {}, so phalanx cannot tell whether it communicated"
    )
    counted = recorder == "default" and gloo_flight_recorder_on()
    assert all((uncounted.format(rank) in result.stderr) != counted for rank in (0, 1)), result.stderr
    assert "PROBLEM" not in result.stderr
    check_the_start_is_broken_down(result.stderr, workdir, nodes=2)


def check_the_start_is_broken_down(stderr: str, workdir: Path, nodes: int) -> None:
    """One line gives the phases of the node whose start took longest (where there are several),
    which add up to its total; the run's start.json has every node's phases, in order."""
    from phalanx.launch.start_report import PHASES, START_RECORD_NAME

    pattern = r"phalanx: start: (\d+\.\d) s to the first step(?: on (node\d)[ ,(][^:]*)?: (.*)"
    said = re.findall(pattern, stderr)
    assert len(said) == 1, stderr
    total, longest, phases = said[0]
    assert [part.rsplit(" ", 2)[0] for part in phases.split(", ")] == list(PHASES), phases
    assert bool(longest) == (nodes > 1), said
    (record,) = workdir.glob(f"phalanx-logs/*/{START_RECORD_NAME}")
    written = json.loads(record.read_text())["nodes"]
    assert [node["label"] for node in written] == [f"node{index}" for index in range(nodes)], written
    assert all(list(node["phases"]) == list(PHASES) and min(node["phases"].values()) >= 0 for node in written)
    worst = max(written, key=lambda node: sum(node["phases"].values()))
    assert abs(sum(worst["phases"].values()) - float(total)) < 0.06 and worst["label"] == (longest or "node0"), written


def test_a_single_node_start_is_broken_down(phalanx, workdir):
    script = workdir / "one_step.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "weight = torch.nn.Parameter(torch.ones(4))\n"
        "optimizer = torch.optim.SGD([weight], lr=0.1)\n"
        "for _ in range(3):\n"
        "    weight.sum().backward()\n"
        "    dist.all_reduce(weight.grad)\n"
        "    optimizer.step()\n"
        "dist.destroy_process_group()\n"
    )
    result = phalanx("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.output
    check_the_start_is_broken_down(result.stderr, workdir, nodes=1)


@contextlib.contextmanager
def launched(
    workdir: Path, *args: str, env: dict[str, str] | None = None, stderr: Path | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`phalanx run ARGS` in a session of its own, killed with everything it started on the way out;
    its stderr into the file ``stderr`` where given (to read it while it runs)."""
    with stderr.open("w") if stderr else contextlib.nullcontext(subprocess.PIPE) as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "run", *args], cwd=workdir, env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def wait_for(process: subprocess.Popen[str], ready: Callable[[], bool], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)


def test_ctrl_c_shows_the_script_s_frames_only(workdir):
    # as python SCRIPT prints a KeyboardInterrupt: from the script's own first frame on
    script = copy_worker(workdir, "sleeper.py")
    with launched(workdir, "--nproc-per-node", "2", "--independent-ranks", script, str(workdir)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        stdout, stderr = process.communicate(timeout=45)
    assert process.returncode == 130, stderr
    assert "KeyboardInterrupt" in stderr and 'sleeper.py", line' in stderr, stderr
    assert "bootstrap.py" not in stderr and "runpy" not in stderr, stderr


def test_sigterm_stops_every_node_and_worker(workdir):
    script = copy_worker(workdir, "sleeper.py")
    with launched(workdir, "--simulate-nodes", "2", script, str(workdir)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=45)
    assert process.returncode == 128 + signal.SIGTERM, stderr


def test_sigterm_stops_a_node_that_waits_for_the_others_to_finish(workdir):
    """node0's workers finished and it waits for node1's: SIGTERM ends that wait too (torch's
    agent raises it there as an exception, which a best-effort `except Exception` must let by)."""
    script = copy_worker(workdir, "rank1_late.py")
    said = workdir / "stderr.txt"
    with launched(workdir, "--simulate-nodes", "2", script, "finish", env={"LATE": "600"}, stderr=said) as process:
        # node0's agent says so once it has waited a while: SIGTERM then comes inside the wait
        wait_for(process, lambda: "node0: its workers finished; waiting up to" in said.read_text())
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=45)
    stderr = said.read_text()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "phalanx: node0 stopped by SIGTERM" in stderr
    assert "stopped by SIGTERM" in stderr


@pytest.mark.parametrize("launcher", ["torchrun", "python"])
def test_tutorial_example_runs_unchanged_without_phalanx(workdir, launcher):
    from tests.conftest import run_command

    args = [str(EXAMPLES / "tutorial_ddp.py"), "--epochs", "3", "--samples", "128", "--image-size", "16"]
    prefix = {"torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], "python": []}
    result = run_command([sys.executable, *prefix[launcher], *args], timeout=120, cwd=workdir)
    assert result.returncode == 0, result.output
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert f"training on {2 if launcher == 'torchrun' else 1} process(es)" in result.stdout


@pytest.mark.compat
def test_ranks_that_each_trained_alone_are_named_and_the_job_fails(phalanx, workdir):
    """A script that never forms the job's process group (as Accelerate on CPUs without
    ACCELERATE_USE_CPU=1) used to end with exit 0: every rank trained alone."""
    script = workdir / "alone.py"
    script.write_text(
        "import torch\nweight = torch.nn.Parameter(torch.ones(1))\noptimizer = torch.optim.SGD([weight], lr=0.1)\n"
        "weight.sum().backward()\noptimizer.step()\nprint('trained alone', weight.item())\n"
    )
    result = phalanx("run", "--simulate-nodes", "2", "--nproc-per-node", "2", str(script))
    assert result.returncode == 5, result.output
    assert "phalanx: PROBLEM: node0: ranks 0-1 of the job's 4 never communicated with the others" in result.stderr
    assert "phalanx: PROBLEM: node1: ranks 2-3 of the job's 4 never communicated" in result.stderr
    assert "HINT: call torch.distributed.init_process_group()" in result.stderr
    assert "phalanx: start:" not in result.stderr  # no process group: no start to break down


@pytest.mark.parametrize("calls", ["dist.send(t, 1) if rank == 0 else dist.recv(t, 0)", "dist.monitored_barrier()"])
def test_ranks_that_only_send_and_receive_communicated(phalanx, workdir, calls):
    # gloo's flight recorder counts no point-to-point call: these ranks did not train alone
    script = workdir / "point_to_point.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank, t = dist.get_rank(), torch.ones(1)\n"
        f"{calls}\n"
        "dist.destroy_process_group()\n"
    )
    result = phalanx("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 0 and "never communicated" not in result.stderr, result.output


@pytest.mark.parametrize(
    "layout", [("--simulate-nodes", "2"), ("--nproc-per-node", "2")], ids=["simulated", "one-node"]
)
def test_a_sigkilled_launcher_leaves_no_worker_behind(workdir, layout):
    script = copy_worker(workdir, "sleeper.py")
    with launched(workdir, *layout, script, str(workdir)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        workers = [
            p for p in psutil.Process(process.pid).children(recursive=True) if "sleeper.py" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 2.0  # the stated bound: the kernel ends them at once, 2 s with room
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = [w for w in alive if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.05)
        assert not alive, f"workers outlived their killed launcher: {alive}"


def test_a_simulated_node_killed_from_outside_is_named_as_the_root_cause(workdir):
    """kill -9 of node1's agent (as the out-of-memory killer would): its worker dies with it, and
    node0's worker fails on its next all-reduce. The cause is node1, not node0's lost connection."""
    script = copy_worker(workdir, "all_reduce_loop.py")
    with launched(workdir, "--simulate-nodes", "2", script, str(workdir)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        [agent] = [
            p for p in psutil.Process(process.pid).children() if "node1.json" in " ".join(p.cmdline())
        ]  # fmt: skip
        agent.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert re.search(r"phalanx: root cause: node1 \(127\.0\.0\.102\): its node agent was killed by SIGKILL", stderr), (
        stderr
    )
    assert "then failed too, having lost their peers: rank(s) 0" in stderr, stderr


@pytest.mark.parametrize(
    "layout", [("--simulate-nodes", "2"), ("--nproc-per-node", "2")], ids=["simulated", "one-node"]
)
def test_ctrl_c_says_how_long_it_waits_and_a_second_one_ends_at_once(workdir, layout):
    """Workers that ignore SIGINT and SIGTERM: the first Ctrl-C (to the whole process group, as
    a terminal sends it) says that the workers get 30 s; the second kills them now. Simulated
    node agents get each Ctrl-C once, from the simulation."""
    script = copy_worker(workdir, "deaf_sleeper.py")
    with launched(workdir, *layout, script, str(workdir)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        workers = [p for p in psutil.Process(process.pid).children(recursive=True) if script in " ".join(p.cmdline())]
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(2)
        assert process.poll() is None  # within the 30 s the workers get
        os.killpg(process.pid, signal.SIGINT)
        started = time.monotonic()
        _, stderr = process.communicate(timeout=20)
    assert process.returncode == 130, stderr
    assert time.monotonic() - started < 10, stderr
    said = "SIGINT: stopping the workers; they get up to 30 s to end, then SIGKILL (Ctrl-C again kills them now)"
    assert stderr.count(said) == (2 if layout[0] == "--simulate-nodes" else 1), stderr  # once per node agent
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.compat
def test_usr1_to_the_launcher_reaches_every_worker(workdir):
    """SLURM's preemption notice, passed on by a batch script to phalanx run: the workers get it
    (phalanx run neither dies of it nor keeps it)."""
    script = workdir / "usr1.py"
    script.write_text(
        "import signal, sys, time\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "got = []\nsignal.signal(signal.SIGUSR1, lambda *_: got.append(1))\n"
        f"open(f'{workdir}/ready{{dist.get_rank()}}', 'w').close()\n"
        "while not got: time.sleep(0.05)\n"
        "dist.destroy_process_group()\nsys.exit(75)\n"
    )
    with launched(workdir, "--simulate-nodes", "2", str(script)) as process:
        wait_for(process, lambda: len(list(workdir.glob("ready*"))) == 2)
        process.send_signal(signal.SIGUSR1)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr
    assert stderr.count("the workers stopped for preemption") == 2


ACCELERATE_SCRIPT = '''
"""A minimal Accelerate training loop, as its documentation writes one."""
import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(3):
    loss = model(torch.randn(16, 8, device=accelerator.device)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
accelerator.print(f"trained on {accelerator.num_processes} process(es)")
'''


@pytest.mark.compat
def test_accelerate_on_cpus_without_its_cpu_switch_is_named_with_the_switch(phalanx, workdir):
    """Accelerate creates the process group, then (no ACCELERATE_USE_CPU on a CPU machine) trains
    in every process alone: it used to end with exit 0. With the switch it joins the world."""
    pytest.importorskip("accelerate")
    script = workdir / "acc.py"
    script.write_text(ACCELERATE_SCRIPT)
    alone = phalanx("run", "--simulate-nodes", "2", str(script), env={"ACCELERATE_USE_CPU": "0"})
    assert "trained on 1 process(es)" in alone.stdout
    if gloo_flight_recorder_on():
        assert alone.returncode == 5, alone.output
        assert "rank 0 of the job's 2 never communicated with the others" in alone.stderr
        assert "HINT: Accelerate joins the world on CPUs only with ACCELERATE_USE_CPU=1" in alone.stderr
    else:  # torch counts no collectives: phalanx cannot tell, says so, and fails nothing
        assert alone.returncode == 0, alone.output
        assert "cannot tell whether it communicated with the others" in alone.stderr
    joined = phalanx("run", "--simulate-nodes", "2", str(script), env={"ACCELERATE_USE_CPU": "1"})
    assert joined.returncode == 0, joined.output
    assert "trained on 2 process(es)" in joined.stdout and "PROBLEM" not in joined.stderr
