"""phalanx's PowerSGD memory layouts checked against torch's own hook, in a gloo group of one.

Run as a script, one check per process (``test_compression_choice.py`` does so). torch's hook
runs its callbacks in gloo's worker threads, and a worker drops the Python references a callback
held (the group among them) only once it gets the GIL back, after the caller's ``wait()`` has
returned. A process that destroys the group right after can have the group freed in that worker,
which then joins itself ("Resource deadlock avoided"); one that simply exits can have the worker
ask for the GIL during interpreter shutdown ("terminate called without an active exception").
Either aborts the process: in pytest's own process, the whole suite. So this script prints its
result and leaves with ``os._exit``, never tearing the group down.

Usage: ``python powersgd_layout_checks.py CHECK STORE_FILE``
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from phalanx.runtime.powersgd_state import PowerSGD, Slot, _pieces, _q_order, _SavedBucket


def per_parameter_layout_matches_torchs_hook() -> None:
    """Same-shape matrices interleaved with others: torch groups them by shape in its memories.
    Split by our layout, every matrix's P and Q must rebuild exactly what the hook delivered."""
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


def memories_move_by_parameter_into_another_bucket_layout() -> None:
    """The fallback when a bucket's new layout cannot re-enact the saved buckets: every
    parameter's residual and Q must land in its place of the new layout."""

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
    qs = {
        k: v.clone()
        for k, v in _pieces(
            powersgd.state.q_memory_dict[0], _q_order(before), [s.cols for s in _q_order(before)]
        ).items()
    }
    assert any(error.abs().sum() > 0 for error in errors.values())

    powersgd._waiting.update(powersgd._lift(lambda index: True))
    powersgd._lay_out(0, after, buffer)
    assert torch.equal(powersgd.state.error_dict[0], torch.cat([errors[s.name] for s in after]))
    assert torch.equal(powersgd.state.q_memory_dict[0], torch.cat([qs[s.name] for s in _q_order(after)]))
    assert powersgd.state.p_memory_dict[0].numel() == 10 + 128 and not powersgd._waiting


CHECKS = {check.__name__: check for check in (per_parameter_layout_matches_torchs_hook,
                                              memories_move_by_parameter_into_another_bucket_layout)}  # fmt: skip


def main() -> None:
    name, store = sys.argv[1:]
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        CHECKS[name]()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"{name}: passed", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
