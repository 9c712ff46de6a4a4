"""The runtime under real launches: equivalence across world sizes and exact resume."""

from __future__ import annotations

import json
import os
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


def test_kill_9_of_a_worker_resumes_to_the_same_parameters(workdir):
    args = ("--epochs", "8", "--batch-size", "16", "--checkpoint-every", "20")
    reference = train(workdir, "reference", *args, "--checkpoint-dir", str(workdir / "ck_ref"), nproc=2)
    assert reference["resumed_from_step"] is None

    checkpoints = workdir / "ck"
    out = workdir / "killed.json"
    command = phalanx_argv("run", "--nproc-per-node", "2", "--max-restarts", "2", TRAIN, *args,
                           "--checkpoint-dir", str(checkpoints), "--metrics-json", str(out))  # fmt: skip
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(checkpoints.glob("step-*.pt")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.02)
        workers = [p for p in psutil.Process(process.pid).children(recursive=True) if TRAIN in " ".join(p.cmdline())]
        victim = next(p for p in workers if p.environ().get("RANK") == "1")
        os.kill(victim.pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=180)
    finally:
        kill_group(process.pid)
    assert process.returncode == 0, output
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] % 20 == 0, output
    assert resumed["steps"] == reference["steps"]
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
