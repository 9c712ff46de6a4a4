"""DDP wrapping with device placement and gradient compression chosen by name."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from phalanx.errors import SettingsRefused
from phalanx.runtime.bucket_layout import settle_before_first_step
from phalanx.runtime.compression import AutoTrial, GradientCompression, make_candidate
from phalanx.runtime.context import DistributedContext

#: The names --compression accepts (examples/train.py reads its choices from here).
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "auto")
_ATTRIBUTE = "_phalanx_compression"


def bf16_supported(context: DistributedContext) -> bool:
    """torch's bf16 hook needs NCCL 2.10+ on CUDA; gloo cannot reduce bf16 gradients."""
    return context.backend == "nccl" and context.device.type == "cuda" and torch.cuda.nccl.version() >= (2, 10)


def auto_candidates(context: DistributedContext) -> tuple[str, ...]:
    """What ``auto`` tries, least lossy first: bf16 only where the backend can reduce it."""
    return ("none", "fp16", "bf16", "powersgd") if bf16_supported(context) else ("none", "fp16", "powersgd")


def wrap_model(
    model: torch.nn.Module, context: DistributedContext, *, compression: str = "none", powersgd_rank: int = 1,
    trial: AutoTrial | None = None,
) -> torch.nn.Module:  # fmt: skip
    """The model on this rank's device, in DDP when there is more than one process.

    ``compression`` names a DDP communication hook: fp16 and bf16 halve the bytes sent,
    powersgd sends a rank-``powersgd_rank`` approximation (with error feedback), and auto times
    none, fp16, (bf16,) powersgd on the first steps of this run and keeps the fastest
    (:mod:`phalanx.runtime.compression`; ``trial`` sets how long it measures). What was chosen,
    and the checkpointable compression state: :func:`compression_of`.
    """
    if compression not in COMPRESSIONS:
        raise SettingsRefused(
            f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}", hint="pick one of those"
        )
    if compression == "bf16" and context.is_distributed and not bf16_supported(context):
        raise SettingsRefused(
            f"compression bf16 on the {context.backend} backend ({context.device.type})",
            "torch's bf16 hook needs NCCL 2.10+ on CUDA 11+ (or XCCL on XPU); gloo cannot reduce bf16 gradients.",
            "use --compression fp16 (same bytes on the wire) or powersgd on gloo",
        )
    if powersgd_rank < 1:
        raise SettingsRefused(f"powersgd rank {powersgd_rank}", "PowerSGD sends a rank-r approximation, r >= 1",
                              "use 1 (the default) to 4")  # fmt: skip
    model = model.to(context.device)
    if context.healing is not None:  # only the healing hook talks across ranks
        if compression != "none":
            raise SettingsRefused(f"compression {compression!r} in heal mode",
                                  "healing sends the gradients through its own all-reduce, uncompressed so far",
                                  "use compression none with --heal")  # fmt: skip
        ddp = context.healing.wrap(model)
        setattr(ddp, _ATTRIBUTE, GradientCompression("none", context, []))
        return ddp
    if not context.is_distributed:
        setattr(model, _ATTRIBUTE, GradientCompression(compression, context, []))  # one process: nothing is sent
        return model
    ddp = DistributedDataParallel(model, device_ids=[context.local_rank] if context.device.type == "cuda" else None)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    if compression == "auto":
        chosen = GradientCompression("auto", context, [make_candidate(n, names, powersgd_rank) for n in auto_candidates(context)],
                                     trial or AutoTrial())  # fmt: skip
    elif compression == "none":  # DDP's own all-reduce, in C++: no hook at all
        chosen = GradientCompression("none", context, [])
    else:
        chosen = GradientCompression(compression, context, [make_candidate(compression, names, powersgd_rank)])
    chosen.register(ddp)
    settle_before_first_step(ddp, chosen.plain_reduction)
    setattr(ddp, _ATTRIBUTE, chosen)
    return ddp


def compression_of(model: torch.nn.Module) -> GradientCompression:
    """The gradient compression of a model from :func:`wrap_model`: ``.chosen``, ``.timings_ms``,
    ``.summary()`` for metrics, ``.state_dict()`` / ``.load_state_dict()`` for checkpoints."""
    found = getattr(model, _ATTRIBUTE, None)
    if found is None:
        raise ValueError(
            "this model did not come from phalanx.runtime.model.wrap_model, so phalanx chose no compression for it"
        )
    return found


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP's wrapper, or ``model`` itself when it is not wrapped."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def parameters_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the float32 bytes of every parameter, in state_dict order."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in unwrap(model).state_dict().values():
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
