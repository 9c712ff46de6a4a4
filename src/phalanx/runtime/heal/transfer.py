"""The state after the last completed step, sent from a surviving rank to the ranks that need it.

The skeleton goes pickled, the tensors packed in one CPU buffer per dtype, point to point to the
receivers only, over a group of its own (docs/runtime-design.md says why).
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


def send_state(state: dict[str, Any], receivers: list[int], wait: Callable[[list[Any]], None],
               group: dist.ProcessGroup) -> int:  # fmt: skip
    """Sends ``state`` to each of ``receivers`` (:func:`receive_state` on their side).

    Args:
        state: the state to send (what :meth:`Run._state_of_step` built, and more).
        receivers: the ranks that take it (global ranks: the group has every rank).
        wait: waits for a list of asynchronous works (raises when a peer failed).
        group: the group to send it over, of every rank (the generation's transfer group).

    Returns:
        The bytes of tensors in the state (sent to each receiver).
    """
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors, {})
    message = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    size = torch.tensor([message.numel()], dtype=torch.int64)
    buffers = list(_pack(tensors).values())
    wait([dist.isend(tensor, receiver, group) for receiver in receivers for tensor in (size, message, *buffers)])
    return sum(buffer.numel() * buffer.element_size() for buffer in buffers)


def receive_state(source: int, wait: Callable[[list[Any]], None], group: dist.ProcessGroup) -> dict[str, Any]:
    """The state that rank ``source`` sends with :func:`send_state`, its tensors in CPU memory.

    Args:
        source: the sending rank.
        wait: waits for a list of asynchronous works (raises when a peer failed).
        group: the group it comes over (as ``send_state``'s).
    """
    size = torch.zeros(1, dtype=torch.int64)
    wait([dist.irecv(size, source, group)])
    message = torch.empty(int(size.item()), dtype=torch.uint8)
    wait([dist.irecv(message, source, group)])
    skeleton = pickle.loads(message.numpy().tobytes())  # a peer of this job sent it
    buffers = {dtype: torch.empty(count, dtype=dtype) for dtype, count in _sizes(skeleton, {}).items()}
    wait([dist.irecv(buffer, source, group) for buffer in buffers.values()])
    return _fill(skeleton, buffers)


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


def _pack(tensors: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1).cpu())
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
