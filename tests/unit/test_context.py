"""phalanx.init() refuses a backend its process cannot run, before it makes any group."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.errors import SettingsRefused


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_a_gpu_is_refused_before_any_group(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SettingsRefused) as refused:
        phalanx.init(backend="nccl")
    assert refused.value.exit_code == 2
    assert "backend nccl for LOCAL_RANK 0, on a node with 0 GPU(s)" in str(refused.value)
    assert "HINT: start at most as many processes per node as it has GPUs" in str(refused.value)
