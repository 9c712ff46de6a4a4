"""Gradient compression under real launches over gloo: auto's trial, agreement, exact resume.

The worker (workers/compression_worker.py) records on every rank which candidate ran each step,
checks each step's delivered gradient against the true average, and hashes the parameters.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from phalanx.runtime.compression import AutoTrial, choose
from tests.conftest import EXAMPLES, WORKERS, phalanx_argv, run_command

pytestmark = pytest.mark.slow
TRAIN = str(EXAMPLES / "train.py")
WORKER = str(WORKERS / "compression_worker.py")
DECISION = re.compile(
    r"phalanx: compression auto chose (\w+)(?: \(([^)]*)\))?: (.+) ms/step \(medians? of (.+) trial steps(?: each)?, slowest rank\)"
)
#: One phase of 3 rounds x 2 steps x 3 candidates, then one step while the decision's all-reduce travels
#: (the phase's last candidate again).
PHASE = [
    name for turn in (["none", "fp16", "powersgd"], ["fp16", "powersgd", "none"], ["powersgd", "none", "fp16"])
    for name in turn for _ in range(2)
] + ["fp16"]  # fmt: skip
#: The worker's trial (no screen unless asked): warm-up (none 1, fp16 1, powersgd 2 plain + 1 compressed)
#: and one phase.
WARMUP = ["none", "fp16", "powersgd", "powersgd", "powersgd"]
TRIAL = WARMUP + PHASE
#: A trial whose screen leaves one candidate: one round, and the decision's step.
SCREENED = WARMUP + ["none", "none", "fp16", "fp16", "powersgd", "powersgd"] + ["powersgd"]


def decisions(text: str) -> list[tuple[str, dict[str, float]]]:
    found = []
    for chosen, _note, measured, _count in DECISION.findall(text):
        # "none 14.6, fp16 13.0 (out after phase 1), ...": a candidate out early carries a note
        timings = {name: float(ms) for name, ms in re.findall(r"(\w+) (\d+\.\d)", measured)}
        found.append((chosen, timings))
    return found


def rule_choice(summary: dict) -> str:
    """What auto's rule takes from a summary: the fastest of the last phase's candidates still within
    ``close``, lossier ones only for ``min_gain``."""
    trial = AutoTrial()
    timings = summary["ms_per_step"]
    still_in = trial.still_in({name: timings[name] for name in summary["phases"][-1]}, len(summary["phases"]) - 1)
    return choose({name: timings[name] for name in still_in}, trial.min_gain)


def launch(workdir: Path, *args: str, launcher: tuple[str, ...] = ("--nproc-per-node", "2"), timeout: float = 240):
    result = run_command(phalanx_argv("run", *launcher, *args), timeout=timeout, cwd=workdir)
    assert result.returncode == 0, result.output
    return result


def worker(workdir: Path, name: str, *args: str) -> tuple[list[dict], str]:
    result = launch(workdir, WORKER, str(workdir / name), *args)
    return [json.loads((workdir / name / f"rank{r}.json").read_text()) for r in (0, 1)], result.output


@pytest.mark.parametrize("launcher", [("--nproc-per-node", "2"), ("--simulate-nodes", "2")], ids=["2procs", "2nodes"])
def test_auto_trains_and_every_rank_keeps_the_same_choice(workdir, launcher):
    out = workdir / "metrics.json"
    # 5 epochs of 28 steps: room for the longest trial (the screen and 4 phases, 88 steps) and then some.
    result = launch(
        workdir, TRAIN, "--epochs", "5", "--compression", "auto", "--metrics-json", str(out), launcher=launcher
    )
    metrics = json.loads(out.read_text())
    summary = metrics["compression"]
    assert metrics["world_size"] == 2 and metrics["accuracy"] > 0.7, metrics
    losses = [float(x) for x in re.findall(r"epoch \d/5  step \d+  loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], result.stdout

    shown = decisions(result.stdout)
    assert len(shown) == 1, result.stdout  # the console shows rank 0's line, once
    chosen, timings = shown[0]
    assert set(timings) == {"none", "fp16", "powersgd"} and all(0 < ms < 10_000 for ms in timings.values()), timings
    assert chosen == summary["chosen"] == rule_choice(summary), summary  # lossier ones only for a real gain
    assert timings == {name: round(ms, 1) for name, ms in summary["ms_per_step"].items()}
    assert 1 <= len(summary["phases"]) <= AutoTrial().most_phases, summary
    assert summary["phases"][0] == ["none", "fp16", "powersgd"], summary
    logged = [decisions(log.read_text()) for log in sorted(workdir.glob("phalanx-logs/*/attempt_0/rank*/stdout.log"))]
    assert logged == [shown, shown], logged  # every rank wrote the same choice from the same numbers


@pytest.mark.parametrize(
    "phases, trial",
    [(("--phases", "1"), TRIAL), (("--phases", "3", "--close", "1e-9"), TRIAL), (("--screen", "1e-9"), SCREENED)],
    ids=["1phase", "1left", "screen"],
)
def test_every_rank_runs_the_same_candidate_each_step_and_gradients_stay_averaged(workdir, phases, trial):
    # With close (or screen) 1e-9 only the fastest is left after the first phase: the choice comes without
    # another, by the rule over that phase's candidates (a lossier one only for min_gain).
    ranks, output = worker(workdir, "auto", "--compression", "auto", "--steps", "40", *phases)
    used = [[rank["used"][str(step)] for step in range(40)] for rank in ranks]
    assert used[0] == used[1]
    chosen = ranks[0]["summary"]["chosen"]
    timings = ranks[0]["summary"]["ms_per_step"]
    assert ranks[0]["summary"]["phases"] == [["none", "fp16", "powersgd"]]
    assert chosen == choose(timings, AutoTrial().min_gain), timings
    assert used[0] == trial + [chosen] * (40 - len(trial)), used[0]
    assert ranks[0]["summary"] == ranks[1]["summary"]
    assert ranks[0]["summary"]["trial_steps"] == len(trial)
    assert decisions(output)[0] == (chosen, {k: round(v, 1) for k, v in ranks[0]["summary"]["ms_per_step"].items()})
    # The worker asserted at every step: identical gradients on both ranks, none exact, fp16
    # within its rounding; powersgd's uncompressed biases exact.
    assert ranks[0]["worst_error"]["none"] < 1e-5 and 0 < ranks[0]["worst_error"]["fp16"] < 2e-2
    assert ranks[0]["biases_exact"] and ranks[1]["biases_exact"]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    first, last = ranks[0]["losses"][:5], ranks[0]["losses"][-5:]
    assert sum(last) < 0.8 * sum(first), ranks[0]["losses"]


def interrupted(workdir: Path, compression: str, save_at: int, *args: str, steps: int = 50) -> tuple[dict, dict, str]:
    """Rank 0's record of a run saving at save_at and going on, and of a run resumed from that save."""
    full, _ = worker(workdir, "full", *run_args(workdir, compression, steps, *args), "--save-at", str(save_at))
    resumed, output = resume(workdir, "resumed", compression, save_at, *args, steps=steps)
    return full[0], resumed, output


