"""What `phalanx bench collectives` was asked to measure: typed, checked before anything starts."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from phalanx.bench.collectives import (
    AVERAGE_MODES,
    COLLECTIVES,
    DTYPE_ALIASES,
    DTYPES,
    REDUCE_OPS,
    canonical_name,
    sizes,
    unsupported_reason,
)
from phalanx.errors import SettingsRefused

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str, flag: str) -> int:
    """nccl-tests' sizes: a number of bytes, or with K, M or G (powers of 1024): 8, 1K, 64M, 1G."""
    match = _SIZE.match(str(text))
    if not match:
        raise SettingsRefused(
            f"{flag} {text!r} is not a size",
            "sizes are bytes, optionally with K, M or G (powers of 1024), as in nccl-tests.",
            f"for example {flag} 8, {flag} 64K or {flag} 128M",
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_collectives(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return tuple(COLLECTIVES)
    parts = [part for part in text.split(",") if part.strip()]
    names = tuple(name for name in map(canonical_name, parts) if name)
    unknown = [part.strip() for part in parts if canonical_name(part) is None]
    if unknown or not names:
        raise SettingsRefused(
            f"--collective {text!r}: unknown collective {', '.join(unknown) or '(none given)'}",
            f"phalanx measures {', '.join(COLLECTIVES)}.",
            "give one or more of them, comma-separated, or all",
        )
    return names


def parse_dtype(text: str) -> str:
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise SettingsRefused(
            f"-d {text!r} is not a data type",
            f"nccl-tests' type names are {', '.join(DTYPES)} (float16, float32, float64 and bf16 work too).",
            "for example -d float (the default) or -d half",
        )
    return name


def parse_op(text: str) -> str:
    if text not in REDUCE_OPS:
        raise SettingsRefused(
            f"-o {text!r} is not a reduction op",
            f"the reductions are {', '.join(REDUCE_OPS)} (nccl-tests' -o); the collective is chosen with --collective.",
            "for example -o sum (the default)",
        )
    return text


@dataclass(frozen=True)
class CollectiveSettings:
    collectives: tuple[str, ...] = ("all_reduce",)
    min_bytes: int = 1024
    max_bytes: int = 64 * 1024**2
    step_factor: int = 4
    step_bytes: int = 1024**2
    iters: int = 20
    warmup_iters: int = 5
    check: int = 1
    dtype: str = "float"
    op: str = "sum"
    root: int = 0
    average: int = 1
    #: Elements rank 0 alters in its output before each check: proves the check counts them.
    corrupt: int = 0

    def __post_init__(self) -> None:
        if self.min_bytes > self.max_bytes:
            raise SettingsRefused(
                f"-b {self.min_bytes} is larger than -e {self.max_bytes}",
                "sizes run from -b (the smallest) up to -e (the largest).",
                "swap them, or give -b and -e the same value for one size",
            )
        if self.step_factor < 1 or (self.step_factor == 1 and self.step_bytes < 1):
            raise SettingsRefused(
                f"-f {self.step_factor} with -i {self.step_bytes}",
                "sizes grow by the factor -f when it is above 1, else by -i bytes; neither would grow.",
                "use -f 2 (double each time) or -f 1 -i BYTES",
            )
        if self.min_bytes == 0 and self.step_factor > 1:
            raise SettingsRefused("-b 0 with -f above 1", "0 times any factor stays 0.", "start at -b 8 or more")
        for flag, value, minimum in (("-n", self.iters, 1), ("-w", self.warmup_iters, 0), ("-c", self.check, 0),
                                     ("-r", self.root, 0), ("--corrupt", self.corrupt, 0)):  # fmt: skip
            if value < minimum:
                raise SettingsRefused(
                    f"{flag} {value}: must be at least {minimum}", hint=f"give {flag} {minimum} or more"
                )
        if self.average not in AVERAGE_MODES:
            modes = ", ".join(f"{key} {name}" for key, name in AVERAGE_MODES.items())
            raise SettingsRefused(f"-a {self.average} is not an averaging mode", f"the modes are {modes}.", "use -a 1")

    @property
    def sizes(self) -> list[int]:
        return sizes(self.min_bytes, self.max_bytes, self.step_factor, self.step_bytes)

    def check_world(self, backend: str, world_size: int) -> None:
        """Refusals that need the job's backend and size, known once the nodes are planned."""
        for name in self.collectives:
            reason = unsupported_reason(backend, name, self.dtype, self.op)
            if reason:
                op = f" -o {self.op}" if COLLECTIVES[name].reduces else ""
                raise SettingsRefused(
                    f"--collective {name} -d {self.dtype}{op} on the {backend} backend", reason[0] + ".", reason[1]
                )
        if self.root >= world_size and any(COLLECTIVES[name].rooted for name in self.collectives):
            raise SettingsRefused(
                f"-r {self.root}, but the world has {world_size} ranks (0 to {world_size - 1})",
                hint=f"give a root between 0 and {world_size - 1}",
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CollectiveSettings:
        return cls(**{**data, "collectives": tuple(data["collectives"])})
