"""How many GPUs this node's workers can see, without importing torch on hosts that have none."""

from __future__ import annotations

import os
from pathlib import Path

_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def visible_gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return 0
    if not _NVIDIA_PROC.exists() and not Path("/dev/nvidiactl").exists() and not Path("/dev/kfd").exists():
        return 0  # no NVIDIA or ROCm driver: importing torch would only tell us the same, slower
    import torch  # the driver is there: let CUDA itself count (MIG, CUDA_VISIBLE_DEVICES, ROCm)

    return torch.cuda.device_count()
