"""Faults of a real multi-host job on test-bed hosts: a host lost (its processes killed, or its
link cut for good), a host's workers killed, a link cut for 5 s, a preemption of every host, and
a full checkpoint disk. Each run trains examples/train.py with checkpoints on two hosts; after a
fault, the same command on both resumes (or the launchers restart the workers), and the final
parameters equal an uninterrupted run's (computed once, on two simulated nodes, which train the
same model). Where a host's processes die, the other host's worker survives them and keeps the
state after the last step both completed: the job resumes there, not at the last checkpoint.

Bounds: a lost host is named, and the survivor has stopped, within LOST_BOUND_S (the node
agents' liveness watch declares a silent node lost after --heartbeat-timeout, 30 s by default; a
killed host's sockets close, and its peers fail at once).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.runtime.checkpoint.lock import LOCK_NAME
from phalanx.testbed import run_together, test_bed
from tests.conftest import EXAMPLES, run_command
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]

TRAIN = [str(EXAMPLES / "train.py"), "--epochs", "24", "--batch-size", "16", "--checkpoint-every", "20",
         "--log-every", "20"]  # fmt: skip
LOST_BOUND_S = 90
#: A tmpfs of this size holds one checkpoint of TRAIN (about 150 KiB in 4 KiB pages), not two.
ONE_AND_A_HALF_CHECKPOINTS_KIB = 224


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("reference")
    done = run_command([sys.executable, "-m", "phalanx", "run", "--simulate-nodes", "2", *TRAIN, "--metrics-json",
                        str(folder / "m.json")], timeout=300, cwd=folder)  # fmt: skip
    assert done.returncode == 0, done.output[-3000:]
    return json.loads((folder / "m.json").read_text())


@pytest.fixture
def bed():
    skip_unless_namespaces_work()
    with test_bed(f"f{os.getpid() % 10000}", ["h1", "h2"]) as made:
        yield made


def job_line(host, endpoint: str, folder: Path, *launch: str) -> list[str]:
    return host.command([sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--rdzv-endpoint", f"{endpoint}:29400",
                         *launch, *TRAIN, "--checkpoint-dir", str(folder / "ck"), "--metrics-json",
                         str(folder / f"{host.name}.json")])  # fmt: skip


def start_both(bed, folder: Path, *launch: str) -> list[subprocess.Popen[str]]:
    h1 = bed.hosts[0]
    return [subprocess.Popen(job_line(host, h1.address, folder, *launch), cwd=folder, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True) for host in bed.hosts]  # fmt: skip


def kept_step(output: str) -> int:
    """The step whose state a survivor said it kept."""
    found = re.search(r"rank (?:had )?kept the state after step (\d+) in ", output)
    assert found, output[-3000:]
    return int(found.group(1))


def resumed_from_kept_state(resumed: dict, output: str, survivor_said: str) -> None:
    """The job resumed after the step the survivor kept: from its state, or from the committed
    checkpoint of that same step where the kill came right after one."""
    step = kept_step(survivor_said)
    assert resumed["resumed_from_step"] == step, output[-3000:]
    assert re.search(rf"resumed from step {step} \(\S*(last-step/step-|/step-{step:09d}\))", output), output[-3000:]


def wait_for_a_checkpoint(folder: Path, processes, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not list((folder / "ck").glob("step-*[0-9]")):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            pytest.fail(
                "no checkpoint: " + "\n".join(p.communicate()[0][-2000:] for p in processes if p.poll() is not None)
            )
        time.sleep(0.1)


def ended_within(process: subprocess.Popen[str], timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"did not end within {timeout} s:\n{output[-4000:]}")
    return process.returncode, output, time.monotonic() - started


def mount(argv: list[str]) -> None:
    done = subprocess.run(["mount", *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"mount {' '.join(argv)}: {done.stderr}"


def relaunch_resumes_exactly(bed, folder: Path, reference: dict) -> tuple[dict, str]:
    h1 = bed.hosts[0]
    outcomes = run_together([job_line(host, h1.address, folder) for host in bed.hosts], timeout=300, cwd=str(folder))
    assert [o.returncode for o in outcomes] == [0, 0], [o.output[-3000:] for o in outcomes]
    resumed = json.loads((folder / "h1.json").read_text())
    assert resumed["resumed_from_step"] is not None, outcomes[0].output[-2000:]
    assert resumed["params_sha256"] == reference["params_sha256"]
    return resumed, "".join(outcome.output for outcome in outcomes)


def test_a_host_killed_outright_is_named_and_a_relaunch_resumes_exactly(bed, reference, tmp_path):
    h1, h2 = bed.hosts
    processes = start_both(bed, tmp_path)
    wait_for_a_checkpoint(tmp_path, processes)
    for pid in bed.processes("h2"):  # the launcher and its workers at once, as a machine that dies
        os.kill(pid, signal.SIGKILL)
    code, output, seconds = ended_within(processes[0], LOST_BOUND_S)
    processes[1].communicate(timeout=30)
    assert code != 0, output[-3000:]
    assert h2.address in output.split("phalanx: root cause:")[-1], output[-3000:]
    print(f"MEASURED: host killed: the survivor ended {seconds:.1f} s later")
    resumed_from_kept_state(*relaunch_resumes_exactly(bed, tmp_path, reference), output)


@pytest.mark.parametrize("launch", [[], ["--heal", "1", "--max-restarts", "1"]], ids=["restart", "heal"])
def test_the_rank_0_host_killed_loses_no_step_after_a_relaunch(bed, reference, tmp_path, launch):
    """h1 holds rank 0 and the rendezvous store: h2's launcher loses the store, but its worker
    survives the peer long enough to keep the state, and the relaunch resumes there. h2's
    console, which does not show rank 1's own words, repeats what it kept. In heal mode too:
    the store that the generations form on is lost with h1, so the survivor cannot heal."""
    h1, h2 = bed.hosts
    processes = start_both(bed, tmp_path, *launch)
    wait_for_a_checkpoint(tmp_path, processes)
    for pid in bed.processes("h1"):
        os.kill(pid, signal.SIGKILL)
    code, output, seconds = ended_within(processes[1], LOST_BOUND_S)
    processes[0].communicate(timeout=30)
    assert code != 0, output[-3000:]
    print(f"MEASURED: rank 0's host killed: the survivor ended {seconds:.1f} s later")
    if launch:  # the survivor tried to heal, and said why it could not
        (log,) = tmp_path.glob("phalanx-logs/*/attempt_0/rank1/stderr.log")
        said_in_log = log.read_text()
        assert "the launch's store, which the ranks heal through, is unreachable" in said_in_log, said_in_log[-3000:]
    (kept,) = (tmp_path / "ck" / "last-step").glob("step-*.pt")
    said = f"phalanx: {h2.address}: rank 1: this rank kept the state after step {int(kept.name[5:14])} in "
    assert said in output, output[-3000:]
    resumed_from_kept_state(*relaunch_resumes_exactly(bed, tmp_path, reference), said)


def test_a_hosts_workers_killed_cost_no_step_with_restarts(bed, reference, tmp_path):
    """kill -9 of h2's worker, its launcher alive: the launchers restart every worker, and the job
    resumes after the last step both ranks completed, which the survivor on h1 kept."""
    processes = start_both(bed, tmp_path, "--max-restarts", "1")
    wait_for_a_checkpoint(tmp_path, processes)
    workers = [
        pid for pid in bed.processes("h2") if "phalanx.launch.bootstrap" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    assert workers, "no worker on h2"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    outcomes = [ended_within(process, 300) for process in processes]
    assert [code for code, _, _ in outcomes] == [0, 0], [output[-3000:] for _, output, _ in outcomes]
    finished = json.loads((tmp_path / "h1.json").read_text())
    said = outcomes[0][1] + outcomes[1][1]
    resumed_from_kept_state(finished, said, said)
    assert finished["params_sha256"] == reference["params_sha256"]


def test_a_host_cut_off_for_good_is_named_on_both_sides_and_a_relaunch_resumes_exactly(bed, reference, tmp_path):
    h1, h2 = bed.hosts
    processes = start_both(bed, tmp_path)
    wait_for_a_checkpoint(tmp_path, processes)
    bed.cut_link("h2")
    survivor, survivor_out, seconds = ended_within(processes[0], LOST_BOUND_S)
    cut_off, cut_off_out, _ = ended_within(processes[1], LOST_BOUND_S)
    assert survivor == 1 and f"node {h2.address} sent no sign of life for " in survivor_out, survivor_out[-3000:]
    assert cut_off == 1 and "the store's host " in cut_off_out and "did not answer for" in cut_off_out, cut_off_out[
        -3000:
    ]
    print(f"MEASURED: host cut off for good: the survivor ended {seconds:.1f} s later")
    # No socket closed: each side's rank waited in its collective until its launcher asked it to
    # keep the state. The last all-reduce may have completed on one side only: one step apart at most.
    assert "so its launcher stopped this rank); keeping the state after step " in survivor_out, survivor_out[-3000:]
    said = re.search(rf"phalanx: {h2.address}: rank 1: .*kept the state after step (\d+) in ", cut_off_out)
    assert said, cut_off_out[-3000:]
    steps = sorted({kept_step(survivor_out), int(said.group(1))})
    assert steps[-1] - steps[0] <= 1, steps
    bed.restore_link("h2")
    resumed, output = relaunch_resumes_exactly(bed, tmp_path, reference)
    assert resumed["resumed_from_step"] == steps[0], output[-3000:]


def test_a_host_cut_off_in_a_job_of_four_is_heard_of_by_every_node(tmp_path):
    """Each node watches the two after it in the ring of nodes: h4 is watched by two of the other
    three. The third, whose worker may wait on h4's connection (a cut link closes none), hears
    their verdict on its next beat and stops too, well before the stall watchdog's 300 s. With
    --heartbeat-timeout 3, every node has stopped long before the default bound's 30 s."""
    skip_unless_namespaces_work()
    with test_bed(f"q{os.getpid() % 10000}", ["h1", "h2", "h3", "h4"]) as four:
        h1, h4 = four.hosts[0], four.hosts[3]
        train = [*TRAIN, "--epochs", "400", "--checkpoint-dir", str(tmp_path / "ck")]
        processes = [
            subprocess.Popen(host.command([sys.executable, "-m", "phalanx", "run", "--nnodes", "4", "--rdzv-endpoint",
                                           f"{h1.address}:29400", "--heartbeat-timeout", "3", *train]),
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for host in four.hosts
        ]  # fmt: skip
        wait_for_a_checkpoint(tmp_path, processes)
        four.cut_link("h4")
        cut_at = time.monotonic()
        outcomes = [ended_within(process, LOST_BOUND_S) for process in processes]
        every_node_ended_s = time.monotonic() - cut_at
    said = ["\n".join(line for line in output.splitlines() if "phalanx" in line) for _, output, _ in outcomes]
    for (code, output, _), words in zip(outcomes[:3], said):
        assert code == 1 and f"node {h4.address} sent no sign of life for " in output, words
    # the node that does not watch h4 (which one depends on the order of arrival) heard the verdict,
    # or its workers failed first and its report names the lost node first
    assert any("(seen by " in words or "a node was lost first" in words for words in said[:3]), said
    assert outcomes[3][0] == 1 and "the store's host " in outcomes[3][1], said[3]
    assert every_node_ended_s < 30, every_node_ended_s
    print(f"MEASURED: host cut off in a job of 4 (--heartbeat-timeout 3): every node ended {every_node_ended_s:.1f} s "
          "after the cut")  # fmt: skip


def test_a_link_cut_for_5_s_is_ridden_out(bed, reference, tmp_path):
    processes = start_both(bed, tmp_path)
    wait_for_a_checkpoint(tmp_path, processes)
    bed.cut_link("h2")
    time.sleep(5)  # the fault itself: 5 s without a packet
    bed.restore_link("h2")
    outcomes = [ended_within(process, 300) for process in processes]
    assert [code for code, _, _ in outcomes] == [0, 0], [output[-3000:] for _, output, _ in outcomes]
    finished = json.loads((tmp_path / "h1.json").read_text())
    assert finished["params_sha256"] == reference["params_sha256"]


def test_sigterm_to_every_launcher_saves_and_a_relaunch_falls_back_over_a_damaged_newest(bed, reference, tmp_path):
    """A scheduler's preemption of the whole job: both launchers get SIGTERM, the workers agree
    on a step and save. Then the newest checkpoint is damaged (a file cut short, as by a copy
    that failed): the relaunch says so, resumes from the one before, and still ends exactly."""
    processes = start_both(bed, tmp_path)
    wait_for_a_checkpoint(tmp_path, processes)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    outcomes = [ended_within(process, 60) for process in processes]
    assert [code for code, _, _ in outcomes] == [128 + signal.SIGTERM] * 2, [out[-3000:] for _, out, _ in outcomes]
    said = "".join(out for _, out, _ in outcomes)  # rank 0 says it, on the host that holds it
    stopped = int(said.split("preempted by SIGTERM after step ")[1].split(";")[0])
    newest = tmp_path / "ck" / f"step-{stopped:09d}"
    assert (newest / "phalanx.json").exists(), said[-3000:]
    damaged = sorted(newest.glob("*.distcp"))[-1]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    h1 = bed.hosts[0]
    relaunched = run_together(
        [job_line(host, h1.address, tmp_path) for host in bed.hosts], timeout=300, cwd=str(tmp_path)
    )
    assert [o.returncode for o in relaunched] == [0, 0], [o.output[-3000:] for o in relaunched]
    assert f"checkpoint {newest} is damaged ({damaged.name} is truncated" in "".join(o.output for o in relaunched)
    resumed = json.loads((tmp_path / "h1.json").read_text())
    assert resumed["resumed_from_step"] < stopped and resumed["params_sha256"] == reference["params_sha256"]


def test_a_full_checkpoint_disk_is_said_and_a_relaunch_resumes_from_the_newest_whole_state(bed, reference, tmp_path):
    """The checkpoint folder is a tmpfs with room for one checkpoint (about 150 KiB here) and not
    for two: the first save fits, the second fails on every rank at once. Each rank then tries to
    keep the state after step 40 in what room is left: both fail when they write at the same
    time, and the first succeeds when they do not (which one, the timing decides). Either way
    nothing is left half-written, and once the disk is given more room, as a user would free
    space, the same command resumes from the newest whole state: step 40 where a rank kept it,
    else the checkpoint of step 20."""
    (tmp_path / "ck").mkdir()
    mount(["-t", "tmpfs", "-o", f"size={ONE_AND_A_HALF_CHECKPOINTS_KIB}k", "tmpfs", str(tmp_path / "ck")])
    try:
        outcomes = [ended_within(process, 180) for process in start_both(bed, tmp_path)]
        assert [code for code, _, _ in outcomes] == [1, 1], [out[-3000:] for _, out, _ in outcomes]
        h1_output, both = outcomes[0][1], outcomes[0][1] + outcomes[1][1]
        cause = h1_output.split("phalanx: root cause:")[-1]
        assert "step-000000040 could not be written: the disk is full" in cause, h1_output[-3000:]
        assert "the previous checkpoint (step-000000020) is intact" in cause and "HINT: free space" in cause, cause
        kept = list((tmp_path / "ck").glob("last-step/step-*.pt"))
        failed = "the state after step 40 could not be kept (No space left on device): unless another rank kept it, " \
                 "a restart resumes from the checkpoint of step 20 and trains steps 21-40 again"  # fmt: skip
        if kept:  # the rank that wrote first had room: its copy is whole, and said so
            assert len(kept) == 1 and kept[0].name.startswith("step-000000040-"), kept
            assert "this rank kept the state after step 40 in " in both, both[-3000:]
        else:
            assert failed in both, both[-3000:]
        assert sorted(
            path.name for path in (tmp_path / "ck").iterdir() if path.name not in (LOCK_NAME, "last-step")
        ) == ["step-000000020"]  # no staging left
        assert [path.name for path in (tmp_path / "ck").glob("last-step/*")] == [path.name for path in kept], (
            "a survivor's state half-written"
        )
        mount(["-o", "remount,size=16m", str(tmp_path / "ck")])
        h1 = bed.hosts[0]
        relaunched = run_together(
            [job_line(host, h1.address, tmp_path) for host in bed.hosts], timeout=300, cwd=str(tmp_path)
        )
        assert [o.returncode for o in relaunched] == [0, 0], [o.output[-3000:] for o in relaunched]
        resumed = json.loads((tmp_path / "h1.json").read_text())
        assert resumed["resumed_from_step"] == (40 if kept else 20), (kept, resumed["resumed_from_step"])
        assert resumed["params_sha256"] == reference["params_sha256"]
        print(f"MEASURED: full disk: {'a rank kept the state after step 40' if kept else 'no rank had room'}")
    finally:
        subprocess.run(["umount", "--lazy", str(tmp_path / "ck")], check=False)


def test_a_hosts_training_processes_killed_are_replaced_while_the_other_host_trains_on(bed, reference, tmp_path):
    """--heal: kill -9 of h2's training process (its supervisor and launcher alive): a replacement
    joins h1's worker, which keeps its process, and nothing is restarted; the parameters equal the
    uninterrupted run's, which trained without heal mode."""
    processes = start_both(bed, tmp_path, "--heal", "1", "--max-restarts", "1")
    wait_for_a_checkpoint(tmp_path, processes)

    def training(host: str) -> list[int]:  # the scripts' processes, not their supervisors
        return [
            pid
            for pid in bed.processes(host)
            if b"PHALANX_SUPERVISOR_PID=" in Path(f"/proc/{pid}/environ").read_bytes()
        ]

    survivors, killed = training("h1"), training("h2")
    assert survivors and killed, "no training process"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    outcomes = [ended_within(process, 300) for process in processes]
    assert [code for code, _, _ in outcomes] == [0, 0], [output[-3000:] for _, output, _ in outcomes]
    said = outcomes[0][1] + outcomes[1][1]
    assert "rank(s) 1 replaced" in said and "restarting the workers" not in said, said[-3000:]
    assert not list(tmp_path.glob("phalanx-logs/*/attempt_1")), "the workers were restarted"
    finished = json.loads((tmp_path / "h1.json").read_text())
    assert finished["resumed_from_step"] is None and finished["params_sha256"] == reference["params_sha256"]
