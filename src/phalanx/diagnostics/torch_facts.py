"""What this machine's torch build can do: CUDA, cuDNN, NCCL, Gloo, and the GPUs it sees.

Imports torch, the one slow part of the env report. What a build lacks (CUDA, cuDNN, NCCL) is None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.diagnostics.machine import UNKNOWN, read_text
from phalanx.torch_compat import missing_names

#: The NVIDIA kernel driver names itself here on every machine it is loaded on (containers too).
NVIDIA_DRIVER_FILE = "proc/driver/nvidia/version"


@dataclass(frozen=True)
class TorchFacts:
    version: str  # torch.__version__, e.g. "2.13.0+cpu"; "not installed" without torch
    cuda_build: str | None  # the CUDA version torch was built with (torch.version.cuda)
    hip_build: str | None  # the ROCm version of a ROCm build (torch.version.hip)
    cuda_available: bool  # torch.cuda.is_available(): a usable driver and at least one visible GPU
    cudnn: str | None  # e.g. "9.1.0"
    nccl: str | None  # the NCCL inside torch, e.g. "2.21.5"
    distributed_available: bool
    gloo_available: bool
    nccl_available: bool
    mpi_available: bool
    #: The private torch names phalanx uses that this torch lacks: "name (the feature that needs it)".
    missing_private: tuple[str, ...] = ()

    def backends(self) -> dict[str, bool]:
        return {"gloo": self.gloo_available, "nccl": self.nccl_available, "mpi": self.mpi_available}


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    memory_bytes: int
    capability: str  # compute capability, e.g. "9.0"


@dataclass(frozen=True)
class GpuReport:
    #: NVIDIA driver version, "none" when no NVIDIA driver is loaded, "unknown" when it cannot be read.
    driver: str
    devices: tuple[GpuFacts, ...]


def torch_facts() -> TorchFacts:
    try:
        import torch
    except ImportError:
        return TorchFacts("not installed", None, None, False, None, None, False, False, False, False)
    import torch.distributed as dist

    distributed = dist.is_available()
    return TorchFacts(
        version=torch.__version__,
        cuda_build=torch.version.cuda,
        hip_build=getattr(torch.version, "hip", None),
        cuda_available=torch.cuda.is_available(),
        cudnn=cudnn_version_text(torch.backends.cudnn.version()),
        nccl=_nccl_version(torch),
        distributed_available=distributed,
        gloo_available=distributed and dist.is_gloo_available(),
        nccl_available=distributed and dist.is_nccl_available(),
        mpi_available=distributed and dist.is_mpi_available(),
        missing_private=tuple(f"{name.where} ({name.feature})" for name, _ in missing_names()),
    )


def cudnn_version_text(number: int | None) -> str | None:
    """torch reports cuDNN as one number: 8902 is 8.9.2 (cuDNN 8), 90100 is 9.1.0 (cuDNN 9 and later)."""
    if not number:
        return None
    if number >= 10000:
        return f"{number // 10000}.{number % 10000 // 100}.{number % 100}"
    return f"{number // 1000}.{number % 1000 // 100}.{number % 100}"


def _nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL has no _nccl_version at all
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def gpu_report(cuda: Any = None, root: Path = Path("/")) -> GpuReport:
    """The GPUs torch sees (after CUDA_VISIBLE_DEVICES) and the driver; ``cuda`` is torch.cuda."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    count = cuda.device_count() if cuda.is_available() else 0
    found = [(index, cuda.get_device_properties(index)) for index in range(count)]
    devices = tuple(GpuFacts(i, p.name, int(p.total_memory), f"{p.major}.{p.minor}") for i, p in found)
    return GpuReport(nvidia_driver_version(root), devices)


def nvidia_driver_version(root: Path = Path("/")) -> str:
    text = read_text(root / NVIDIA_DRIVER_FILE)
    if text is not None:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ...",
        # or "... Open Kernel Module for x86_64  570.124.06  Release Build ..."
        match = re.search(r"Module.*?\s(\d+\.\d+(?:\.\d+)?)(?:\s|$)", text)
        return match.group(1) if match else UNKNOWN
    if root != Path("/") or shutil.which("nvidia-smi") is None:
        return "none"
    try:  # a driver without the /proc file (rare): ask the tool, briefly
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    lines = result.stdout.split()
    return lines[0] if result.returncode == 0 and lines else UNKNOWN
