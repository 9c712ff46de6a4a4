"""A node's launch settings, as the cross-node check compares them.

torchrun lets nodes started with different --nnodes, --nproc-per-node or scripts form a wrong
world without a word; the lobby compares these fingerprints before the first step.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from phalanx import __version__
from phalanx.launch.node_setup import NodeSetup
from phalanx.settings.entrypoint import Entrypoint

#: The settings compared, in the order the mismatch table lists them (extra ones follow, sorted).
COMPARED = (
    "nnodes",
    "nproc-per-node",
    "backend",
    "heartbeat-timeout",
    "heal",
    "script",
    "script sha256",
    "phalanx",
    "torch",
)
#: What the lobby adds to a fingerprint to say which node it is from: never compared.
IDENTITY_KEYS = ("address", "label")


def file_sha256(path: Path | None) -> str:
    if path is None:
        return "(not found)"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as error:
        return f"(unreadable: {error.strerror})"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def node_fingerprint(setup: NodeSetup) -> dict[str, str]:
    entrypoint = Entrypoint(setup.script, setup.script_args, setup.is_module)
    return {
        "nnodes": str(setup.nnodes),
        "nproc-per-node": str(setup.nproc_per_node),
        "backend": setup.backend,
        "heartbeat-timeout": f"{setup.heartbeat_timeout:g}",
        "heal": str(setup.heal),
        "script": ("-m " if setup.is_module else "") + setup.script,
        "script sha256": file_sha256(entrypoint.source_file()),
        "phalanx": __version__,
        "torch": _torch_version(),
        **setup.extra_fingerprint,
    }


def differing_settings(fingerprints: list[dict[str, str]]) -> list[str]:
    extra = sorted({key for fp in fingerprints for key in fp} - set(COMPARED) - set(IDENTITY_KEYS))
    return [key for key in (*COMPARED, *extra) if len({fp.get(key) for fp in fingerprints}) > 1]