def run_args(workdir: Path, compression: str, steps: int, *args: str) -> tuple[str, ...]:
    return "--compression", compression, "--steps", str(steps), "--checkpoint-dir", str(workdir / "ck"), *args


def resume(workdir: Path, name: str, compression: str, save_at: int, *args: str, steps: int = 50) -> tuple[dict, str]:
    """Rank 0's record of a run resumed from :func:`interrupted`'s save (which stays: it saves no other)."""
    resumed, output = worker(workdir, name, *run_args(workdir, compression, steps, *args))
    assert resumed[0]["resumed_from"] == save_at and resumed[0]["used"] == resumed[1]["used"]
    return resumed[0], output


def test_powersgd_resumes_bit_for_bit_with_its_error_feedback(workdir):
    full, resumed, _ = interrupted(workdir, "powersgd", 30)
    assert resumed["params_sha256"] == full["params_sha256"]
    # The control: the same resume, from the same checkpoint, without its compression state
    # drifts from the first step.
    control, _ = resume(workdir, "control", "powersgd", 30, "--no-compression-state")
    assert control["sha_after"]["30"] != full["sha_after"]["30"]
    assert control["params_sha256"] != full["params_sha256"]


def test_powersgd_resumes_bit_for_bit_over_several_buckets(workdir):
    # 64 -> 4096 -> 2048 -> 10: the 2048x4096 weight alone passes DDP's 25 MB bucket cap, so the
    # saved state has 2 buckets while the fresh DDP's first step has 1 (everything, in order).
    full, resumed, _ = interrupted(workdir, "powersgd", 6, "--widths", "4096,2048", steps=10)
    assert [resumed["sha_after"][str(s)] for s in range(6, 10)] == [full["sha_after"][str(s)] for s in range(6, 10)]


