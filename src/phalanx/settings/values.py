"""Parsers for the values of launch settings: each takes text (or a TOML value) and returns a
typed value, or raises :class:`InvalidValue` saying why and what to write instead."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

#: torchrun's default port for the c10d rendezvous backend.
DEFAULT_RDZV_PORT = 29400

NPROC_KEYWORDS = ("auto", "gpu", "cpu")
BACKENDS = ("auto", "nccl", "gloo")
#: Simulated node k advertises 127.0.0.(SIMULATED_ADDRESS_BASE + k). Distinct addresses give the
#: nodes distinct identities, and three-digit last octets keep torchrun's node order (sorted by
#: address) the same as the simulated index: so at most 99 nodes (127.0.0.101 to .199).
SIMULATED_ADDRESS_BASE = 101
MAX_SIMULATED_NODES = 199 - SIMULATED_ADDRESS_BASE + 1

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class InvalidValue(ValueError):
    """A setting's value cannot be parsed; ``why`` and ``hint`` go into the refusal."""

    def __init__(self, why: str, hint: str) -> None:
        super().__init__(why)
        self.why = why
        self.hint = hint


@dataclass(frozen=True)
class NodeRange:
    """``--nnodes``: a fixed count (min == max) or an elastic MIN:MAX range."""

    min: int
    max: int

    @property
    def is_elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return str(self.min) if not self.is_elastic else f"{self.min}:{self.max}"


@dataclass(frozen=True)
class Endpoint:
    """``--rdzv-endpoint``: where the rendezvous store listens."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Resolved:
    """A setting's typed value and where it came from, in words (``--nnodes``, ``PET_NNODES=2``)."""

    value: Any
    origin: str


def given_as(origin: str) -> str:
    """How a refusal names where a value came from: nothing for a flag (the message names the
    flag), else `` (from ORIGIN)``: ``PHALANX_NNODES=0``, ``nnodes in launch.toml``."""
    return "" if origin.startswith("--") else f" (from {origin})"


def _as_text(value: object) -> str:
    return str(value).strip()


def parse_int(value: object, *, minimum: int, name: str) -> int:
    hint = f"for example {name} {minimum}"
    if isinstance(value, bool):
        raise InvalidValue(f"{name} takes a whole number, not {value!r}", hint)
    if isinstance(value, int):
        number = value
    else:
        text = _as_text(value)
        if not re.fullmatch(r"[+-]?\d+", text):
            raise InvalidValue(f"{name} takes a whole number, not {text!r}", hint)
        number = int(text)
    if number < minimum:
        raise InvalidValue(f"{name} must be at least {minimum}, not {number}", hint)
    return number


#: The longest wait a seconds setting may give: a week. A longer one bounds nothing, and past
#: threading.TIMEOUT_MAX a thread's wait fails instead of waiting.
MAX_SECONDS = 7 * 86400.0


def seconds_problem(seconds: float) -> str | None:
    """Why ``seconds`` cannot bound a wait (not positive, NaN, infinite, over :data:`MAX_SECONDS`),
    or None."""
    if not seconds > 0:
        return "is not a positive number of seconds"
    if seconds > MAX_SECONDS:
        return f"is longer than a week ({MAX_SECONDS:g} s), which bounds nothing"
    return None


def parse_seconds(value: object, *, name: str, example: int = 300) -> float:
    text = _as_text(value)
    hint = f"for example {name} {example}"
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidValue(f"{name} takes a number of seconds, not {text!r}", hint) from None
    problem = seconds_problem(seconds)
    if problem:
        raise InvalidValue(f"{name} {text} {problem}", hint)
    return seconds


#: --heartbeat-timeout's default: a link cut for a few seconds is ridden out.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: The shortest --heartbeat-timeout: beats a sixth of a second apart, a few store round trips each.
MIN_HEARTBEAT_TIMEOUT_S = 1.0
#: The longest: a day rides out any pause worth waiting for.
MAX_HEARTBEAT_TIMEOUT_S = 86400.0


def parse_heartbeat_timeout(value: object) -> float:
    seconds = parse_seconds(value, name="--heartbeat-timeout", example=30)
    if seconds < MIN_HEARTBEAT_TIMEOUT_S:
        raise InvalidValue(
            f"--heartbeat-timeout {seconds:g}: below {MIN_HEARTBEAT_TIMEOUT_S:g} s, a busy machine's scheduling delay "
            "or one slow answer of the store would count as a lost node",
            "for example --heartbeat-timeout 5",
        )
    if seconds > MAX_HEARTBEAT_TIMEOUT_S:
        raise InvalidValue(
            f"--heartbeat-timeout {seconds:g}: at most {MAX_HEARTBEAT_TIMEOUT_S:g} s (a day)",
            "a day rides out any pause worth waiting for; for example --heartbeat-timeout 60",
        )
    return seconds


