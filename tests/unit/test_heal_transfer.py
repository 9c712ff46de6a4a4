"""Heal mode's state transfer: the skeleton of a state and its tensors packed per dtype come
back as the same nested state (the sends and receives themselves run in tests/e2e/test_heal.py)."""

from __future__ import annotations

import torch

from phalanx.runtime.heal.transfer import _fill, _pack, _sizes, _strip


def test_a_state_comes_back_whole_from_its_skeleton_and_packed_tensors():
    state = {
        "model": {"weight": torch.randn(3, 4), "bias": torch.zeros(4), "steps": torch.tensor(7)},
        "optimizer": {
            "state": {0: {"momentum_buffer": torch.randn(3, 4)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "data": {"epoch": 1, "position": 24, "seed": 5},
        "flags": (True, None, "text", [torch.arange(5, dtype=torch.int32)]),
        "empty": torch.empty(0, 2),
    }
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors, {})
    packed = _pack(tensors)
    assert set(packed) == {torch.float32, torch.int64, torch.int32}
    assert {dtype: buffer.numel() for dtype, buffer in packed.items()} == _sizes(skeleton, {})
    back = _fill(skeleton, packed)
    assert back["data"] == state["data"] and back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(back["model"]["weight"], state["model"]["weight"])
    assert torch.equal(
        back["optimizer"]["state"][0]["momentum_buffer"], state["optimizer"]["state"][0]["momentum_buffer"]
    )
    assert back["model"]["steps"].item() == 7 and back["model"]["steps"].dtype == torch.int64
    assert isinstance(back["flags"], tuple) and back["flags"][:3] == (True, None, "text")
    assert back["flags"][3][0].tolist() == [0, 1, 2, 3, 4] and back["empty"].shape == (0, 2)
    before = packed[torch.float32].clone()
    back["model"]["bias"].add_(1)  # each tensor is a copy of its own, not a view of the packed buffer
    assert torch.equal(packed[torch.float32], before)
