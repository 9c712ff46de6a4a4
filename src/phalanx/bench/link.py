"""The link a ring all-reduce runs over: bandwidth and latency from flags or from a doctor file.

Bandwidth units are spelled out, since the common ones differ by a factor of 8 and by case only
("Gb" or "GB"): ``bit``, ``bit/s``, ``bps`` are bits per second, ``B/s``, ``byte/s`` bytes.
Prefixes are decimal (k, M, G, T), or binary with ``i`` (Ki, Mi, Gi, Ti).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.settings.values import InvalidValue

#: Decimal prefixes (k = 1000) and binary ones (Ki = 1024), lower-cased.
UNIT_PREFIXES = {
    "": 1.0,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2.0**10,
    "mi": 2.0**20,
    "gi": 2.0**30,
    "ti": 2.0**40,
}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?"
_BANDWIDTH = re.compile(rf"^{_NUMBER}\s*([kKmMgGtT]i?)?\s*(.*)$")
_BIT_UNITS = ("bit", "bits", "bit/s", "bits/s")
_BYTE_UNITS = ("byte", "bytes", "byte/s", "bytes/s")
_LATENCY = re.compile(rf"^{_NUMBER}\s*(ns|us|µs|μs|ms|s)?$")
_SECONDS_PER = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Link:
    """One link of the ring: what it carries per second, and what each message costs on top."""

    bandwidth_bytes_per_s: float
    latency_s: float
    #: Where each figure comes from, as the output states it ("--bandwidth 1gbit", "default for Ethernet").
    bandwidth_origin: str
    latency_origin: str

    def __post_init__(self) -> None:
        if not (0 < self.bandwidth_bytes_per_s < math.inf):
            raise ValueError(f"bandwidth must be a positive number of bytes/s, not {self.bandwidth_bytes_per_s}")
        if not (0 <= self.latency_s < math.inf):
            raise ValueError(f"latency must be zero or more seconds, not {self.latency_s}")


def _number(mantissa: str, exponent: str | None) -> float:
    return float(mantissa) * 10.0 ** int(exponent or 0)


def parse_bandwidth(value: object, *, name: str = "--bandwidth") -> float:
    """``1gbit``, ``10Gbit/s``, ``25gbps``, ``12.5GB/s``, ``1.25GiB/s`` -> bytes per second."""
    text = str(value).strip()
    hint = f"spell the unit out: {name} 10gbit (bits per second) or {name} 1.25GB/s (bytes per second)"
    match = _BANDWIDTH.match(text)
    if not match:
        raise InvalidValue(f"{name} {text!r} is not a bandwidth", hint)
    mantissa, exponent, prefix, unit = match.groups()
    scale = UNIT_PREFIXES[(prefix or "").lower()]
    if unit.lower() in _BIT_UNITS or unit in ("bps", "bitps"):
        bytes_per_s = _number(mantissa, exponent) * scale / 8
    elif unit.lower() in _BYTE_UNITS or unit == "B/s":
        bytes_per_s = _number(mantissa, exponent) * scale
    else:
        written = f"{prefix or ''}{unit}"
        why = (
            f"{name} {text!r}: the unit {written or '(none)'!r} leaves open whether bits or bytes per second are meant"
            if unit in ("", "b", "B", "b/s", "Bps", "BPS", "bPS")
            else f"{name} {text!r}: {written!r} is not a unit of bandwidth"
        )
        raise InvalidValue(why, hint)
    if not (0 < bytes_per_s < math.inf):
        raise InvalidValue(f"{name} {text!r} must be more than zero", hint)
    return bytes_per_s


def parse_latency(value: object, *, name: str = "--latency") -> float:
    """``50us``, ``0.2ms``, ``2e-5s`` -> seconds; a bare ``0`` is zero."""
    text = str(value).strip()
    hint = f"give a unit: {name} 50us (microseconds), {name} 0.5ms or {name} 0"
    match = _LATENCY.match(text)
    if not match:
        raise InvalidValue(f"{name} {text!r} is not a time", hint)
    mantissa, exponent, unit = match.groups()
    number = _number(mantissa, exponent)
    if unit is None:
        if number != 0:
            raise InvalidValue(f"{name} {text!r} has no unit (seconds? microseconds?)", hint)
        return 0.0
    seconds = number * _SECONDS_PER[unit]
    if seconds == math.inf:
        raise InvalidValue(f"{name} {text!r} is too large", hint)
    return seconds


@dataclass(frozen=True)
class DoctorLink:
    """The slowest inter-node link of a doctor --json file."""

    bandwidth_bytes_per_s: float
    latency_s: float
    #: Measured between simulated nodes of one machine: loopback, not a network between hosts.
    loopback: bool


def read_doctor_file(path: Path) -> DoctorLink:
    """The slowest inter-node link in a doctor --json file, and whether it was loopback."""
    hint = (
        "write it on the cluster with `phalanx doctor --json > FILE`; plan reads "
        '{"network": {"bandwidth_bytes_per_s": <float>, "latency_s": <float>}}'
    )
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsRefused(f"--from-doctor {path}: the file does not exist", hint=hint) from None
    except OSError as error:
        raise SettingsRefused(f"--from-doctor {path} cannot be read ({error.strerror})", hint=hint) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SettingsRefused(f"--from-doctor {path} is not JSON", str(error), hint) from None
    network = document.get("network") if isinstance(document, dict) else None
    figures = []
    for key, minimum_excluded in (("bandwidth_bytes_per_s", True), ("latency_s", False)):
        figure = network.get(key) if isinstance(network, dict) else None
        if isinstance(figure, bool) or not isinstance(figure, (int, float)) or not math.isfinite(figure):
            raise SettingsRefused(
                f"--from-doctor {path} has no number at network.{key}",
                "plan needs the slowest inter-node link that doctor measured; a doctor run on one node measures none.",
                hint,
            )
        if figure < 0 or (minimum_excluded and figure == 0):
            raise SettingsRefused(f"--from-doctor {path}: network.{key} is {figure}, which no link can have", hint=hint)
        figures.append(float(figure))
    return DoctorLink(figures[0], figures[1], loopback=document.get("simulated") is True)


def format_bandwidth(bytes_per_s: float) -> str:
    """Both spellings, since users think of links in bits and of tensors in bytes."""
    return f"{_decimal(bytes_per_s * 8)}bit/s = {_decimal(bytes_per_s)}B/s"


def format_latency(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:g} us"


def _decimal(number: float) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if number >= scale:
            return f"{number / scale:.4g} {prefix}"
    return f"{number:.4g} "
