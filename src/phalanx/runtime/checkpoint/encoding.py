"""A nested training state as flat tensors plus a JSON skeleton: what DCP stores, safely.

torch.distributed.checkpoint stores tensors by key and pickles every other value, and unpickles
it on load (``weights_only=False``): a damaged or crafted checkpoint could run code. Here the
tensors go to DCP under path-like keys, and everything else (numbers, strings, lists, dicts with
int keys, as optimizers have) becomes one JSON document, stored as a uint8 tensor beside them.
Loading parses JSON: nothing in a checkpoint can run code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

#: A tensor's place in the skeleton: {"t": key}.
_TENSOR, _TUPLE, _ITEMS = "t", "tuple", "items"


class NotStorable(TypeError):
    """A value in a checkpoint state that is neither a tensor nor a plain value."""


def flatten(state: Any, prefix: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``state`` as ({key: tensor}, skeleton): the keys start with ``prefix``, the skeleton is
    the rest of the state as UTF-8 JSON in a uint8 tensor.

    Raises:
        NotStorable: a value that is not a tensor, None, bool, int, float, str, list, tuple or
            dict (with str, int, float or bool keys); the message gives its path.
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, prefix, tensors)
    text = json.dumps(skeleton, separators=(",", ":"))
    return tensors, torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def unflatten(skeleton: torch.Tensor, tensor: Callable[[str], torch.Tensor]) -> Any:
    """The state :func:`flatten` took apart; ``tensor(key)`` gives each tensor back."""
    return _decode(json.loads(bytes(skeleton.numpy()).decode()), tensor)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if path in tensors:  # keys 1 and "1" of one dict, or {"a": {"b": t}} beside "a/b"
            raise NotStorable(f"{path}: two tensors of the state would be stored under this one path; rename a key")
        tensors[path] = value
        return {_TENSOR: path}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int, float, bool)):
                raise NotStorable(
                    f"{path}: a key of type {type(key).__name__} ({key!r}); checkpoint keys are str or int"
                )
        return {_ITEMS: [[key, _encode(item, f"{path}/{key}", tensors)] for key, item in value.items()]}
    raise NotStorable(f"{path}: a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds tensors "
                      "and plain values (numbers, strings, lists, dicts), so that loading one cannot run code")  # fmt: skip


def _decode(value: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensor) for item in value]
    if isinstance(value, dict):
        if _TENSOR in value:
            return tensor(value[_TENSOR])
        if _TUPLE in value:
            return tuple(_decode(item, tensor) for item in value[_TUPLE])
        return {key: _decode(item, tensor) for key, item in value[_ITEMS]}
    return value
