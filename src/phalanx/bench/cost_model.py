"""The ring model of DDP's gradient all-reduce: what one training step sends, and how long it takes.

A step of k all-reduces, S bytes in all, over a ring of n ranks whose slowest link carries B
bytes/s with a latency L per message, takes :data:`FORMULA`; compression changes S and k
(docs/diagnostics-design.md derives both). Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.bench.link import Link
from phalanx.bench.model_size import ModelSize

#: The names of phalanx.runtime.model.COMPRESSIONS (not imported: that module loads torch).
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
FP32_BYTES = 4
HALF_BYTES = 2
#: DDP's defaults: the first bucket closes at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), the others at bucket_cap_mb=25.
DDP_FIRST_BUCKET_BYTES = 1024**2
DDP_BUCKET_BYTES = 25 * 1024**2
#: torch's PowerSGDState(min_compression_rate=2): compress a matrix only if that at least halves it.
POWERSGD_MIN_COMPRESSION_RATE = 2
#: PowerSGD's all-reduces per bucket: the uncompressed tensors, then P, then Q.
POWERSGD_ALLREDUCES_PER_BUCKET = 3

FORMULA = "t = 2(n-1)/n x S / B + k x 2(n-1) x L"
FORMULA_LEGEND = "n ranks, S bytes all-reduced a step, B bytes/s of the slowest link, k all-reduces a step, L latency"


@dataclass(frozen=True)
class Layout:
    """The job's shape, in torchrun's words: --nnodes x --nproc-per-node."""

    nnodes: int
    nproc_per_node: int

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"a layout needs at least 1 node and 1 process, not {self.nnodes} x {self.nproc_per_node}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def rank_table_rows(layout: Layout) -> list[dict[str, Any]]:
    """The tutorial's table for this layout (torchrun numbers ranks node by node), as rows for
    :func:`phalanx.launch.rank_table.format_rank_table`."""
    per_node = layout.nproc_per_node
    return [
        {
            "node": node,
            "nodes": layout.nnodes,
            "world_size": layout.world_size,
            "attempt": 0,
            "label": f"node{node}",
            "address": "<its address>",
            "ranks": list(range(node * per_node, (node + 1) * per_node)),
            "local_ranks": list(range(per_node)),
        }
        for node in range(layout.nnodes)
    ]


@dataclass(frozen=True)
class Traffic:
    """What one training step all-reduces with one compression."""

    #: Bytes all-reduced a step, summed over its all-reduces (S in the formula).
    bytes: int
    #: All-reduces a step (k in the formula).
    allreduces: int
    #: PowerSGD only: how many gradient tensors it compresses, of how many.
    compressed_tensors: int | None = None
    tensors: int | None = None

    def sent_per_rank(self, ranks: int) -> float:
        """Bytes each rank sends (and receives) over the ring: 2(n-1)/n x S."""
        return 2 * (ranks - 1) / ranks * self.bytes


def ring_allreduce_seconds(payload_bytes: float, ranks: int, link: Link, allreduces: int = 1) -> float:
    """The ring model: 2(n-1)/n x S / B + k x 2(n-1) x L; zero for one rank (nothing to exchange)."""
    if ranks < 1 or allreduces < 0:
        raise ValueError(f"ranks must be at least 1 and all-reduces not negative, not {ranks} and {allreduces}")
    if ranks == 1:
        return 0.0
    return (
        2 * (ranks - 1) / ranks * payload_bytes / link.bandwidth_bytes_per_s
        + allreduces * 2 * (ranks - 1) * link.latency_s
    )


def ddp_bucket_count(size: ModelSize) -> int:
    """How many buckets (all-reduces) DDP makes of the fp32 gradients, with its default caps.

    DDP fills buckets in reverse parameter order and closes one when it reaches its cap, so a
    parameter bigger than the cap travels alone. With a bare count, parameters are taken to be
    small next to the cap.
    """
    if size.shapes is None:
        total = size.parameters * FP32_BYTES
        return 1 + max(0, math.ceil((total - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES))
    buckets, filled, cap = 0, 0, DDP_FIRST_BUCKET_BYTES
    for shape in reversed(size.shapes):
        filled += math.prod(shape) * FP32_BYTES
        if filled >= cap:
            buckets, filled, cap = buckets + 1, 0, DDP_BUCKET_BYTES
    return buckets + (1 if filled else 0)


def powersgd_elements(shape: Sequence[int], rank: int) -> tuple[int, bool]:
    """(elements sent, compressed?) for one gradient, by torch's powerSGD_hook rule: the gradient
    viewed as shape[0] x (the rest), the rank clipped to both sides; a 1-D tensor never compresses.
    """
    numel = math.prod(shape)
    if len(shape) == 0 or numel == 0:
        return numel, False
    rows = shape[0]
    cols = numel // rows
    clipped = min(rows, cols, rank)
    factors = (rows + cols) * clipped
    if factors * POWERSGD_MIN_COMPRESSION_RATE < numel:
        return factors, True
    return numel, False


def traffic(compression: str, size: ModelSize, powersgd_rank: int = 1) -> Traffic | None:
    """Bytes and all-reduces a step; None for powersgd without the shapes (a count cannot say)."""
    buckets = ddp_bucket_count(size)
    if compression == "none":
        return Traffic(size.parameters * FP32_BYTES, buckets)
    if compression in ("fp16", "bf16"):
        return Traffic(size.parameters * HALF_BYTES, buckets)
    if compression != "powersgd":
        raise ValueError(f"unknown compression {compression!r}; known: {', '.join(COMPRESSIONS)}")
    if powersgd_rank < 1:
        raise ValueError(f"the PowerSGD rank must be at least 1, not {powersgd_rank}")
    if size.shapes is None:
        return None
    sent = [powersgd_elements(shape, powersgd_rank) for shape in size.shapes]
    return Traffic(
        sum(elements for elements, _ in sent) * FP32_BYTES,
        buckets * POWERSGD_ALLREDUCES_PER_BUCKET,
        compressed_tensors=sum(1 for _, compressed in sent if compressed),
        tensors=len(sent),
    )


@dataclass(frozen=True)
class RingBound:
    """The link that bounds the ring, and why that one."""

    link: Link
    reason: str


def ring_bound(layout: Layout, network: Link | None, intra_node: Link | None) -> RingBound | None:
    """Which link the ring's time is bounded by; None when no link was given that can say.

    A ring over all n = N x P ranks, ordered node by node, crosses every node's network link
    once each way, carrying the same 2(n-1)/n x S as every other link: the slowest link bounds it.
    """
    if layout.nnodes > 1:
        if network is None:
            raise ValueError("a layout of several nodes needs the network link")
        if intra_node is not None and intra_node.bandwidth_bytes_per_s < network.bandwidth_bytes_per_s:
            slowest = Link(
                intra_node.bandwidth_bytes_per_s, network.latency_s, intra_node.bandwidth_origin, network.latency_origin
            )
            return RingBound(
                slowest, "the intra-node link given is slower than the network, and the ring crosses it on every node"
            )
        return RingBound(
            network, f"the ring crosses the network between the {layout.nnodes} nodes; the slowest link bounds it"
        )
    if intra_node is None:
        return None
    return RingBound(intra_node, "one node: no network; the intra-node transport (shared memory, NVLink, PCIe) decides")


@dataclass(frozen=True)
class Row:
    """One compression's prediction; traffic and seconds are None where the model cannot say."""

    compression: str
    label: str
    traffic: Traffic | None
    seconds: float | None
    speedup: float | None
    ratio: float | None
    note: str


