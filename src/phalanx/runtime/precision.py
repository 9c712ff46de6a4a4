"""Mixed precision as a thin layer over ``torch.autocast``: fp32, bf16 or fp16 by name.

bf16 keeps fp32's exponent range and needs no loss scaling; fp16 needs a GradScaler against
gradient underflow and is offered on CUDA only. The weights and the optimizer stay fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.errors import SettingsRefused

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # holds no state: entered every step


@dataclass
class MixedPrecision:
    """Mixed precision by name over ``torch.autocast``: fp32, bf16, or fp16 with a GradScaler.

    What the device cannot run is refused when it is made, before the first step, with
    what to use instead; the weights and the optimizer stay fp32. Checkpoint it with the
    rest (``run.track(precision=precision)``): a resume keeps fp16's loss scale.

    Args:
        name: fp32, bf16 or fp16 (fp16 on CUDA only).
        device: the device the model runs on (``run.device``).

    Raises:
        SettingsRefused: an unknown name, or a precision the device cannot run.

    Example::

        precision = phalanx.MixedPrecision("bf16", run.device)
        with precision.autocast():
            loss = F.cross_entropy(model(inputs), labels)
        precision.backward(loss)
        precision.unscale(optimizer)  # only before clipping; a no-op unless fp16
        precision.step(optimizer)
        optimizer.zero_grad()
    """

    name: str
    device: torch.device
    scaler: Any = field(default=None, init=False, repr=False)  # torch.amp.GradScaler with fp16

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.name not in PRECISIONS:
            raise SettingsRefused(
                f"precision {self.name!r} is not one of {', '.join(PRECISIONS)}", hint="pick one of those"
            )
        problem = unsupported(self.name, self.device)
        if problem:
            why, hint = problem
            raise SettingsRefused(f"precision {self.name} on device {self.device}", why, hint)
        if self.name == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass (and the loss) run inside; backward runs outside it.

        Returns:
            A context manager (autocast to bf16 or fp16; nothing with fp32).
        """
        if self.name == "fp32":
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=_DTYPES[self.name])

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """``loss.backward()``, of ``loss x scale`` (an accumulation window's ``micro.loss_scale``)
        and scaled by the GradScaler with fp16. A scale of 1 adds no operation to the graph.

        Args:
            loss: the loss to differentiate.
            scale: a factor for the loss (1: none).
        """
        if scale != 1.0:
            loss = loss * scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Brings fp16-scaled gradients back to their true size, so clipping sees the real norm.

        Args:
            optimizer: the optimizer whose gradients are unscaled (once per step).
        """
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(); with fp16 the scaler skips steps whose gradients overflowed.

        Args:
            optimizer: the optimizer to step.
        """
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty without one), for the checkpoint: resume keeps the scale."""
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the scaler's state that :meth:`state_dict` saved (nothing without a scaler).

        Args:
            state: what :meth:`state_dict` returned.
        """
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def unsupported(name: str, device: torch.device) -> tuple[str, str] | None:
    """(why, hint) when ``device`` cannot run precision ``name``, else None."""
    if name == "fp32":
        return None
    if name == "fp16" and device.type != "cuda":
        return (
            "fp16 training needs a GradScaler against gradient underflow, which phalanx offers on CUDA only",
            "use precision bf16 (CPU autocast supports it, no loss scaling needed) or fp32",
        )
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (
            f"this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support (it needs compute capability 8.0+)",
            "use precision fp16 (autocast with a GradScaler) or fp32",
        )
    if device.type not in ("cpu", "cuda"):
        return (f"phalanx offers mixed precision on cpu and cuda, not on {device.type}", "use precision fp32")
    return None
