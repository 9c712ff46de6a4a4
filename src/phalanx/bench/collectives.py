"""The collectives `phalanx bench collectives` measures, with nccl-tests' definitions.

Pure arithmetic, no torch: how a row's size becomes element counts, which bytes the algorithm
bandwidth counts, and the factor that turns it into bus bandwidth, as nccl-tests (src/*.cu and
doc/PERFORMANCE.md) defines them, so that the figures compare with its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Counts:
    send: int  # elements in this rank's input
    recv: int  # elements in this rank's output
    param: int  # the count argument of the call, as nccl-tests prints it

    def size_bytes(self, element_size: int) -> int:
        return max(self.send, self.recv) * element_size


@dataclass(frozen=True)
class Collective:
    name: str
    counts: Callable[[int, int], Counts]  # (elements in the row's size, ranks) -> counts
    moved_per_param: Callable[[int], int]  # ranks -> how many times the count the algbw counts
    bus_factor: Callable[[int], float]
    reduces: bool = False  # takes a reduction op (the redop column)
    rooted: bool = False  # has a root rank (the root column)
    # torch.distributed has no out-of-place all_reduce or broadcast, and no in-place all_to_all
    out_of_place: bool = True
    in_place: bool = True
    uses_send: bool = True  # False: works in the receive buffer alone

    def algbw_bytes(self, counts: Counts, element_size: int, ranks: int) -> int:
        return counts.param * element_size * self.moved_per_param(ranks)


def _whole(count: int, ranks: int) -> Counts:
    return Counts(count, count, count)


def _ring(ranks: int) -> float:
    return (ranks - 1) / ranks


COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective(
            "all_reduce",
            _whole,
            lambda n: 1,
            lambda n: 2 * (n - 1) / n,
            reduces=True,
            out_of_place=False,
            uses_send=False,
        ),
        Collective("all_gather", lambda c, n: Counts(c // n, (c // n) * n, c // n), lambda n: n, _ring),
        Collective(
            "reduce_scatter", lambda c, n: Counts((c // n) * n, c // n, c // n), lambda n: n, _ring, reduces=True
        ),
        Collective("broadcast", _whole, lambda n: 1, lambda n: 1.0, rooted=True, out_of_place=False, uses_send=False),
        Collective(
            "all_to_all", lambda c, n: Counts((c // n) * n, (c // n) * n, c // n), lambda n: n, _ring, in_place=False
        ),
    )
}

#: nccl-tests' type names, with the torch dtype each stands for and its size in bytes.
DTYPES: dict[str, tuple[str, int]] = {
    "int8": ("int8", 1),
    "uint8": ("uint8", 1),
    "int32": ("int32", 4),
    "uint32": ("uint32", 4),
    "int64": ("int64", 8),
    "uint64": ("uint64", 8),
    "half": ("float16", 2),
    "float": ("float32", 4),
    "double": ("float64", 8),
    "bfloat16": ("bfloat16", 2),
}
DTYPE_ALIASES = {"float16": "half", "fp16": "half", "float32": "float", "fp32": "float", "float64": "double",
                 "fp64": "double", "bf16": "bfloat16"}  # fmt: skip
INTEGER_DTYPES = frozenset({"int8", "uint8", "int32", "uint32", "int64", "uint64"})

#: nccl-tests' reduction op names (-o), with torch's ReduceOp member for each.
REDUCE_OPS: dict[str, str] = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG"}

#: -a: how the per-rank times of one row are combined, as nccl-tests' --average.
AVERAGE_MODES = {0: "rank 0", 1: "mean over ranks", 2: "min over ranks", 3: "max over ranks"}


def sizes(min_bytes: int, max_bytes: int, step_factor: int, step_bytes: int) -> list[int]:
    """The row sizes, as nccl-tests walks them: times the factor if above 1, else plus the step."""
    result, size = [], min_bytes
    while size <= max_bytes:
        result.append(size)
        size = size * step_factor if step_factor > 1 else size + step_bytes
    return result


def unsupported_reason(backend: str, collective: str, dtype: str, op: str) -> tuple[str, str] | None:
    """Why this backend cannot run the combination, and what to do (measured on torch 2.13 gloo)."""
    if backend != "gloo":
        return None
    if dtype in ("uint32", "uint64"):
        return (
            f"gloo cannot move {dtype} tensors (torch.distributed raises 'Invalid scalar type')",
            f"use -d {dtype[1:]} (the same bytes on the wire), or the nccl backend on GPUs",
        )
    if COLLECTIVES[collective].reduces and op == "avg" and dtype in INTEGER_DTYPES:
        return (
            f"gloo averages by dividing in floating point, which cannot be stored back into {dtype}",
            "use -o sum (the same traffic), or a floating-point type such as -d float",
        )
    return None


def canonical_name(text: str) -> str | None:
    """all_reduce, all-reduce or nccl-tests' allreduce / alltoall spelling -> the name used here."""
    wanted = text.strip().lower().replace("-", "").replace("_", "")
    return next((name for name in COLLECTIVES if name.replace("_", "") == wanted), None)
