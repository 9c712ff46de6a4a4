"""DDP wrapping with device placement and gradient compression chosen by name."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from phalanx.errors import SettingsRefused
from phalanx.runtime.context import DistributedContext

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def wrap_model(
    model: torch.nn.Module, context: DistributedContext, *, compression: str = "none", powersgd_rank: int = 1
) -> torch.nn.Module:
    """The model on this rank's device, in DDP when there is more than one process.

    ``compression`` names a DDP communication hook: fp16 and bf16 halve the bytes sent,
    powersgd sends a rank-``powersgd_rank`` approximation (with error feedback).
    """
    if compression not in COMPRESSIONS:
        raise SettingsRefused(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}", hint="pick one of those")
    if compression == "bf16" and context.is_distributed and context.backend != "nccl":
        raise SettingsRefused(
            f"compression bf16 on the {context.backend} backend",
            "torch's bf16 hook needs NCCL 2.10+ on CUDA 11+ (or XCCL on XPU); gloo cannot reduce bf16 gradients.",
            "use --compression fp16 (same bytes on the wire) or powersgd on gloo",
        )
    model = model.to(context.device)
    if not context.is_distributed:
        return model
    ddp = DistributedDataParallel(model, device_ids=[context.local_rank] if context.device.type == "cuda" else None)
    hook, state = _hook(compression, powersgd_rank)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def _hook(compression: str, powersgd_rank: int) -> tuple[Any, Any]:
    if compression == "fp16":
        return default_hooks.fp16_compress_hook, None
    if compression == "bf16":
        return default_hooks.bf16_compress_hook, None
    if compression == "powersgd":
        # start_powerSGD_iter must be > 1 with error feedback and warm start (see DESIGN.md).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=2)
        return powerSGD_hook.powerSGD_hook, state
    return None, None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def parameters_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the float32 bytes of every parameter, in state_dict order."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in unwrap(model).state_dict().values():
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