def test_auto_resumed_after_its_decision_keeps_the_choice_and_continues_exactly(workdir):
    full, resumed, output = interrupted(workdir, "auto", 30)
    assert resumed["summary"]["chosen"] == full["summary"]["chosen"]
    assert resumed["summary"]["ms_per_step"] == full["summary"]["ms_per_step"]
    assert resumed["summary"]["from_checkpoint"] and not full["summary"]["from_checkpoint"]
    assert set(resumed["used"].values()) == {full["summary"]["chosen"]}  # no second trial
    assert resumed["params_sha256"] == full["params_sha256"]
    # The decision line may also say why a faster candidate was not taken, before this note.
    decision = re.search(rf"compression auto chose {full['summary']['chosen']} \((.*)\): ", output)
    assert decision and decision.group(1).endswith("kept from the checkpoint"), output


def test_auto_resumed_mid_trial_continues_the_trial_where_it_stopped(workdir):
    full, resumed, _ = interrupted(workdir, "auto", 10)
    steps = range(10, len(TRIAL))
    assert [resumed["used"][str(s)] for s in steps] == [full["used"][str(s)] for s in steps] == TRIAL[10:]
    # Every trial step after the resume, PowerSGD's included, lands on the same parameters.
    assert [resumed["sha_after"][str(s)] for s in steps] == [full["sha_after"][str(s)] for s in steps]
    # Timings from both processes decide. Lost: step 9 (its end fell in the next process) and
    # step 10 (a fresh process's first step is never timed), both powersgd's.
    assert resumed["summary"]["timed_steps"] == {"none": 6, "fp16": 6, "powersgd": 4}
    assert full["summary"]["timed_steps"] == {"none": 6, "fp16": 6, "powersgd": 6}
    assert resumed["summary"]["trial_steps"] == len(TRIAL) and not resumed["summary"]["from_checkpoint"]
    assert all(math.isfinite(ms) for ms in resumed["summary"]["ms_per_step"].values())


def test_auto_measures_close_candidates_again_and_a_resume_goes_on_with_that_phase(workdir):
    # close 10: every candidate is close, so the second phase measures all three again.
    two_phases = TRIAL + PHASE
    full, resumed, output = interrupted(
        workdir, "auto", 30, "--phases", "2", "--close", "10", steps=len(two_phases) + 4
    )
    assert [full["used"][str(s)] for s in range(len(two_phases))] == two_phases
    assert full["summary"]["phases"] == [["none", "fp16", "powersgd"]] * 2 == resumed["summary"]["phases"]
    assert full["summary"]["timed_steps"] == {"none": 12, "fp16": 12, "powersgd": 12}
    assert full["summary"]["trial_steps"] == len(two_phases) == resumed["summary"]["trial_steps"]
    # Saved in the second phase (step 30), resumed there: the same trial steps, the same parameters.
    # (The choice after it may differ: each process timed its own steps.)
    steps = range(30, len(two_phases))
    assert [resumed["used"][str(s)] for s in steps] == [full["used"][str(s)] for s in steps]
    assert [resumed["sha_after"][str(s)] for s in steps] == [full["sha_after"][str(s)] for s in steps]
    # Lost to the restart: step 29 (powersgd; its end fell in the next process) and step 30 (fp16, a fresh
    # process's first step).
    assert resumed["summary"]["timed_steps"] == {"none": 12, "fp16": 11, "powersgd": 11}
    assert decisions(output)[0][0] == resumed["summary"]["chosen"]
