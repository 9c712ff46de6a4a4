"""What `phalanx doctor` was asked to measure: typed, checked before any job starts."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.bench.collective_settings import CollectiveSettings
from phalanx.errors import SettingsRefused


@dataclass(frozen=True)
class DoctorSettings:
    p2p_bytes: int = 16 * 1024**2
    allreduce_min_bytes: int = 1024**2
    allreduce_max_bytes: int = 16 * 1024**2
    iters: int = 5

    def __post_init__(self) -> None:
        if self.p2p_bytes < 1024**2:
            raise SettingsRefused(
                f"--p2p-size {self.p2p_bytes}: below 1M a transfer is over before it can be timed",
                hint="give --p2p-size 1M or more (the default 16M suits 1-100 Gbit/s links)",
            )
        if self.allreduce_max_bytes < self.allreduce_min_bytes:
            raise SettingsRefused(
                f"--max-bytes {self.allreduce_max_bytes}: below the smallest all-reduce measured ({self.allreduce_min_bytes})",
                hint="give --max-bytes 1M or more",
            )

    def allreduce(self) -> CollectiveSettings:
        return CollectiveSettings(
            min_bytes=self.allreduce_min_bytes, max_bytes=self.allreduce_max_bytes, iters=self.iters, warmup_iters=1
        )
