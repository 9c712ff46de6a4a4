"""Sharded checkpoints under real launches: node-local folders with rank 0 moving, and a
SIGKILL in the middle of an asynchronous save."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from phalanx.runtime.checkpoint.lock import LOCK_NAME
from tests.conftest import EXAMPLES, WORKERS, kill_group, phalanx_argv, run_command

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # fault tests: the second stage
WORKER = str(WORKERS / "run_checkpoints.py")
SIGNAL_AT_STEP = str(WORKERS / "signal_at_step.py")
DIES_IN_A_STEP = str(WORKERS / "dies_in_a_step.py")


def launch(*args: str, nodes: int = 2, nproc: int = 1) -> list[str]:
    return phalanx_argv("run", "--simulate-nodes", str(nodes), "--nproc-per-node", str(nproc), WORKER, *args)


def train(workdir: Path, name: str, *args: str, code: int = 0) -> dict:
    result = run_command(launch("--out", f"{name}.json", *args), timeout=240, cwd=workdir)
    assert result.returncode == code, result.output
    return json.loads((workdir / f"{name}.json").read_text()) if code == 0 else {"output": result.output}


def train_dies(workdir: Path, name: str, *args: str, restarts: int = 0) -> tuple[str, dict]:
    """tests/e2e/workers/dies_in_a_step.py on 2 processes, checkpointing in the folder ``name``:
    its output, and rank 0's summary."""
    done = run_command(phalanx_argv("run", "--nproc-per-node", "2", "--max-restarts", str(restarts), DIES_IN_A_STEP,
                                    "--checkpoint-dir", name, "--out", f"{name}.json", *args),
                       timeout=240, cwd=workdir)  # fmt: skip
    assert done.returncode == 0, done.output
    return done.output, json.loads((workdir / f"{name}.json").read_text())


def test_node_local_folders_keep_a_whole_copy_each_and_rank_0_may_move(workdir):
    reference = train(workdir, "reference", "--checkpoint-dir", "shared")
    assert not reference["node_local"]  # one folder that both nodes see
    train(workdir, "crashed", "--checkpoint-dir", "local", "--node-local", "--crash-after", "12", "--no-keep-last-step",
          code=1)  # fmt: skip
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
    train(workdir, "first", "--checkpoint-dir", "local", "--node-local", "--crash-after", "7", "--no-keep-last-step",
          code=1)  # fmt: skip
    for step in (workdir / "local" / "node1").iterdir():
        step.rename(step.with_name("moved-" + step.name))  # a new machine in place of node 1
    refused = train(workdir, "again", "--checkpoint-dir", "local", "--node-local", code=2)["output"]
    assert "checkpoint step 5 is complete in the checkpoint folders of some nodes but not of others" in refused
    assert "HINT: copy the newest step-* folder to the nodes that lack it" in refused


def test_a_survivors_state_reaches_the_node_whose_folder_lacks_it(workdir):
    """Rank 1 dies after step 12 without a word (as a SIGKILL would); rank 0 survives and keeps the
    state after step 12 in its own node's folder. The relaunch gives rank 0 the other node's
    folder, which lacks it: the rank that has it sends it, and the job resumes after step 12."""
    reference = train(workdir, "reference", "--checkpoint-dir", "shared")
    train(workdir, "crashed", "--checkpoint-dir", "local", "--node-local", "--crash-after", "12", "--crash-rank", "1",
          code=1)  # fmt: skip
    assert [p.name[:14] for p in (workdir / "local" / "node0" / "last-step").iterdir()] == ["step-000000012"]
    assert not (workdir / "local" / "node1" / "last-step").exists()
    resumed = train(workdir, "resumed", "--checkpoint-dir", "local", "--node-local", "--shift", "1")
    assert resumed["resumed_from_step"] == 12 and resumed["params_sha256"] == reference["params_sha256"]
    assert not list((workdir / "local" / "node0" / "last-step").iterdir()), "the checkpoint of step 15 made it obsolete"


