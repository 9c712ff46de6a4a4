"""auto compression's pure parts (the trial schedule, the choice, the settings it refuses), and
PowerSGD's checkpointable memories laid out as torch's hook lays them."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from phalanx.errors import SettingsRefused
from phalanx.runtime.compression import AutoTrial, GradientCompression, choose
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.model import COMPRESSIONS, compression_of, wrap_model
from tests.conftest import run_command
from tests.unit.powersgd_layout_checks import CHECKS


def candidates(*spec: tuple[str, int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=name, warmup_steps=warmup, release=lambda: None) for name, warmup in spec]


def test_the_schedule_warms_up_then_rotates_the_turns():
    schedule = AutoTrial(rounds=3, steps_per_round=1, screen=None).schedule(candidates(("a", 1), ("b", 0), ("c", 2)))
    assert schedule == (
        ("a", False), ("c", False), ("c", False),  # warm-up, not timed
        ("a", True), ("b", True), ("c", True),
        ("b", True), ("c", True), ("a", True),
        ("c", True), ("a", True), ("b", True),
    )  # fmt: skip


def test_a_later_phase_rotates_the_turns_of_the_candidates_still_in():
    assert AutoTrial(rounds=2, steps_per_round=2).phase(["b", "c"], 1) == (
        ("b", True), ("b", True), ("c", True), ("c", True),
        ("c", True), ("c", True), ("b", True), ("b", True),
    )  # fmt: skip


def test_the_screen_is_one_round_after_the_warm_up():
    schedule = AutoTrial(rounds=3, steps_per_round=2).schedule(candidates(("a", 1), ("b", 0)))
    assert schedule == (("a", False), ("a", True), ("a", True), ("b", True), ("b", True))
    assert AutoTrial().most_phases == 5 and AutoTrial(screen=None).most_phases == 4


@pytest.mark.parametrize(
    "timings, still_in",
    [
        ({"none": 14.3, "fp16": 15.2, "powersgd": 17.8}, ["none", "fp16", "powersgd"]),  # loopback: all close
        ({"none": 60.0, "fp16": 38.0, "powersgd": 24.0}, ["powersgd"]),  # 1 Gbit: one phase decides
        ({"none": 10.0, "fp16": 12.5, "powersgd": 12.6}, ["none", "fp16"]),  # 25% is still close, 26% is out
        ({"none": math.inf, "fp16": 30.0, "powersgd": math.inf}, ["fp16"]),  # unmeasured is never close
    ],
)
def test_candidates_more_than_close_slower_than_the_fastest_are_out(timings, still_in):
    assert AutoTrial(close=0.25).still_in(timings, 1) == still_in
    assert AutoTrial(close=0.25, screen=None).still_in(timings, 0) == still_in  # no screen: phase 0 is full


def test_by_default_the_screen_and_one_phase_decide_a_1gbit_link_and_loopback_is_measured_again():
    # docs/runtime-design.md's figures (ms/step): PowerSGD wins by 1.6x on a 1 Gbit link; on loopback all are close.
    gbit, loopback = {"none": 65.0, "fp16": 40.0, "powersgd": 25.0}, {"none": 14.3, "fp16": 15.2, "powersgd": 17.8}
    assert AutoTrial().still_in(gbit, 0) == ["fp16", "powersgd"]  # plain all-reduce, 2.6x: out after 2 steps
    assert AutoTrial().still_in({"fp16": 40.0, "powersgd": 25.0}, 1) == ["powersgd"]
    assert AutoTrial().still_in(loopback, 0) == AutoTrial().still_in(loopback, 1) == ["none", "fp16", "powersgd"]
    # Two steps each can be a third apart by chance: not enough to leave the screen.
    assert AutoTrial().still_in({"none": 20.0, "fp16": 12.0, "powersgd": 13.0}, 0) == ["none", "fp16", "powersgd"]


def test_the_bar_narrows_as_the_phases_add_steps_to_the_medians():
    loopback = {"none": 14.0, "fp16": 14.5, "powersgd": 17.0}  # PowerSGD 21% slower
    assert AutoTrial().still_in(loopback, 1) == ["none", "fp16", "powersgd"]  # after the first full phase: 25%
    assert AutoTrial().still_in(loopback, 2) == ["none", "fp16"]  # after the second: 25% / sqrt(2), 17.7%
    assert AutoTrial(screen=None).still_in(loopback, 1) == ["none", "fp16"]  # without a screen, phase 1 is the second
    assert AutoTrial().still_in({"none": 14.0, "fp16": 15.7}, 4) == ["none", "fp16"]  # 12% < 12.5% after the fourth


@pytest.mark.parametrize(
    "timings, chosen",
    [
        ({"none": 15.0, "fp16": 25.0, "powersgd": 25.0}, "none"),  # docs/runtime-design.md, unshaped link
        ({"none": 65.0, "fp16": 40.0, "powersgd": 25.0}, "powersgd"),  # docs/runtime-design.md, 1 Gbit
        ({"none": 100.0, "fp16": 98.0, "powersgd": 99.0}, "none"),  # 2%: noise, keep exact gradients
        ({"none": 100.0, "fp16": 90.0, "powersgd": 88.0}, "fp16"),  # powersgd within 3% of fp16
        ({"none": math.inf, "fp16": 30.0, "powersgd": math.inf}, "fp16"),  # unmeasured never wins
    ],
)
def test_the_choice_is_the_fastest_unless_a_lossier_one_gains_too_little(timings, chosen):
    assert choose(timings, 0.03) == chosen


def test_the_choice_is_within_the_margin_of_the_fastest():
    import itertools

    for values in itertools.product([10.0, 10.2, 10.5, 11.0, 20.0], repeat=3):
        timings = dict(zip(("none", "fp16", "powersgd"), values))
        assert timings[choose(timings, 0.03)] <= min(values) / (1 - 0.03)


@pytest.mark.parametrize(
    "settings",
    [
        {"rounds": 0},
        {"steps_per_round": 0},
        {"phases": 0},
        {"close": 0.0},
        {"screen": -1.0},
        {"min_gain": 1.0},
        {"min_gain": -0.1},
    ],
)
def test_a_trial_that_cannot_compare_is_refused(settings):
    with pytest.raises(SettingsRefused):
        AutoTrial(**settings)


def test_auto_is_a_cli_choice():
    assert COMPRESSIONS[-1] == "auto" and {"none", "fp16", "bf16", "powersgd"} <= set(COMPRESSIONS)


def one_process() -> DistributedContext:
    return DistributedContext(rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1,
                              device=torch.device("cpu"), backend="gloo")  # fmt: skip


def test_one_process_sends_nothing_and_says_so():
    model = wrap_model(torch.nn.Linear(4, 2), one_process(), compression="auto")
    compression = compression_of(model)
    assert compression.summary()["chosen"] == "none" and compression.summary()["mode"] == "auto"
    compression.load_state_dict(compression.state_dict())  # a checkpoint round trip of nothing
    with pytest.raises(ValueError, match="did not come from phalanx.runtime.model.wrap_model"):
        compression_of(torch.nn.Linear(4, 2))


@pytest.mark.parametrize("settings", [{"compression": "zstd"}, {"compression": "powersgd", "powersgd_rank": 0}])
def test_wrap_model_refuses_what_it_cannot_do(settings):
    with pytest.raises(SettingsRefused):
        wrap_model(torch.nn.Linear(4, 2), one_process(), **settings)


LAYOUT_CHECKS = Path(__file__).with_name("powersgd_layout_checks.py")


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_powersgd_memories_split_and_move_as_torchs_hook_lays_them_out(check, tmp_path):
    # A process of its own: torch's hook in a gloo group can abort the process that ran it (the script says why).
    result = run_command(
        [sys.executable, str(LAYOUT_CHECKS), check, str(tmp_path / "store")], timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.output
    assert result.stdout.strip() == f"{check}: passed"


class FinishedWork:
    """The decision's all-reduce, already done (in a run: started a step earlier on every rank)."""

    def wait(self) -> None:
        pass


