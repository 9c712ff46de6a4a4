"""--heal under real launches: a rank that dies is replaced while the others keep their processes,
and the training ends with the parameters of a run that nothing interrupted.

tests/e2e/workers/dies_in_a_step.py trains with dropout, input noise, BatchNorm and Adam, on 3
processes; the rank that fails does so in its first attempt only (its replacement trains on).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from phalanx.runtime.checkpoint.folder import committed
from tests.conftest import WORKERS, phalanx_argv, run_command

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # fault tests: the second stage
DIES_IN_A_STEP = str(WORKERS / "dies_in_a_step.py")


def train(
    workdir: Path, name: str, *args: str, nproc: int = 3, heal: int = 1
) -> tuple[str, dict, dict[int, tuple[int, int]]]:
    """The worker on one node of ``nproc`` processes with --heal ``heal``: its output, rank 0's
    summary, and each rank's (first, last) PID."""
    pids = workdir / f"{name}-pids"
    pids.mkdir()
    done = run_command(phalanx_argv("run", "--nproc-per-node", str(nproc), "--heal", str(heal), "--max-restarts", "1", DIES_IN_A_STEP, "--checkpoint-dir",
                                    name, "--out", f"{name}.json", "--pids", str(pids), *args),
                       timeout=240, cwd=workdir)  # fmt: skip
    assert done.returncode == 0, done.output
    seen = {rank: (int((pids / f"rank{rank}-first").read_text()), int((pids / f"rank{rank}-last").read_text()))
            for rank in range(nproc)}  # fmt: skip
    return done.output, json.loads((workdir / f"{name}.json").read_text()), seen


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    """Rank 0's summary of the run of N processes that nothing interrupts, which every heal of N
    processes must end with (one run per N for the module's tests)."""
    made: dict[int, dict] = {}

    def of(nproc: int) -> dict:
        if nproc not in made:
            made[nproc] = train(tmp_path_factory.mktemp(f"reference-{nproc}"), "reference", nproc=nproc)[1]
        return made[nproc]

    return of


@pytest.fixture
def reference(references: Callable[[int], dict]) -> dict:
    """The 3-process run's summary."""
    return references(3)


def assert_the_save_was_healed(checkpoints: Path, output: str, healed: dict, step: int) -> None:
    """A failure in the save after ``step`` was healed: said, the later saves made (the newest
    checkpoint is the last step's), and no staging folder left."""
    assert f"a rank failed in the checkpoint save after step {step}: the ranks healed" in output, output
    assert [saved for saved, _ in committed(checkpoints)][:1] == [healed["steps"]], healed
    assert not list(checkpoints.glob(".*.staging")), "a staging folder was left"


CASES = {
    "rank-1-killed": (1, ["--kill-step", "9"], "params_sha256"),
    "rank-0-raises-in-its-backward": (0, ["--fail-step", "14", "--fail-where", "backward"], "params_sha256"),
    # Rank 0 killed after its step: its update of BatchNorm's running statistics in that step, which
    # DDP would broadcast at the next forward, died with it (a survivor's replaces it): the
    # parameters are exact, the buffers one batch's update apart.
    "rank-0-killed": (0, ["--kill-step", "9"], "parameters_only_sha256"),
    # After its optimizer step, before run.step(): the step's all-reduce completed everywhere, so
    # the survivors complete the step, and nothing is trained again.
    "rank-1-raises-after-its-optimizer-step": (1, ["--fail-step", "11", "--fail-where", "optimizer"], "params_sha256"),
    # In the checkpoint save after step 10: the others fail in the save's collectives, and heal.
    # As the files are written: every survivor's next collective has rank 2 in it.
    "rank-2-killed-in-a-save": (2, ["--fail-step", "10", "--fail-where", "save"], "params_sha256"),
    # In the save at the end of run.epochs() (3 epochs of 10 steps, a checkpoint every 7): the
    # replacement, past the last epoch, joins the survivors as they save it again.
    "rank-2-killed-in-the-final-save": (
        2,
        ["--fail-step", "30", "--fail-where", "save", "--every", "7"],
        "params_sha256",
    ),
    # In a run.save() of the script's own after the first epoch: healed, and that checkpoint is not
    # saved (the replacement goes on from the step; it does not make that call).
    "rank-2-killed-in-a-save-of-the-script": (
        2,
        ["--fail-step", "10", "--fail-where", "save", "--every", "100", "--save-each-epoch"],
        "params_sha256",
    ),
}


# One case on every torch release of the range (make test-compat): heal mode leans on how torch
# names groups and on DDP's private _update_process_group.
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.compat) if case == "rank-1-killed" else case
                                  for case in CASES])  # fmt: skip
def test_a_failed_rank_is_replaced_and_the_survivors_keep_their_processes(workdir, reference, case):
    rank, how, exact = CASES[case]
    output, healed, pids = train(workdir, "healed", "--fail-rank", str(rank), *how)
    after = int(how[1]) + (1 if "optimizer" in how else 0)
    assert f"rank(s) {rank} replaced" in output and f"going on after step {after}" in output, output
    for other in {0, 1, 2} - {rank}:
        assert pids[other][0] == pids[other][1], f"rank {other} was restarted: {pids}"
    assert pids[rank][0] != pids[rank][1]
    assert healed[exact] == reference[exact]
    assert "restarting the workers" not in output, output  # the launcher restarted nothing
    if "save" in how:
        assert_the_save_was_healed(workdir / "healed", output, healed, after)


