"""phalanx on a real two-node SLURM cluster: sbatch of `phalanx slurm`'s script, srun of `phalanx
run` with no launch flags, preemption by SIGUSR1 and by the time limit, both ending in a requeue
and an exact resume, and refusals before anything starts."""

from __future__ import annotations

import json
import re
import socket
import sys
import time

import pytest

from tests.conftest import EXAMPLES, WORKERS, run_command

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

#: About 3000 steps (half a minute of training on 2 cores): a signal sent at the first logged
#: step finds the training under way.
EPOCHS = "200"
TRAIN = [str(EXAMPLES / "train.py"), "--epochs", EPOCHS]


def simulated_sha(folder, train: list[str]) -> str:
    """The parameters after the same training on two simulated nodes of two processes."""
    metrics = folder / "m.json"
    done = run_command([sys.executable, "-m", "phalanx", "run", "--simulate-nodes", "2", "--nproc-per-node", "2",
                        *train, "--metrics-json", str(metrics)], timeout=600, cwd=folder)  # fmt: skip
    assert done.returncode == 0, done.output
    return json.loads(metrics.read_text())["params_sha256"]


@pytest.fixture(scope="module")
def uninterrupted_sha(tmp_path_factory):
    return simulated_sha(tmp_path_factory.mktemp("reference"), TRAIN)


def metrics_of(folder) -> dict:
    return json.loads((folder / "m.json").read_text())


def test_sbatch_trains_on_two_nodes_as_the_simulation_does(slurm_in, uninterrupted_sha):
    submitted = time.monotonic()
    job = slurm_in.phalanx_slurm("--nnodes", "2", "--nproc-per-node", "2", *TRAIN,
                                 "--metrics-json", str(slurm_in.folder / "m.json"))  # fmt: skip
    first_step = slurm_in.wait_for(job, r"rank0\]: step \d+/", timeout=180)
    assert slurm_in.wait_until_done(job, timeout=400) == "COMPLETED", slurm_in.text(job)
    log = slurm_in.text(job)
    assert "node n1 (10." in log and "node n2 (10." in log and "joins job 'slurm-" in log, log
    assert "cluster    SLURM job" in log and "node 0 of 2" in log and "node 1 of 2" in log
    metrics = metrics_of(slurm_in.folder)
    assert metrics["world_size"] == 4
    assert metrics["params_sha256"] == uninterrupted_sha
    print(f"MEASURED: sbatch to the first logged training step: {first_step - submitted:.1f} s")


def test_usr1_to_the_batch_shell_checkpoints_requeues_and_resumes_exactly(slurm_in, uninterrupted_sha):
    job = slurm_in.phalanx_slurm("--nnodes", "2", "--nproc-per-node", "2", *TRAIN, "--checkpoint-dir", "ckpt",
                                 "--metrics-json", str(slurm_in.folder / "m.json"))  # fmt: skip
    slurm_in.wait_for(job, r"rank0\]: step \d+/", timeout=180)
    signalled = time.monotonic()
    assert slurm_in.run(["scancel", "--signal=USR1", "--batch", job.id], timeout=10).returncode == 0
    resumed = slurm_in.wait_for(job, r"rank0\]: resumed from step", timeout=180)
    back = slurm_in.wait_for(job, r"resumed from step[\s\S]*rank0\]: step \d+/", timeout=120)
    assert slurm_in.wait_until_done(job, timeout=400) == "COMPLETED", slurm_in.text(job)
    log = slurm_in.text(job)
    # The node whose phalanx run ends first with 75 ends the step (srun --kill-on-bad-exit=1): the
    # other is stopped as it exits, after the checkpoint that every rank saved together.
    saved = re.findall(r"rank0\]: preempted by SIGUSR1 after step (\d+); checkpoint saved", log)
    assert len(saved) == 1, log
    assert "the workers stopped for preemption after saving a checkpoint" in log
    assert "requeueing the job (1 of 3)" in log and "start 2 (requeued 1 of at most 3 times)" in log
    stopped_at = int(re.search(r"resumed from step (\d+)", log).group(1))
    assert stopped_at == int(saved[0])
    assert 0 < stopped_at < 3000
    metrics = metrics_of(slurm_in.folder)
    assert metrics["resumed_from_step"] == stopped_at
    assert metrics["params_sha256"] == uninterrupted_sha
    print(f"MEASURED: SIGUSR1 to the requeued job's resume: {resumed - signalled:.1f} s, "
          f"to its first logged step: {back - signalled:.1f} s")  # fmt: skip


