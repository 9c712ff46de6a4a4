"""Measures collectives on the job's process group the way nccl-tests does.

Per row: one call to settle, a barrier, ``iters`` calls timed back to back, the per-call time
combined over the ranks as ``-a`` says, then ``check`` calls on fresh data compared element by
element with the values every rank can compute by itself.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.bench.collective_settings import CollectiveSettings
from phalanx.bench.collectives import COLLECTIVES, DTYPES, REDUCE_OPS, Collective, Counts
from phalanx.bench.device_sync import barrier, synchronize

# torch 2.13 renamed the tensor forms of all_gather and reduce_scatter; older releases have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Measurement:
    time_us: float
    algbw: float  # GB/s, 1e9 bytes
    busbw: float  # GB/s
    wrong: int | None  # None when not checked (-c 0)


@dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    out_of_place: Measurement | None
    in_place: Measurement | None


def _combine(parts: list[torch.Tensor], op: str, ranks: int) -> torch.Tensor:
    """The exact result, in int64 (integer types) or float64: cast to the type it is what a
    correct backend returns, as long as sums stay within the type's exact integers."""
    if op == "avg":
        return torch.stack([p.double() for p in parts]).sum(0) / ranks
    combine = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[op]
    return functools.reduce(combine, parts)


def _count_wrong(result: torch.Tensor, exact: torch.Tensor, op: str, ranks: int) -> int:
    """Elements of ``result`` that differ from the exact result cast to the result's type."""
    floating = result.dtype.is_floating_point
    wide = torch.float64 if floating else torch.int64
    expected = exact.to(result.dtype).to(wide)  # integer types wrap around here as the backend does
    got = result.to(wide)
    if not floating:
        return int((got != expected).sum())
    info = torch.finfo(result.dtype)
    largest_exact = 2 / info.eps  # 2^(mantissa bits + 1): every integer up to it is a float of this type
    exact_enough = (op == "sum" and 5 * ranks <= largest_exact) or op in ("prod", "max", "min")
    if exact_enough:
        return int((got != expected).sum())
    # avg (NCCL scales each input by 1/n before summing), or sums past the exact integers:
    # each of the n additions or scalings may round once
    return int((~torch.isclose(got, expected, rtol=(ranks + 1) * info.eps, atol=0.0)).sum())


def _pattern(rank: int, start: int, length: int, rep: int, op: str, device: torch.device) -> torch.Tensor:
    """Small integers every rank can recompute (1..5, or 1..2 for prod): a 32-bit hash of
    (position, rank, repetition), so that no two ranks' chunks, nor two checks, hold the same."""
    index = torch.arange(start, start + length, dtype=torch.int64, device=device)
    mixed = (index + rank * 1_000_003 + rep * 7_777_777) & 0x7FFFFFFF
    for multiplier, shift in ((0x9E3779B1, 15), (0x85EBCA77, 13)):
        mixed = (mixed * multiplier) & 0xFFFFFFFF
        mixed = mixed ^ (mixed >> shift)
    return mixed % (2 if op == "prod" else 5) + 1


