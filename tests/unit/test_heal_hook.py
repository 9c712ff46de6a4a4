"""Which errors heal mode takes for a peer's failure: those out of a torch.distributed collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.heal.hook import PeerFailed, raised_by_a_collective


def caught(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_an_error_out_of_a_collective_is_a_peers_failure():
    # No process group here: c10d raises from its own module, as it does when a peer's connection closed.
    error = caught(lambda: dist.all_reduce(torch.ones(1)))
    assert raised_by_a_collective(error), error
    assert raised_by_a_collective(PeerFailed("rank 1 opened generation 1 of the group: a peer failed"))


def test_an_error_of_the_ranks_own_code_is_not():
    def state_dict() -> dict:
        raise RuntimeError("CUDA out of memory")

    assert not raised_by_a_collective(caught(state_dict))
    assert not raised_by_a_collective(RuntimeError("never raised: no traceback"))
