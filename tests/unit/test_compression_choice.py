"""auto compression's pure parts: the trial schedule, the choice, the settings it refuses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from phalanx.errors import SettingsRefused
from phalanx.runtime.compression import AutoTrial, choose
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.model import COMPRESSIONS, compression_of, wrap_model
from phalanx.runtime.powersgd_state import Slot, _q_order


def candidates(*spec: tuple[str, int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=name, warmup_steps=warmup) for name, warmup in spec]


def test_the_schedule_warms_up_then_rotates_the_turns():
    schedule = AutoTrial(rounds=3, steps_per_round=1).schedule(candidates(("a", 1), ("b", 0), ("c", 2)))
    assert schedule == (
        ("a", False), ("c", False), ("c", False),  # warm-up, not timed
        ("a", True), ("b", True), ("c", True),
        ("b", True), ("c", True), ("a", True),
        ("c", True), ("a", True), ("b", True),
    )  # fmt: skip


@pytest.mark.parametrize(
    "timings, chosen",
    [
        ({"none": 15.0, "fp16": 25.0, "powersgd": 25.0}, "none"),  # DESIGN.md, unshaped link
        ({"none": 65.0, "fp16": 40.0, "powersgd": 25.0}, "powersgd"),  # DESIGN.md, 1 Gbit
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


@pytest.mark.parametrize("settings", [{"rounds": 0}, {"steps_per_round": 0}, {"min_gain": 1.0}, {"min_gain": -0.1}])
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


@pytest.fixture
def group_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_per_parameter_layout_matches_what_torchs_powersgd_hook_writes(group_of_one):
    """Same-shape matrices interleaved with others: torch groups them by shape in its memories.
    Split by our layout, every matrix's P and Q must rebuild exactly what the hook delivered."""
    from phalanx.runtime.powersgd_state import PowerSGD, _pieces, _SavedBucket

    shapes = {"w2": (10, 128), "b2": (10, 1), "w1": (128, 64), "w3": (10, 128), "b1": (128, 1)}
    layout = tuple(Slot(name, rows * cols, rows, cols, 1 if cols > 1 else 0) for name, (rows, cols) in shapes.items())
    powersgd = PowerSGD({})
    powersgd.state.iter = 2  # past the plain all-reduce steps
    buffer = torch.randn(sum(slot.numel for slot in layout), generator=torch.Generator().manual_seed(0))
    delivered = powerSGD_hook.powerSGD_hook(powersgd.state, _SavedBucket(0, layout, buffer.clone(), last=True)).wait()
    order = _q_order(layout)
    assert [slot.name for slot in order] == ["w2", "w3", "w1"]
    ps = _pieces(powersgd.state.p_memory_dict[0], order, [s.rows * s.rank for s in order])
    qs = _pieces(powersgd.state.q_memory_dict[0], order, [s.cols * s.rank for s in order])
    outputs = _pieces(delivered, layout, [s.numel for s in layout])
    for slot in order:
        rebuilt = ps[slot.name].view(slot.rows, slot.rank) @ qs[slot.name].view(slot.cols, slot.rank).T
        torch.testing.assert_close(outputs[slot.name].view(slot.rows, slot.cols), rebuilt)


def test_memories_move_by_parameter_into_another_bucket_layout(group_of_one):
    """The fallback when a bucket's new layout cannot re-enact the saved buckets: every
    parameter's residual and Q must land in its place of the new layout."""
    from phalanx.runtime.powersgd_state import PowerSGD, _pieces, _SavedBucket

    def slot(name: str, rows: int, cols: int) -> Slot:
        return Slot(name, rows * cols, rows, cols, 1 if cols > 1 else 0)

    before = (slot("w1", 128, 64), slot("b1", 128, 1), slot("w2", 10, 128))
    after = (before[2], before[1], before[0])
    powersgd = PowerSGD({})
    powersgd.state.iter = 2
    buffer = torch.randn(sum(s.numel for s in before), generator=torch.Generator().manual_seed(1))
    powerSGD_hook.powerSGD_hook(powersgd.state, _SavedBucket(0, before, buffer, last=True)).wait()
    powersgd._layouts[0] = before
    errors = {k: v.clone() for k, v in _pieces(powersgd.state.error_dict[0], before, [s.numel for s in before]).items()}
    qs = {k: v.clone() for k, v in _pieces(powersgd.state.q_memory_dict[0], _q_order(before), [s.cols for s in _q_order(before)]).items()}
    assert any(error.abs().sum() > 0 for error in errors.values())

    powersgd._waiting.update(powersgd._lift(lambda index: True))
    powersgd._lay_out(0, after, buffer)
    assert torch.equal(powersgd.state.error_dict[0], torch.cat([errors[s.name] for s in after]))
    assert torch.equal(powersgd.state.q_memory_dict[0], torch.cat([qs[s.name] for s in _q_order(after)]))
    assert powersgd.state.p_memory_dict[0].numel() == 10 + 128 and not powersgd._waiting
