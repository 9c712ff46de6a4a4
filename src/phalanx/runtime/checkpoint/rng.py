"""Every random number generator a training step may draw from: saved and restored per rank, or
seeded from the step alone, so that any process can rebuild the state of a rank that is gone."""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, Python's random, numpy's global one when loaded),
    as tensors and plain values that a checkpoint stores."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():  # this process's own GPU only: after a restart it may see others
        state["cuda"] = torch.cuda.get_rng_state()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Sets the RNG states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seeds every generator :func:`rng_state` covers from (``seed``, ``rank``, ``step``) alone.

    A run that calls it after each step draws the same numbers as any process that calls it
    with the same three values: a restart rebuilds the random state of a rank that died.
    """
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little") >> 1  # torch takes up to 2**64 - 1, numpy 2**32 - 1
    # Only the generators rng_state() covers, the CPU's and this GPU's (torch.manual_seed would seed every device's).
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % 2**32)