def test_the_time_limit_ends_in_a_checkpoint_a_requeue_and_a_resume(slurm_in):
    """SLURM sends --signal's SIGUSR1 at its first time-limit check (about every 30 s) within
    lead + 30 s of the end: with a 2-minute limit and 30 s of lead, 60 to 90 s into the start. The
    training has no end on its first start, so only that signal can end it, on a machine of any
    speed; the requeued start resumes, trains 200 steps and ends. That a requeued start resumes
    bit for bit is the USR1 test's to check."""
    train = [str(WORKERS / "until_preempted.py"), "--more", "200"]
    job = slurm_in.phalanx_slurm("--nnodes", "2", "--nproc-per-node", "2", "--time", "2", "--signal-lead", "30",
                                 *train, "--checkpoint-dir", "ckpt", "--metrics-json", str(slurm_in.folder / "m.json"))  # fmt: skip
    assert slurm_in.wait_until_done(job, timeout=600) == "COMPLETED", slurm_in.text(job)
    log = slurm_in.text(job)
    assert "requeueing the job (1 of 3)" in log and "requeueing the job (2 of 3)" not in log, log
    assert "DUE TO TIME LIMIT" not in log  # the signal came first: never killed by the limit itself
    saved = [int(step) for step in re.findall(r"rank0\]: preempted by SIGUSR1 after step (\d+); checkpoint saved", log)]
    resumed = [int(step) for step in re.findall(r"rank0\]: resumed from step (\d+)", log)]
    assert len(saved) == 1 and resumed == saved, log  # the second start goes on from the step the first saved
    metrics = metrics_of(slurm_in.folder)
    assert metrics["resumed_from_step"] == saved[0] and metrics["steps"] == saved[0] + 200, metrics
    print(f"MEASURED: the time limit's signal came after step {saved[0]} of the first start")


def test_srun_phalanx_run_with_no_launch_flags_forms_one_world(slurm_in):
    # No launch flag: the nodes, the endpoint and the job ID come from SLURM; the processes per
    # node from PHALANX_NPROC_PER_NODE, as a job script would export it (no GPU here to count).
    slurm_in.env["PHALANX_NPROC_PER_NODE"] = "2"
    done = slurm_in.run(["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "phalanx", "run",
                         str(EXAMPLES / "train.py"), "--epochs", "2", "--metrics-json", "m.json"], timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert metrics_of(slurm_in.folder)["world_size"] == 4
    plan = re.findall(r"^\s+(\d)\s+(n\d)\s+10\.\d+\.0\.(\d)\s+([\d-]+)", done.stderr, re.M)
    assert plan == [("0", "n1", "1", "0-1"), ("1", "n2", "2", "2-3")], done.stderr


def test_more_nodes_than_the_allocation_is_refused_before_anything_starts(slurm_in):
    done = slurm_in.run(["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "phalanx", "run", "--nnodes", "3",
                         str(EXAMPLES / "train.py")], timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("phalanx: error: the launch settings contradict the SLURM job") == 2
    assert re.search(r"nnodes\s+3 \(--nnodes\)\s+2 \(SLURM_STEP_NUM_NODES=2\)", done.stderr), done.stderr
    assert "rank table" not in done.stderr and not (slurm_in.folder / "phalanx-logs").exists()


def test_two_tasks_per_node_are_refused_with_the_right_srun_line(slurm_in):
    done = slurm_in.run(["srun", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "phalanx", "run",
                         str(EXAMPLES / "train.py")], timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("SLURM started 2 tasks on a node (SLURM_STEP_TASKS_PER_NODE=2(x2))") == 4
    assert "HINT: srun --nodes=2 --ntasks-per-node=1 phalanx run --nproc-per-node 2" in done.stderr


def test_a_refused_option_and_an_unreachable_controller_get_their_own_hint(slurm_in, tmp_path):
    refused = slurm_in.run([sys.executable, "-m", "phalanx", "slurm", "--nnodes", "2", "--sbatch=--partition=nosuch",
                            "--submit", str(EXAMPLES / "train.py")], timeout=60)  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Invalid partition name" in refused.stderr and "HINT: fix the option it names" in refused.stderr
    # the same cluster's configuration with a controller port nothing listens on: sbatch reaches no controller
    with socket.socket() as closed:
        closed.bind(("", 0))
        port = closed.getsockname()[1]
    dead = tmp_path / "dead.conf"
    dead.write_text(re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={port}", slurm_in.cluster.conf.read_text()))
    env = {**slurm_in.env, "SLURM_CONF": str(dead)}
    unreachable = run_command([sys.executable, "-m", "phalanx", "slurm", "--nnodes", "2", "--submit",
                               str(EXAMPLES / "train.py")], timeout=60, cwd=slurm_in.folder, env=env)  # fmt: skip
    assert unreachable.returncode == 2, unreachable.output
    assert "Unable to contact slurm controller" in unreachable.output, unreachable.output
    assert "HINT: sbatch on this host cannot reach a SLURM controller" in unreachable.output


def test_doctor_under_srun_compares_the_two_nodes_and_finds_no_problem(slurm_in):
    # SLURM gives each task variables of its own node (SLURM_NODEID, SLURM_CPUS_ON_NODE...): the
    # doctor compares what must agree, not those. The node that ran rank 0 alone prints the report.
    done = slurm_in.run(["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-m", "phalanx", "doctor",
                         "--p2p-size", "1M", "--max-bytes", "1M", "--json"], timeout=180)  # fmt: skip
    report = json.loads(done.stdout)  # one report: the test-bed hosts share a file system, and the run's folder
    assert len(report["nodes"]) == 2 and report["simulated"] is False, report["nodes"]
    # the test bed's hosts share this machine's hostname (no UTS namespace of their own), which
    # the doctor rightly calls a problem; nothing else is one
    problems = [f["topic"] for f in report["findings"] if f["severity"] == "problem"]
    assert problems == ["duplicate-hostname"], report["findings"]
    assert done.returncode == 1, done.stderr
