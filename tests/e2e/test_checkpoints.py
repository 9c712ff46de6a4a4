"""Sharded checkpoints under real launches: node-local folders with rank 0 moving, and a
SIGKILL in the middle of an asynchronous save."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from phalanx.runtime.checkpoint.lock import LOCK_NAME
from tests.conftest import kill_group, phalanx_argv, run_command

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # fault tests: the second stage
WORKER = str(Path(__file__).parent / "workers" / "run_checkpoints.py")


def launch(*args: str, nodes: int = 2, nproc: int = 1) -> list[str]:
    return phalanx_argv("run", "--simulate-nodes", str(nodes), "--nproc-per-node", str(nproc), WORKER, *args)


def train(workdir: Path, name: str, *args: str, code: int = 0) -> dict:
    result = run_command(launch("--out", f"{name}.json", *args), timeout=240, cwd=workdir)
    assert result.returncode == code, result.output
    return json.loads((workdir / f"{name}.json").read_text()) if code == 0 else {"output": result.output}


def test_node_local_folders_keep_a_whole_copy_each_and_rank_0_may_move(workdir):
    reference = train(workdir, "reference", "--checkpoint-dir", "shared")
    assert not reference["node_local"]  # one folder that both nodes see
    train(workdir, "crashed", "--checkpoint-dir", "local", "--node-local", "--crash-after", "12", code=1)
    for node in ("node0", "node1"):  # each node holds every step, with both ranks' own state
        assert sorted(p.name for p in (workdir / "local" / node).iterdir() if p.name != LOCK_NAME) == [
            "step-000000005",
            "step-000000010",
        ]
    # The node that now holds rank 0 uses the folder the other node wrote.
    resumed = train(workdir, "resumed", "--checkpoint-dir", "local", "--node-local", "--shift", "1")
    assert resumed["node_local"] and resumed["resumed_from_step"] == 10  # mid-epoch: 13 steps per epoch
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_node_local_folders_without_a_common_checkpoint_are_refused(workdir):
    train(workdir, "first", "--checkpoint-dir", "local", "--node-local", "--crash-after", "7", code=1)
    for step in (workdir / "local" / "node1").iterdir():
        step.rename(step.with_name("moved-" + step.name))  # a new machine in place of node 1
    refused = train(workdir, "again", "--checkpoint-dir", "local", "--node-local", code=2)["output"]
    assert "checkpoint step 5 is complete in the checkpoint folders of some nodes but not of others" in refused
    assert "HINT: copy the newest step-* folder to the nodes that lack it" in refused


def test_a_sigkill_during_an_async_save_resumes_from_the_previous_checkpoint(workdir):
    """A model of 40M parameters: its checkpoint (320 MB with momentum) takes long enough to
    write that the job is killed while the staging folder of step 10 is being filled."""
    big = ("--width", "2000000", "--epochs", "1")
    reference = train(workdir, "reference", *big, "--checkpoint-dir", "reference-ck")
    process = subprocess.Popen(launch("--out", "killed.json", *big, "--checkpoint-dir", "ck", "--async-checkpoints"), cwd=workdir,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    staging = workdir / "ck" / ".step-000000010.staging"
    try:
        deadline = time.monotonic() + 180
        while not staging.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.005)
        kill_group(process.pid)
        process.wait(timeout=30)
    finally:
        kill_group(process.pid)
    assert process.returncode == -signal.SIGKILL
    assert (workdir / "ck" / "step-000000005" / "phalanx.json").exists()
    assert not (workdir / "ck" / "step-000000010").exists(), "the save finished before the kill: nothing was tested"
    resumed = train(workdir, "resumed", *big, "--checkpoint-dir", "ck")
    assert resumed["resumed_from_step"] == 5 and resumed["params_sha256"] == reference["params_sha256"]
    assert not list((workdir / "ck").glob(".*")), "the staging folder of the killed save is still there"
