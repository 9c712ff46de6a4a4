"""The runtime under real launches: equivalence across world sizes and exact resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import EXAMPLES, kill_group, phalanx_argv, run_command

pytestmark = pytest.mark.slow
TRAIN = str(EXAMPLES / "train.py")


def train(workdir: Path, name: str, *args: str, nproc: int = 1, timeout: float = 180) -> dict:
    out = workdir / f"{name}.json"
    argv = [TRAIN, *args, "--metrics-json", str(out), "--save-model", str(workdir / f"{name}.pt")]
    command = [sys.executable, *argv] if nproc == 1 else phalanx_argv("run", "--nproc-per-node", str(nproc), *argv)
    result = run_command(command, timeout=timeout, cwd=workdir)
    assert result.returncode == 0, result.output
    return json.loads(out.read_text())


def test_more_processes_with_smaller_batches_give_the_same_model(workdir):
    # 1792 samples divide evenly by every world size and batch, so no rank sees padding.
    common = ("--samples", "1792", "--epochs", "2", "--lr", "0.05")
    single = train(workdir, "w1", *common, "--batch-size", "32")
    double = train(workdir, "w2", *common, "--batch-size", "16", nproc=2)
    assert (single["world_size"], double["world_size"]) == (1, 2)
    assert single["steps"] == double["steps"] == 2 * 1792 // 32
    one, two = torch.load(workdir / "w1.pt"), torch.load(workdir / "w2.pt")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    assert abs(single["final_loss"] - double["final_loss"]) < 1e-4


RESUME_ARGS = ("--epochs", "8", "--batch-size", "16", "--checkpoint-every", "20")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run that interrupted ones must match bit for bit."""
    folder = tmp_path_factory.mktemp("reference")
    metrics = train(folder, "reference", *RESUME_ARGS, "--checkpoint-dir", str(folder / "ck"), nproc=2)
    assert metrics["resumed_from_step"] is None
    return metrics


def interrupt_after_first_checkpoint(workdir: Path, interrupt, *launch: str) -> tuple[int, str, Path]:
    """Starts train.py under phalanx run, calls interrupt(process) once a checkpoint exists."""
    checkpoints, out = workdir / "ck", workdir / "resumed.json"
    command = phalanx_argv("run", "--nproc-per-node", "2", *launch, TRAIN, *RESUME_ARGS,
                           "--checkpoint-dir", str(checkpoints), "--metrics-json", str(out))  # fmt: skip
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(checkpoints.glob("step-*.pt")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.02)
        interrupt(process)
        output, _ = process.communicate(timeout=180)
    finally:
        kill_group(process.pid)
    return process.returncode, output, out


def test_kill_9_of_a_worker_resumes_to_the_same_parameters(workdir, reference):
    def kill_rank_1(process: subprocess.Popen) -> None:
        workers = [p for p in psutil.Process(process.pid).children(recursive=True) if TRAIN in " ".join(p.cmdline())]
        os.kill(next(p for p in workers if p.environ().get("RANK") == "1").pid, signal.SIGKILL)

    code, output, out = interrupt_after_first_checkpoint(workdir, kill_rank_1, "--max-restarts", "2")
    assert code == 0, output
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] % 20 == 0, output
    assert resumed["steps"] == reference["steps"]
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_sigterm_saves_together_and_a_relaunch_continues_exactly(workdir, reference):
    code, output, out = interrupt_after_first_checkpoint(workdir, lambda p: p.send_signal(signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, output
    stopped = re.search(r"preempted by SIGTERM after step (\d+); checkpoint saved", output)
    assert stopped, output
    assert (workdir / "ck" / f"step-{int(stopped.group(1)):09d}.pt").exists()
    assert not out.exists()

    relaunch = run_command(
        phalanx_argv("run", "--nproc-per-node", "2", TRAIN, *RESUME_ARGS, "--checkpoint-dir", str(workdir / "ck"),
                     "--metrics-json", str(out)),
        timeout=180, cwd=workdir,
    )  # fmt: skip
    assert relaunch.returncode == 0, relaunch.output
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] == int(stopped.group(1))
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_ranks_that_disagree_are_named_on_every_rank(phalanx, workdir):
    script = workdir / "mismatch.py"
    script.write_text((Path(__file__).parent / "workers" / "mismatch.py").read_text())
    result = phalanx("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 1
    assert "consistent" not in result.stdout
    for rank in (0, 1):
        log = next(workdir.glob(f"phalanx-logs/*/attempt_0/rank{rank}/stderr.log")).read_text()
        assert "InconsistentRanks: the ranks disagree before the first step" in log
        assert "dataset length: ranks 0: 100; ranks 1: 101" in log
        assert "parameter shapes: ranks 0: ['weight:(2, 4)'" in log


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_compression_modes_train(workdir, compression):
    metrics = train(workdir, compression, "--epochs", "2", "--compression", compression, nproc=2)
    assert metrics["accuracy"] > 0.7 and metrics["world_size"] == 2


def test_bf16_on_gloo_is_refused_with_a_hint(phalanx, workdir):
    result = phalanx("run", "--nproc-per-node", "2", TRAIN, "--epochs", "1", "--compression", "bf16")
    assert result.returncode == 1
    assert "compression bf16 on the gloo backend" in result.stderr and "HINT: use --compression fp16" in result.stderr


def test_uneven_shards_neither_hang_nor_count_padding(workdir):
    # 101 samples over 2 ranks: rank 1 gets one padded sample, yet both take the same steps.
    metrics = train(workdir, "uneven", "--samples", "101", "--batch-size", "8", "--epochs", "2", nproc=2)
    assert metrics["steps"] == 2 * 7  # ceil(51 / 8) steps per epoch on every rank
    single = train(workdir, "uneven1", "--samples", "101", "--batch-size", "8", "--epochs", "1")
    assert single["steps"] == 13


def test_a_stalled_rank_is_named_within_the_bound(phalanx, workdir):
    script = workdir / "stall.py"
    script.write_text((Path(__file__).parent / "workers" / "stall.py").read_text())
    timeout = 4
    result = phalanx("run", "--simulate-nodes", "2", "--nproc-per-node", "2", str(script), "2",
                     env={"PHALANX_STALL_TIMEOUT": str(timeout)}, timeout=120)  # fmt: skip
    assert result.returncode == 1, result.output
    assert result.seconds < timeout + 30 + 20  # + the launch itself on this 2-core machine
    cause = result.stderr[result.stderr.index("phalanx: root cause:") :]
    assert "exited with code 4" in cause  # ExitCode.STALLED, from the watchdog of a waiting rank
    assert "in collective #3 (gloo:all_reduce)" in cause
    assert "stalled: rank 2 on node1: never called collective #3; last completed #2 (gloo:all_reduce, step 2)" in cause
    assert "not reached" not in result.stdout


def test_sigusr1_to_the_workers_ends_the_launch_with_the_preemption_code(workdir):
    def preempt_workers(process: subprocess.Popen) -> None:  # as SLURM's --signal=USR1 does
        for worker in psutil.Process(process.pid).children(recursive=True):
            if TRAIN in " ".join(worker.cmdline()):
                worker.send_signal(signal.SIGUSR1)

    code, output, out = interrupt_after_first_checkpoint(workdir, preempt_workers)
    assert code == 75, output
    assert re.search(r"preempted by SIGUSR1 after step \d+; checkpoint saved", output), output
    assert "stopped for preemption after saving a checkpoint; run the same command again" in output
    assert "root cause" not in output and not out.exists()