class CollectiveBench:
    """One collective at every size of the settings, on this rank; a collective call itself."""

    def __init__(self, settings: CollectiveSettings, name: str, device: torch.device) -> None:
        self.settings = settings
        self.collective: Collective = COLLECTIVES[name]
        self.device = device
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        torch_name, self.element_size = DTYPES[settings.dtype]
        self.dtype = getattr(torch, torch_name)
        self.reduce_op = getattr(dist.ReduceOp, REDUCE_OPS[settings.op])
        # allocated once at the largest size and viewed per row, as nccl-tests does
        largest = self.collective.counts(settings.max_bytes // self.element_size, self.ranks)
        send_size = max(largest.send, 1) if self.collective.uses_send else 1
        self.send = torch.zeros(send_size, dtype=self.dtype, device=device)
        self.recv = torch.zeros(max(largest.recv, 1), dtype=self.dtype, device=device)
        self._reps = itertools.count(1)  # fresh data for every check, as nccl-tests

    def rows(self, measured: Callable[[Row], None] | None = None) -> list[Row]:
        """Every size's row; ``measured`` is called with each as soon as it is measured."""
        self._warm_up()
        rows = []
        for size in self.settings.sizes:
            counts = self.collective.counts(size // self.element_size, self.ranks)
            if counts.param == 0:
                continue  # fewer elements than ranks: nothing to move
            variants = {
                in_place: self._measure(counts, in_place) if allowed else None
                for in_place, allowed in ((False, self.collective.out_of_place), (True, self.collective.in_place))
            }
            rows.append(Row(counts.size_bytes(self.element_size), counts.param, variants[False], variants[True]))
            if measured is not None:
                measured(rows[-1])
        return rows

    def _call(self, counts: Counts, in_place: bool) -> torch.Tensor:
        """Runs the collective once; returns this rank's output view."""
        send, recv = self.send[: counts.send], self.recv[: counts.recv]
        name, rank = self.collective.name, self.rank
        if name == "all_reduce":
            dist.all_reduce(recv, op=self.reduce_op)
            return recv
        if name == "broadcast":
            dist.broadcast(recv, src=self.settings.root)
            return recv
        if name == "all_gather":
            source = recv[rank * counts.send : (rank + 1) * counts.send] if in_place else send
            _all_gather(recv, source)
            return recv
        if name == "reduce_scatter":
            output = send[rank * counts.recv : (rank + 1) * counts.recv] if in_place else recv
            _reduce_scatter(output, send, op=self.reduce_op)
            return output
        dist.all_to_all_single(recv, send)
        return recv

    def _warm_up(self) -> None:
        """As nccl-tests: -w calls at the largest size, then -w at the smallest."""
        for size in (self.settings.max_bytes, self.settings.min_bytes):
            counts = self.collective.counts(size // self.element_size, self.ranks)
            if counts.param:
                for _ in range(self.settings.warmup_iters):
                    self._call(counts, in_place=not self.collective.out_of_place)
        synchronize(self.device)

    def _measure(self, counts: Counts, in_place: bool) -> Measurement:
        settings = self.settings
        if settings.check:
            self._fill_inputs(counts, in_place, rep=next(self._reps))
        self._call(counts, in_place)
        barrier(self.device)
        started = time.perf_counter()
        for _ in range(settings.iters):
            self._call(counts, in_place)
        synchronize(self.device)
        seconds = self._combine_over_ranks((time.perf_counter() - started) / settings.iters)
        algbw = self.collective.algbw_bytes(counts, self.element_size, self.ranks) / 1e9 / seconds
        wrong = self._check(counts, in_place) if settings.check else None
        return Measurement(seconds * 1e6, algbw, algbw * self.collective.bus_factor(self.ranks), wrong)

    def _combine_over_ranks(self, seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        mode = self.settings.average
        if mode == 0:
            dist.broadcast(value, src=0)
        else:
            dist.all_reduce(value, op={1: dist.ReduceOp.SUM, 2: dist.ReduceOp.MIN, 3: dist.ReduceOp.MAX}[mode])
        return value.item() / (self.ranks if mode == 1 else 1)

    def _input(self, rank: int, start: int, length: int, rep: int) -> torch.Tensor:
        return _pattern(rank, start, length, rep, self.settings.op, self.device)

    def _fill_inputs(self, counts: Counts, in_place: bool, rep: int) -> None:
        self.send.zero_()
        self.recv.zero_()
        name, rank = self.collective.name, self.rank
        if name == "all_reduce":  # in-place only: the input is the output buffer
            self.recv[: counts.recv] = self._input(rank, 0, counts.recv, rep)
        elif name == "broadcast":  # the others keep zeros, which the pattern never holds
            if rank == self.settings.root:
                self.recv[: counts.recv] = self._input(rank, 0, counts.recv, rep)
        elif name == "all_gather":
            target = self.recv[rank * counts.send : (rank + 1) * counts.send] if in_place else self.send[: counts.send]
            target.copy_(self._input(rank, rank * counts.send, counts.send, rep))
        else:  # reduce_scatter, all_to_all: the whole send buffer
            self.send[: counts.send] = self._input(rank, 0, counts.send, rep)

    def _expected(self, counts: Counts, rep: int) -> torch.Tensor:
        name, rank, ranks = self.collective.name, self.rank, self.ranks
        if name == "all_reduce":
            return _combine([self._input(r, 0, counts.recv, rep) for r in range(ranks)], self.settings.op, ranks)
        if name == "broadcast":
            return self._input(self.settings.root, 0, counts.recv, rep)
        if name == "all_gather":
            return torch.cat([self._input(r, r * counts.send, counts.send, rep) for r in range(ranks)])
        if name == "reduce_scatter":
            parts = [self._input(r, rank * counts.recv, counts.recv, rep) for r in range(ranks)]
            return _combine(parts, self.settings.op, ranks)
        chunk = counts.param  # all_to_all: chunk `rank` of every rank's input, in rank order
        return torch.cat([self._input(r, rank * chunk, chunk, rep) for r in range(ranks)])

    def _check(self, counts: Counts, in_place: bool) -> int:
        wrong = 0
        for _ in range(self.settings.check):
            rep = next(self._reps)
            self._fill_inputs(counts, in_place, rep)
            output = self._call(counts, in_place)
            synchronize(self.device)
            if self.settings.corrupt and self.rank == 0:
                altered = output[: self.settings.corrupt]
                altered.copy_(altered.to(torch.float64) + 1)
            mine = _count_wrong(output, self._expected(counts, rep), self.settings.op, self.ranks)
            total = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(total)
            wrong = int(total.item())
            if wrong:
                break
        return wrong
