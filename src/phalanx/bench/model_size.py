"""How big the gradients are: a parameter count (``25M``, ``1.3B``) or a model built from its import path.

A count is enough for the uncompressed, fp16 and bf16 predictions; PowerSGD compresses each
parameter matrix by its own shape, so it needs the model itself (``package.module:factory``).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from phalanx.bench.link import UNIT_PREFIXES
from phalanx.errors import SettingsRefused
from phalanx.settings.values import InvalidValue

_COUNT = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([kKmMbBtT]?)$")
_COUNT_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]i?)B\s*$")
#: Far above any model trained today; beyond it a count is a typo (1e30), not a plan.
MAX_PARAMETERS = 10**15
_MODEL_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class ModelSize:
    """The trainable parameters DDP all-reduces: their count and, when known, their shapes."""

    parameters: int
    #: One shape per trainable parameter, in ``model.parameters()`` order; None for a bare count.
    shapes: tuple[tuple[int, ...], ...] | None
    #: How the user named it (``--params 25M``), for the output.
    origin: str
    #: Parameters with requires_grad=False: not all-reduced, reported so the count is not a surprise.
    frozen: int = 0

    def __post_init__(self) -> None:
        if self.parameters < 1:
            raise ValueError(f"a model needs at least 1 trainable parameter, not {self.parameters}")
        if self.shapes is not None and sum(math.prod(shape) for shape in self.shapes) != self.parameters:
            raise ValueError("the shapes do not add up to the parameter count")


def parse_param_count(value: object) -> int:
    """``25M`` -> 25_000_000; ``1.3B`` -> 1_300_000_000; ``124_439_808`` and ``124,439,808`` as written."""
    text = str(value).strip()
    hint = "write a parameter count: --params 124439808, --params 25M or --params 1.3B (K, M, B, T: powers of 1000)"
    byte_size = _BYTE_SIZE.match(text)
    if byte_size:
        size = float(byte_size.group(1)) * UNIT_PREFIXES[byte_size.group(2).lower()]
        raise InvalidValue(
            f"--params {text!r} is a size in bytes, not a number of parameters",
            f"fp32 gradients take 4 bytes a parameter: {text} is --params {_count_text(size / 4)}",
        )
    match = _COUNT.match(text.replace("_", "").replace(",", ""))
    if not match:
        raise InvalidValue(f"--params {text!r} is not a parameter count", hint)
    mantissa, exponent, suffix = match.groups()
    # exact arithmetic: 1.3B must be 1_300_000_000, not float's 1_299_999_999
    exact = Fraction(mantissa) * Fraction(10) ** int(exponent or 0) * _COUNT_SCALE[suffix.lower()]
    if exact.denominator != 1:
        raise InvalidValue(f"--params {text!r} is not a whole number of parameters", hint)
    if exact < 1:
        raise InvalidValue(f"--params {text!r}: a model needs at least 1 parameter", hint)
    if exact > MAX_PARAMETERS:
        raise InvalidValue(f"--params {text!r} is more than {_count_text(MAX_PARAMETERS)} parameters", hint)
    return int(exact)


def _count_text(count: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.4g}{suffix}"
    return f"{count:.0f}"


def size_from_count(text: str) -> ModelSize:
    return ModelSize(parse_param_count(text), None, f"--params {text}")


def size_from_model(path: str) -> ModelSize:
    """Imports ``package.module:factory`` from the current folder (as ``python -m`` would) and counts.

    A factory is called without arguments under torch's meta device, so a 70B model costs no
    memory; a factory that cannot build on the meta device is called again normally.
    """
    hint = "give --model package.module:factory (a callable returning an nn.Module) or package.module:attribute"
    if not _MODEL_PATH.match(path):
        raise SettingsRefused(
            f"--model {path!r} is not an import path with a ':'", hint=f"{hint}, e.g. --model mymodels:SimpleModel"
        )
    module_name, attribute = path.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # the user's module may fail in any way; say how
        raise SettingsRefused(
            f"--model {path}: importing {module_name} failed",
            f"{type(error).__name__}: {error}",
            f"{hint}; it is imported as python -m would, from the current folder ({os.getcwd()}) and sys.path",
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise SettingsRefused(f"--model {path}: {module_name} has no attribute {attribute!r}", hint=hint)
        target = getattr(target, part)
    model = _as_module(target, path, hint)
    return _measure(model, f"--model {path}")


def _as_module(target: Any, path: str, hint: str) -> Any:
    import torch

    if isinstance(target, torch.nn.Module):
        return target
    if not callable(target):
        raise SettingsRefused(
            f"--model {path} is of type {type(target).__name__}, neither an nn.Module nor callable", hint=hint
        )
    try:
        with torch.device("meta"):
            built = target()
    except Exception:  # some factories load weights or move tensors; build it for real then
        try:
            built = target()
        except Exception as error:
            raise SettingsRefused(
                f"--model {path}: calling it without arguments failed", f"{type(error).__name__}: {error}", hint
            ) from None
    if not isinstance(built, torch.nn.Module):
        raise SettingsRefused(f"--model {path}() returned a {type(built).__name__}, not an nn.Module", hint=hint)
    return built


def _measure(model: Any, origin: str) -> ModelSize:
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    frozen = sum(parameter.numel() for parameter in model.parameters() if not parameter.requires_grad)
    if not trainable:
        raise SettingsRefused(
            f"{origin} has no trainable parameters",
            "DDP all-reduces the gradients of parameters with requires_grad=True; this model has none.",
            "point --model at the model you train",
        )
    shapes = tuple(tuple(parameter.shape) for parameter in trainable)
    return ModelSize(sum(math.prod(shape) for shape in shapes), shapes, origin, frozen)
