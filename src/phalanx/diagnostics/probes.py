"""The measurements `phalanx doctor` makes on the job's process group, each a collective call.

Pairwise probes run between the lead ranks of two nodes (the lowest rank on each) while every
other rank waits at a barrier, so that one pair's traffic never disturbs another's figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.bench.device_sync import barrier, synchronize

#: Round trips per clock and latency figure.
ROUNDS = 8
#: Transfers per bandwidth figure.
TRANSFERS = 3


@dataclass(frozen=True)
class ClockOffset:
    rank: int
    offset_s: float  # this rank's wall clock minus rank 0's
    round_trip_s: float


@dataclass(frozen=True)
class LinkFigure:
    source: int  # global ranks: the leads of the two nodes
    target: int
    latency_s: float  # half the median round trip of a one-element message
    bandwidth_bytes_per_s: float | None  # None: the transfer was too short to time (a noisy host)


@dataclass(frozen=True)
class ComputeFigure:
    rank: int
    gflops: float
    matrix: int


def one_way(round_trips: list[float], transfers: list[float], message_bytes: int) -> tuple[float, float | None]:
    """Latency (half the median round trip) and one-way bandwidth, from round trips of a small
    message and transfers of ``message_bytes`` each answered by a small reply; the bandwidth is
    None where a transfer took no longer than a small message's way: it was not measured."""
    round_trip = statistics.median(round_trips)
    transfer = statistics.median(transfers) - round_trip / 2  # less the reply's way back
    return round_trip / 2, message_bytes / transfer if transfer > round_trip / 2 else None


class Probe:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = dist.get_rank()

    def clock_offsets(self, leads: list[int]) -> list[ClockOffset]:
        """Each node lead's clock against rank 0's, from the round trip least delayed (as NTP does)."""
        found: list[ClockOffset] = []
        stamp = torch.zeros(1, dtype=torch.float64, device=self.device)
        for lead in leads:
            if lead == 0:
                continue
            if self.rank == lead:
                trials = []  # (rank 0's clock minus ours, round trip)
                for _ in range(ROUNDS):
                    sent = time.time()
                    dist.send(stamp, dst=0)
                    dist.recv(stamp, src=0)
                    synchronize(self.device)
                    received = time.time()
                    trials.append((stamp.item() - (sent + received) / 2, received - sent))
                behind, round_trip = min(trials, key=lambda trial: trial[1])
                found.append(ClockOffset(lead, -behind, round_trip))
            elif self.rank == 0:
                for _ in range(ROUNDS):
                    dist.recv(stamp, src=lead)
                    synchronize(self.device)  # on NCCL the receive is only queued until here
                    stamp.fill_(time.time())
                    dist.send(stamp, dst=lead)
            barrier(self.device)
        return found

    def link(self, source: int, target: int, message_bytes: int) -> LinkFigure | None:
        """Latency and one-way bandwidth from ``source`` to ``target``; the figure is on ``source``."""
        if self.rank not in (source, target):
            barrier(self.device)
            return None
        peer = target if self.rank == source else source
        small = torch.zeros(1, device=self.device)
        large = torch.zeros(max(1, message_bytes // 4), device=self.device)
        round_trips = [self._exchange(small, small, peer) for _ in range(ROUNDS)]
        transfers = [self._exchange(large, small, peer) for _ in range(TRANSFERS)]
        barrier(self.device)
        if self.rank != source:
            return None
        return LinkFigure(source, target, *one_way(round_trips, transfers, large.numel() * 4))

    def _exchange(self, outbound: torch.Tensor, reply: torch.Tensor, peer: int) -> float:
        """Seconds for ``outbound`` to go one way and ``reply`` to come back (the lower rank sends)."""
        started = time.perf_counter()
        if self.rank < peer:
            dist.send(outbound, dst=peer)
            dist.recv(reply, src=peer)
        else:
            dist.recv(outbound, src=peer)
            dist.send(reply, dst=peer)
        synchronize(self.device)
        return time.perf_counter() - started

    def compute(self, seconds: float = 0.3) -> ComputeFigure:
        """A fixed float32 matmul on every rank at once: the GFLOP/s this rank sustains."""
        size = 4096 if self.device.type == "cuda" else 512
        a = torch.randn(size, size, device=self.device)
        b = torch.randn(size, size, device=self.device)
        torch.mm(a, b)  # first call: allocation and kernel selection
        barrier(self.device)
        calls, started = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            calls += 1
            synchronize(self.device)
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
        return ComputeFigure(self.rank, 2 * size**3 * calls / elapsed / 1e9, size)
