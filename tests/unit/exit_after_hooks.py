"""A process that runs torch's PowerSGD hook in a gloo group of one, then destroys the group
with phalanx's ``destroy_process_group`` right after the last ``wait()`` and exits: it must exit 0.

The hook's callbacks run in gloo's threads, which drop them only once they get the GIL back
(phalanx.runtime.context.destroy_process_group says what goes wrong otherwise). The race is
lost in some runs only, so ``test_context.py`` runs this script many times.

Usage: ``python exit_after_hooks.py STORE_FILE``
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from phalanx.runtime.context import destroy_process_group
from phalanx.runtime.powersgd_state import PowerSGD, Slot, _SavedBucket

# At module level, as a training script's end often is: what the loop made lives until Python
# shuts down, the hook's state among it.
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
layout = (Slot("w", 64 * 32, 64, 32, 1), Slot("b", 64, 64, 1, 0))
powersgd = PowerSGD({})
powersgd.state.iter = 2  # past the plain all-reduce steps: the compressed path, with its callbacks
for _ in range(3):
    buffer = torch.randn(sum(slot.numel for slot in layout))
    powerSGD_hook.powerSGD_hook(powersgd.state, _SavedBucket(0, layout, buffer, last=True)).wait()
destroy_process_group()
print("exited cleanly", flush=True)