def test_ranks_that_are_not_next_to_the_dead_one_heal_too(workdir, references):
    """4 ranks: in gloo's collectives a survivor may wait on another survivor that has left for
    the heal, which gloo cannot tell it; the next generation opened on the store does."""
    output, healed, pids = train(workdir, "healed", "--fail-rank", "2", "--kill-step", "7", nproc=4)
    assert "rank(s) 2 replaced" in output and "going on after step 7" in output, output
    assert [pids[rank][0] == pids[rank][1] for rank in range(4)] == [True, True, False, True], pids
    assert healed["params_sha256"] == references(4)["params_sha256"]


def test_a_rank_killed_as_a_save_gathers_the_plans_is_healed_too(workdir, references):
    """4 ranks; rank 2 dies in the checkpoint save after step 10 as it sends its part of DCP's plan
    to rank 0. Ranks 1 and 3, which sent theirs, wait on rank 0 alone: rank 0 heals at once, not
    in the save's own collectives (which would wait on them), and the save's group it frees as it
    leaves tells them of the failure (a group it held would keep them waiting)."""
    output, healed, pids = train(workdir, "healed", "--fail-rank", "2", "--fail-step", "10", "--fail-where", "plan",
                                 nproc=4)  # fmt: skip
    assert "rank(s) 2 replaced" in output and "going on after step 10" in output, output
    assert [pids[rank][0] == pids[rank][1] for rank in range(4)] == [True, True, False, True], pids
    assert healed["params_sha256"] == references(4)["params_sha256"]
    assert_the_save_was_healed(workdir / "healed", output, healed, 10)


def test_a_rank_that_fails_again_once_its_replacements_are_spent_falls_back_to_the_restart(workdir, reference):
    """--heal 1: rank 1 is replaced after step 7, and its replacement dies after step 10. The
    survivors, waiting for a second replacement that never starts, are stopped by the launcher;
    each keeps the state after step 10, and --max-restarts restarts every worker from it."""
    output, healed, _ = train(
        workdir, "healed", "--fail-rank", "1", "--kill-step", "7", "--kill-replacement-step", "10"
    )
    assert "rank(s) 1 replaced" in output and "going on after step 7" in output, output
    assert "restarting the workers (restart 1 of 1)" in output, output
    assert "resumed from step 10" in output, output
    assert healed["params_sha256"] == reference["params_sha256"]


def test_the_rank_serving_a_heal_dies_and_the_others_heal_again_from_another(workdir, reference):
    """Rank 1 is killed after step 9, and rank 0, sending its state to rank 1's replacement, is
    killed too (--heal counts each rank's replacements): rank 2 serves the heal again, in the
    next generation, to both replacements."""
    output, healed, pids = train(workdir, "healed", "--fail-rank", "1", "--kill-step", "9", "--source-dies")
    said = next(workdir.glob("phalanx-logs/*/attempt_0/rank2/stderr.log")).read_text()  # (rank 0's lines died)
    assert "a rank failed during the heal" in said and "healing again" in said, said
    assert "rank(s) 0, 1 replaced" in output and "from rank 2 to rank(s) 0, 1; going on after step 9" in output, output
    assert [pids[rank][0] == pids[rank][1] for rank in range(3)] == [False, False, True], pids
    # Rank 0's buffers after its step died with it, as in the case rank-0-killed.
    assert healed["parameters_only_sha256"] == reference["parameters_only_sha256"]
    assert "restarting the workers" not in output, output


def test_a_replacement_that_dies_as_it_receives_the_state_is_replaced_again(workdir, reference):
    """--heal 2: rank 2 is killed after step 9, and its first replacement dies as it waits for the
    state. Rank 0, sending it, and rank 1, waiting for the heal's end with rank 0, heal again with
    the second replacement within seconds: no rank waits out the group's timeout (300 s) on a
    connection of the broken generation left open."""
    output, healed, pids = train(workdir, "healed", "--fail-rank", "2", "--kill-step", "9",
                                 "--replacement-dies-receiving", heal=2)  # fmt: skip
    assert "a rank failed during the heal" in output and "healing again" in output, output
    seconds = [float(s) for s in re.findall(r"healed in ([\d.]+) s \(generation 2\)", output)]
    assert seconds and max(seconds) < 60, output
    assert "rank(s) 2 replaced" in output and "going on after step 9" in output, output
    assert [pids[rank][0] == pids[rank][1] for rank in range(3)] == [True, True, False], pids
    assert healed["params_sha256"] == reference["params_sha256"]
    assert "restarting the workers" not in output, output


def test_a_heal_that_cannot_finish_within_the_groups_timeout_falls_back_to_the_restart(workdir, reference):
    """The process group's timeout is 20 s (phalanx.init's), and rank 1's replacement sleeps 60 s
    before it joins: the survivors wait for it 20 s, say that the ranks could not heal, keep the
    state after step 9 and exit HEAL_FAILED; the launcher restarts every worker from that state."""
    output, healed, _ = train(workdir, "healed", "--fail-rank", "1", "--kill-step", "9", "--timeout", "20",
                              "--replacement-sleeps", "60")  # fmt: skip
    said = next(workdir.glob("phalanx-logs/*/attempt_0/rank0/stderr.log")).read_text()
    assert "the ranks could not heal (PeerFailed: waited 20 s for every rank to reach generation 1" in said, said
    assert "restarting the workers (restart 1 of 1)" in output and "resumed from step 9" in output, output
    assert healed["params_sha256"] == reference["params_sha256"]