def parse_simulated_nodes(value: object) -> int:
    """--simulate-nodes K: 1 to MAX_SIMULATED_NODES node agents on this host."""
    count = parse_int(value, minimum=1, name="--simulate-nodes")
    if count > MAX_SIMULATED_NODES:
        raise InvalidValue(
            f"--simulate-nodes {count}: at most {MAX_SIMULATED_NODES} nodes can be simulated",
            "a rehearsal needs only a few nodes; 2 to 4 show every multi-node code path",
        )
    return count


def parse_nnodes(value: object) -> NodeRange:
    text = _as_text(value)
    hint = "write --nnodes N for a fixed number of nodes, or --nnodes MIN:MAX (e.g. 2:4) for an elastic job"
    parts = text.split(":")
    if len(parts) > 2 or not all(re.fullmatch(r"\d+", part) for part in parts):
        raise InvalidValue(f"--nnodes {text!r} is neither a number nor a MIN:MAX range", hint)
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise InvalidValue(f"--nnodes {text}: a job needs at least 1 node", hint)
    if low > high:
        raise InvalidValue(f"--nnodes {text}: the minimum ({low}) is larger than the maximum ({high})", hint)
    return NodeRange(low, high)


def parse_nproc_per_node(value: object) -> int | str:
    text = _as_text(value).lower()
    if text in NPROC_KEYWORDS:
        return text
    hint = "write a number (usually the GPUs per node), or auto (GPUs if any, else CPU cores), gpu or cpu"
    if re.fullmatch(r"[+-]?\d+", text) and int(text) < 1:
        raise InvalidValue(f"--nproc-per-node {text}: a node runs at least 1 worker process", hint)
    try:
        return parse_int(text, minimum=1, name="--nproc-per-node")
    except InvalidValue:
        raise InvalidValue(f"--nproc-per-node {text!r} is not a number of processes", hint) from None


def parse_backend(value: object) -> str:
    text = _as_text(value).lower()
    if text not in BACKENDS:
        raise InvalidValue(
            f"--backend {text!r} is not a backend phalanx knows",
            "use --backend auto (nccl with GPUs, gloo without), nccl or gloo",
        )
    return text


def parse_endpoint(value: object, *, port_zero: bool = False) -> Endpoint:
    """``HOST[:PORT]``; port 0 (any free port) only where ``port_zero`` allows it (a plan's own)."""
    text = _as_text(value)
    hint = "write --rdzv-endpoint HOST[:PORT], the main node's address, e.g. --rdzv-endpoint 10.0.0.1:29400"
    if not text:
        raise InvalidValue("--rdzv-endpoint is empty", hint)
    if text.startswith("["):
        match = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", text)
        if not match:
            raise InvalidValue(f"--rdzv-endpoint {text!r}: an IPv6 address in [] is not closed", hint)
        host, port_text = match.group(1), match.group(2)
    elif text.count(":") > 1:
        host, port_text = text, None  # a bare IPv6 address, no port
    elif ":" in text:
        host, port_text = text.split(":")
    else:
        host, port_text = text, None
    if not _is_valid_host(host):
        raise InvalidValue(f"--rdzv-endpoint {text!r}: {host!r} is not a host name or IP address", hint)
    if port_text is None:
        return Endpoint(host, DEFAULT_RDZV_PORT)
    if not re.fullmatch(r"\d+", port_text) or not (0 if port_zero else 1) <= int(port_text) <= 65535:
        raise InvalidValue(f"--rdzv-endpoint {text!r}: the port {port_text!r} is not a number from 1 to 65535", hint)
    return Endpoint(host, int(port_text))


def _is_valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host)) and not host.replace(".", "").isdigit()


def parse_rdzv_id(value: object) -> str:
    text = _as_text(value)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", text):
        raise InvalidValue(
            f"--rdzv-id {text!r} must be 1 to 64 letters, digits, '.', '_' or '-'",
            "the same short name on every node of one job, e.g. --rdzv-id resnet-run1",
        )
    return text


def parse_flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _as_text(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise InvalidValue(f"{text!r} is not a yes/no value", "write 1 or 0 (true or false)")


def parse_interface(value: object) -> str:
    text = _as_text(value)
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", text):
        raise InvalidValue(f"--interface {text!r} is not a network interface name", "list them with `ip -br addr`")
    return text


def parse_service_name(value: object) -> str:
    """``--headless-service``: a Kubernetes Service's name (a DNS-1035 label)."""
    text = _as_text(value)
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", text):
        raise InvalidValue(
            f"--headless-service {text!r} is not a Kubernetes Service name",
            "a Service's name is 1 to 63 lower-case letters, digits and '-', starting with a letter "
            "(kubectl get services lists them)",
        )
    return text
