"""A node's launch settings, as the lobby compares them across nodes before the first step."""

from __future__ import annotations

import hashlib
from pathlib import Path

from phalanx import __version__
from phalanx.launch.node_setup import NodeSetup
from phalanx.settings.entrypoint import Entrypoint
from phalanx.torch_compat import installed_torch

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
        "torch": installed_torch() or "(not installed)",
        **setup.extra_fingerprint,
    }


def differing_settings(fingerprints: list[dict[str, str]]) -> list[str]:
    extra = sorted({key for fp in fingerprints for key in fp} - set(COMPARED) - set(IDENTITY_KEYS))
    return [key for key in (*COMPARED, *extra) if len({fp.get(key) for fp in fingerprints}) > 1]