def test_two_failures_in_a_row_each_cost_no_step(workdir):
    """Rank 1 of examples/train.py is SIGKILLed after step 37, then again after step 52 in the
    restarted attempt: each restart resumes after the step the killed rank completed last."""
    args = ("--epochs", "4", "--batch-size", "16", "--checkpoint-every", "20", "--log-every", "20")
    reference = run_command(phalanx_argv("run", "--nproc-per-node", "2", str(EXAMPLES / "train.py"), *args,
                                         "--metrics-json", "reference.json"), timeout=240, cwd=workdir)  # fmt: skip
    assert reference.returncode == 0, reference.output
    killed = run_command(phalanx_argv("run", "--nproc-per-node", "2", "--max-restarts", "2", SIGNAL_AT_STEP, "KILL", "1", "37,52",
                                      *args, "--checkpoint-dir", "ck", "--metrics-json", "killed.json"),
                         timeout=240, cwd=workdir)  # fmt: skip
    assert killed.returncode == 0, killed.output
    said = [line for line in killed.output.splitlines() if "resumed from step" in line]
    assert [line.split("resumed from step ")[1].split(" ")[0] for line in said] == ["37", "52"], killed.output
    assert "rank 1 was killed by SIGKILL" in killed.output and "(restart 2 of 2)" in killed.output
    metrics = json.loads((workdir / "killed.json").read_text())
    assert metrics["params_sha256"] == json.loads((workdir / "reference.json").read_text())["params_sha256"]
    check_each_start_is_broken_down(killed.output, ["start", "restart 1", "restart 2"])


def check_each_start_is_broken_down(output: str, kinds: list[str]) -> None:
    """A line for each start of the workers, the first and each restart's, whose phases add up to its total."""
    from phalanx.launch.start_report import PHASES, RESTART_PHASES

    said = re.findall(r"phalanx: (start|restart \d+): (\d+\.\d) s(?: from the end of the round before)? to the "
                      r"first step: (.*)", output)  # fmt: skip
    assert [kind for kind, _, _ in said] == kinds, output
    for kind, total, phases in said:
        parts = [part.rsplit(" ", 2) for part in phases.split(", ")]
        assert [name for name, _, _ in parts] == list(PHASES if kind == "start" else RESTART_PHASES), phases
        rounding = 0.05 * (len(parts) + 1)  # each figure is rounded to a tenth
        assert abs(sum(float(seconds) for _, seconds, _ in parts) - float(total)) <= rounding, (total, phases)


@pytest.mark.parametrize("killed", [1, 0])
def test_a_dead_ranks_random_state_is_rebuilt_and_rank_0s_buffers_said(workdir, killed):
    """A model with dropout, noise on its inputs and BatchNorm; one rank SIGKILLed after step 23,
    --max-restarts 1. Killing rank 1: the final state (buffers too) equals an uninterrupted run's.
    Killing rank 0: its buffers' update of step 23 went with it; the parameters are exact and the
    resume says whose buffers it took."""

    _, reference = train_dies(workdir, "reference")
    output, resumed = train_dies(workdir, "killed", "--kill-step", "23", "--fail-rank", str(killed), restarts=1)
    assert "resumed from step 23 (killed/last-step/step-000000023-" in output, output
    assert resumed["parameters_only_sha256"] == reference["parameters_only_sha256"]
    said = "phalanx: the state after step 23 was kept by rank 1 before the next forward shared rank 0's buffers"
    if killed == 1:
        assert resumed["params_sha256"] == reference["params_sha256"] and said not in output
    else:
        assert said in output, output


@pytest.mark.parametrize("killed", [1, 0])
def test_a_rank_killed_during_a_checkpoint_save_costs_no_step(workdir, killed):
    """One rank SIGKILLs itself in the checkpoint save after step 20, as DCP starts writing, while
    the other is inside the save's collectives: the save is not committed, the survivor keeps the
    state after step 20 (with rank 0's buffers, which the save had broadcast), and the restart
    resumes there and ends where an uninterrupted run does."""

    _, reference = train_dies(workdir, "reference")
    output, resumed = train_dies(workdir, "killed", "--fail-where", "save", "--fail-step", "20", "--fail-rank",
                                 str(killed), restarts=1)  # fmt: skip
    assert f"rank {killed} was killed by SIGKILL" in output, output
    assert "resumed from step 20 (killed/last-step/step-000000020-" in output, output
    assert resumed["params_sha256"] == reference["params_sha256"]
    committed = sorted(path.name for path in (workdir / "killed").glob("step-*"))
    assert "step-000000020" not in committed and "step-000000030" in committed, committed
    assert not list((workdir / "killed").glob(".*")), "the staging folder of the killed save is still there"


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
