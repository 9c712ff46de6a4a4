"""Goes over the memory limit of the cgroup in argv[2]: the worker itself (argv[1] "worker") or its
DataLoader's worker process ("dataloader") joins that cgroup and fills memory until the kernel's
out-of-memory killer ends it."""

import os
import sys
from pathlib import Path

CGROUP = Path(sys.argv[2])


def over_the_limit() -> None:
    (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    held = [bytearray(16 * 1024**2) for _ in range(64)]  # 1 GiB, written, against the cgroup's 64 MiB
    print(f"not killed with {len(held) * 16} MiB held", file=sys.stderr)


if sys.argv[1] == "worker":
    over_the_limit()
else:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Greedy(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            over_the_limit()
            return torch.zeros(1)

    for _ in DataLoader(Greedy(), num_workers=1):
        pass