@dataclass(frozen=True)
class Prediction:
    size: ModelSize
    layout: Layout
    bound: RingBound | None
    powersgd_rank: int
    rows: tuple[Row, ...]

    @property
    def fastest(self) -> list[Row]:
        """The rows with the least predicted time (fp16 and bf16 tie), or [] when none has a time."""
        timed = [row for row in self.rows if row.seconds is not None]
        best = min((row.seconds for row in timed), default=0.0)
        return [row for row in timed if math.isclose(row.seconds, best, rel_tol=1e-9)]


_NOTES = {
    "none": "fp32 gradients, 4 B a parameter",
    "fp16": "2 B a parameter",
    "bf16": "2 B a parameter; NCCL only (gloo refuses bf16)",
}


def predict(size: ModelSize, layout: Layout, bound: RingBound | None, powersgd_rank: int = 1) -> Prediction:
    ranks = layout.world_size
    plain = traffic("none", size)
    baseline_seconds = _seconds(plain, ranks, bound)
    rows = []
    for compression in COMPRESSIONS:
        sent = traffic(compression, size, powersgd_rank)
        seconds = _seconds(sent, ranks, bound)
        label = f"powersgd rank {powersgd_rank}" if compression == "powersgd" else compression
        rows.append(
            Row(
                compression,
                label,
                sent,
                seconds,
                speedup=baseline_seconds / seconds if seconds and baseline_seconds else None,
                ratio=plain.bytes / sent.bytes if sent and sent.bytes else None,
                note=_note(compression, sent),
            )
        )
    return Prediction(size, layout, bound, powersgd_rank, tuple(rows))


def _seconds(sent: Traffic | None, ranks: int, bound: RingBound | None) -> float | None:
    if sent is None:
        return None
    if ranks == 1:
        return 0.0
    if bound is None:
        return None
    return ring_allreduce_seconds(sent.bytes, ranks, bound.link, sent.allreduces)


def _note(compression: str, sent: Traffic | None) -> str:
    if compression != "powersgd":
        return _NOTES[compression]
    if sent is None:
        return "needs the model's shapes (--model)"
    return f"P and Q in fp32 for {sent.compressed_tensors} of {sent.tensors} tensors, the rest whole"