def decide(compression, timings: list[float]) -> None:
    compression._pending = (FinishedWork(), torch.tensor(timings, dtype=torch.float64))
    compression._finish_decision()


def test_a_phase_among_the_candidates_still_in_then_the_choice_over_them(capsys):
    names = ("none", "fp16", "powersgd")
    trial = AutoTrial(rounds=1, steps_per_round=1, phases=3, screen=None)
    compression = GradientCompression("auto", one_process(), candidates(*[(n, 0) for n in names]), trial)
    first = len(compression._schedule)
    decide(compression, [10.0, 11.0, 20.0])  # powersgd 2x slower: out
    assert compression.chosen is None and compression.summary()["phases"] == [list(names), ["none", "fp16"]]
    assert compression._schedule[first:] == (("none", True), ("fp16", True))
    decide(compression, [10.0, 11.0, 19.0])  # both still close: a third phase
    assert compression.chosen is None and len(compression.summary()["phases"]) == 3
    decide(compression, [10.0, 11.0, 19.0])  # the last phase: the choice, over its candidates
    assert compression.chosen == "none" and compression.summary()["trial_steps"] == len(compression._schedule)
    line = capsys.readouterr().out
    assert "chose none: none 10.0, fp16 11.0, powersgd 19.0 (out after phase 1) ms/step" in line, line


def test_the_screen_drops_only_a_candidate_twice_as_slow_and_a_full_phase_follows(capsys):
    names = ("none", "fp16", "powersgd")
    trial = AutoTrial(rounds=2, steps_per_round=1, phases=1)
    compression = GradientCompression("auto", one_process(), candidates(*[(n, 0) for n in names]), trial)
    assert len(compression._schedule) == 3  # the screen: one round
    decide(compression, [65.0, 40.0, 25.0])  # a 1 Gbit link: plain all-reduce 2.6x slower
    assert compression.summary()["phases"] == [list(names), ["fp16", "powersgd"]]
    assert compression._schedule[3:] == (("fp16", True), ("powersgd", True), ("powersgd", True), ("fp16", True))
    decide(compression, [65.0, 30.0, 25.0])  # fp16 20% slower, but the last phase has run: the choice
    assert compression.chosen == "powersgd"
    assert "none 65.0 (out after phase 1), fp16 30.0, powersgd 25.0 ms/step" in capsys.readouterr().out
