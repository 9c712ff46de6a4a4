"""What `phalanx bench ddp` was asked to measure: typed, checked before anything starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phalanx.bench.ddp_models import MODELS
from phalanx.errors import SettingsRefused
from phalanx.runtime.model import COMPRESSIONS

#: Names in COMPRESSIONS that pick one of the others by timing them in a run's first steps: the
#: bench would time that trial, not a mode. `--compression all` measures every mode they pick from.
CHOOSERS = frozenset({"auto"})
#: wrap_model's PowerSGD all-reduces uncompressed for its first 2 steps (start_powerSGD_iter),
#: and its first compressed step allocates its memories: its warm-up covers all 3.
POWERSGD_WARMUP_STEPS = 3


def _names(text: str, flag: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    unknown = [part for part in parts if part not in known]
    if unknown or not parts:
        raise SettingsRefused(
            f"{flag} {text!r}: unknown {what} {', '.join(unknown) or '(none given)'}",
            f"phalanx bench ddp knows {', '.join(known)}.",
            f"give one or more of them, comma-separated, or all (for example {flag} {known[0]})",
        )
    return tuple(dict.fromkeys(parts))  # in the order given, each once


def parse_models(text: str) -> tuple[str, ...]:
    return tuple(MODELS) if str(text).strip() == "all" else _names(text, "--model", tuple(MODELS), "model")


def parse_compressions(text: str) -> tuple[tuple[str, ...], bool]:
    """The compressions asked for, and whether they came from ``all`` (then the backend's
    impossible ones are skipped with a note instead of refused)."""
    if str(text).strip() == "all":
        return tuple(name for name in COMPRESSIONS if name not in CHOOSERS), True
    names = _names(text, "--compression", COMPRESSIONS, "compression")
    choosers = [name for name in names if name in CHOOSERS]
    if choosers:
        raise SettingsRefused(
            f"--compression {choosers[0]}: not a compression of its own",
            f"{choosers[0]} times the others in a run's first steps and keeps the fastest; the bench would time that trial.",
            "use --compression all to measure each of them side by side",
        )
    return names, False


def unsupported_reason(compression: str, backend: str, world_size: int) -> tuple[str, str] | None:
    """Why wrap_model would refuse this compression in this job, and what to do instead
    (checked here so that the refusal comes before the job starts, not from every worker)."""
    if compression == "bf16" and world_size > 1 and backend != "nccl":
        return (
            f"torch's bf16 hook needs NCCL 2.10+ on CUDA 11+; {backend} cannot reduce bf16 gradients",
            "use --compression fp16 (the same bytes on the wire) or powersgd on gloo",
        )
    return None


@dataclass(frozen=True)
class DdpSettings:
    models: tuple[str, ...] = ("linear",)
    compressions: tuple[str, ...] = ("none",)
    #: True when the compressions came from `--compression all`: skip what the backend cannot run.
    skip_unsupported: bool = False
    #: Samples per process per step.
    batch_size: int = 32
    steps: int = 20
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        for flag, value, minimum in (("--batch-size", self.batch_size, 1), ("--steps", self.steps, 1),
                                     ("--warmup-steps", self.warmup_steps, 0)):  # fmt: skip
            if value < minimum:
                raise SettingsRefused(
                    f"{flag} {value}: must be at least {minimum}",
                    "the timings are medians over --steps measured steps, each of --batch-size samples per process."
                    if minimum
                    else "",
                    f"give {flag} {max(minimum, 1)} or more",
                )
        unknown = [name for name in self.models if name not in MODELS] + [
            c for c in self.compressions if c not in COMPRESSIONS
        ]
        if unknown:
            raise ValueError(
                f"unknown models or compressions {unknown}: parse them with parse_models/parse_compressions"
            )

    def runnable(self, backend: str, world_size: int) -> tuple[tuple[str, ...], dict[str, str]]:
        """The compressions this job measures, and the skipped ones with the reason; refuses one the
        backend cannot run that was asked for by name."""
        skipped: dict[str, str] = {}
        for name in self.compressions:
            reason = unsupported_reason(name, backend, world_size)
            if reason and not self.skip_unsupported:
                raise SettingsRefused(f"--compression {name} on the {backend} backend", reason[0] + ".", reason[1])
            if reason:
                skipped[name] = reason[0]
        return tuple(name for name in self.compressions if name not in skipped), skipped

    def warmup_for(self, compression: str) -> int:
        return max(self.warmup_steps, POWERSGD_WARMUP_STEPS if compression == "powersgd" else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DdpSettings:
        return cls(**{**data, "models": tuple(data["models"]), "compressions": tuple(data["compressions"])})
