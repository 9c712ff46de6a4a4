"""The state after the last completed step, sent from a surviving rank to the replacements.

The state is a nested structure of dicts, lists and tuples with tensors and plain values (what
a checkpoint holds). Its skeleton, with each tensor's shape and dtype in place of the tensor,
goes pickled (a peer of the same job sends it, as the store's keys come from one); the tensors go
packed, one flat buffer per dtype. Every rank of the group takes part; the source's state comes
back on each. The broadcasts are asynchronous and waited on through ``wait``, which a failure of
a peer ends (:meth:`.hook.StepHealth.wait`).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the skeleton: its dtype, shape and place in that dtype's buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def broadcast_state(state: dict[str, Any] | None, source: int, device: torch.device,
                    wait: Callable[[list[Any]], None]) -> tuple[dict[str, Any], int]:  # fmt: skip
    """Sends ``state`` from rank ``source`` to every rank of the current default group.

    Args:
        state: the state on the source (what :meth:`Run._state_of_step` built); ignored elsewhere.
        source: the sending rank.
        device: where the tensors travel and land (the rank's device).
        wait: waits for a list of asynchronous works (raises when a peer failed).

    Returns:
        The source's state on every rank (the source's own object on the source), and the bytes
        of tensors sent.
    """
    sending = dist.get_rank() == source
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors, {}) if sending else None
    pickled = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8) if sending else None
    size = torch.tensor([pickled.numel() if pickled is not None else 0], dtype=torch.int64, device=device)
    wait([dist.broadcast(size, src=source, async_op=True)])
    message = (
        pickled.to(device) if pickled is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    wait([dist.broadcast(message, src=source, async_op=True)])
    if not sending:
        skeleton = pickle.loads(message.cpu().numpy().tobytes())  # a peer of this job sent it
    buffers = _pack(tensors, device) if sending else {
        dtype: torch.empty(count, dtype=dtype, device=device) for dtype, count in _sizes(skeleton, {}).items()
    }  # fmt: skip
    wait([dist.broadcast(buffer, src=source, async_op=True) for buffer in buffers.values()])
    sent = sum(buffer.numel() * buffer.element_size() for buffer in buffers.values())
    return (state if sending else _fill(skeleton, buffers)), sent  # type: ignore[return-value]


def _strip(value: Any, tensors: list[torch.Tensor], offsets: dict[torch.dtype, int]) -> Any:
    """The skeleton of ``value``: each tensor replaced by its slot; the tensors appended in order."""
    if isinstance(value, torch.Tensor):
        offset = offsets.get(value.dtype, 0)
        offsets[value.dtype] = offset + value.numel()
        tensors.append(value)
        return _Slot(value.dtype, tuple(value.shape), offset)
    if isinstance(value, dict):
        return {key: _strip(item, tensors, offsets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        stripped = [_strip(item, tensors, offsets) for item in value]
        return stripped if isinstance(value, list) else tuple(stripped)
    return value


def _pack(tensors: list[torch.Tensor], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1).to(device))
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def _sizes(skeleton: Any, sizes: dict[torch.dtype, int]) -> dict[torch.dtype, int]:
    if isinstance(skeleton, _Slot):
        end = skeleton.offset + math.prod(skeleton.shape)
        sizes[skeleton.dtype] = max(sizes.get(skeleton.dtype, 0), end)
    elif isinstance(skeleton, dict):
        for item in skeleton.values():
            _sizes(item, sizes)
    elif isinstance(skeleton, (list, tuple)):
        for item in skeleton:
            _sizes(item, sizes)
    return sizes


def _fill(skeleton: Any, buffers: dict[torch.dtype, torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        flat = buffers[skeleton.dtype][skeleton.offset : skeleton.offset + math.prod(skeleton.shape)]
        return flat.view(skeleton.shape).clone()
    if isinstance(skeleton, dict):
        return {key: _fill(item, buffers) for key, item in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        filled = [_fill(item, buffers) for item in skeleton]
        return filled if isinstance(skeleton, list) else tuple(filled)
    return skeleton
