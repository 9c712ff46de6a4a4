"""An NCCL process group of one rank (one GPU: NCCL refuses two ranks on one device): an
all-reduce, DDP with each compression hook, and the flight recorder as the stall watchdog
reads it. Run by tests/gpu/test_cuda.py in a process of its own, because the flight recorder
must be switched on before the group is made. Argument: a file for the group's store."""

from __future__ import annotations

import copy
import os
import pickle
import sys
import time

os.environ["TORCH_FR_BUFFER_SIZE"] = "500"

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.compression import GradientCompression, make_candidate
from phalanx.runtime.context import DistributedContext
from phalanx.runtime.model import bf16_supported
from phalanx.runtime.watchdog import collective_counts, flight_recorder_progress, watchdog_unavailable

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
ones = torch.ones(4, device=device)
dist.all_reduce(ones)
assert ones.tolist() == [1.0] * 4, ones

context = DistributedContext(rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1, device=device,
                             backend="nccl")  # fmt: skip
print(f"nccl {torch.cuda.nccl.version()}: bf16 hook supported: {bf16_supported(context)}")
for name in ("fp16", "bf16", "powersgd"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    reference = copy.deepcopy(net)
    ddp = DistributedDataParallel(net, device_ids=[0])
    names = {id(parameter): n for n, parameter in net.named_parameters()}
    GradientCompression(name, context, [make_candidate(name, names, 1)]).register(ddp)
    data, target = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(data), target).backward()
        torch.nn.functional.cross_entropy(reference(data), target).backward()
    for (parameter_name, mine), theirs in zip(net.named_parameters(), reference.parameters()):
        assert torch.isfinite(mine.grad).all(), (name, parameter_name)
        if name != "powersgd":  # one rank's mean is its own gradient, rounded to 16 bits on the way
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=2e-2, atol=2e-3)
    print(f"{name}: 3 DDP steps on nccl, gradients finite" + ("" if name == "powersgd" else " and equal to local ones"))
    del ddp

torch.cuda.synchronize()
c10d = torch._C._distributed_c10d
for dump in ("_dump_nccl_trace", "_dump_fr_trace"):  # which flight recorder holds NCCL's collectives
    entries = (
        pickle.loads(getattr(c10d, dump)(includeStackTraces=False)).get("entries", []) if hasattr(c10d, dump) else None
    )
    print(f"{dump}: {'absent' if entries is None else f'{len(entries)} entries'}")
assert watchdog_unavailable("nccl", 300) is None, watchdog_unavailable("nccl", 300)
deadline = time.monotonic() + 15
progress = flight_recorder_progress(0, "gpu", None, "nccl")  # per process group: one here
while progress.completed != progress.issued and time.monotonic() < deadline:  # NCCL's watchdog marks completion
    time.sleep(0.2)
    progress = flight_recorder_progress(0, "gpu", None, "nccl")
print(f"flight recorder: issued {progress.issued}, completed {progress.completed} ({progress.last_completed_op}), "
      f"pending {progress.pending_op}")  # fmt: skip
assert max(progress.issued.values(), default=0) >= 10, progress
assert progress.completed == progress.issued and progress.pending_op is None, progress
counts = collective_counts("nccl")  # the watchdog's cheap poll: the status alone, without the entries
print(f"flight recorder status: {counts}")
assert counts is not None and max(c[1] for c in counts) == max(progress.issued.values()), counts
dist.destroy_process_group()
print("ok")
