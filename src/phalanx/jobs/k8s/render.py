"""Manifests as YAML: one multi-document stream, or a folder with one file per object.

A folder is written whole or not at all: every file goes to a temporary name first, and only
when all are written are they renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from phalanx import __version__
from phalanx.errors import SettingsRefused
from phalanx.jobs.k8s.spec import Manifest, ManifestSpec


class _Dumper(yaml.SafeDumper):
    """Block YAML without anchors: objects that share a part (the /dev/shm volume) repeat it."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def header(spec: ManifestSpec) -> str:
    """The comment that starts every stream and file: who wrote it, what it needs."""
    command = "\n#   ".join((spec.written_by or "phalanx k8s").splitlines())  # a newline in an argument stays a comment
    return (f"# Written by phalanx {__version__}:\n#   {command}\n"
            f"# {spec.kind.summary[0].upper()}{spec.kind.summary[1:]}.\n"
            "# The image must have phalanx installed (with PyTorch), and the training script at the path\n"
            "# the command names. Apply with: kubectl apply -f FILE (or -f - from a pipe).\n")  # fmt: skip


def document(manifest: Manifest) -> str:
    """One object as a YAML document, keys in the order written (apiVersion, kind, metadata, spec)."""
    return yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def to_yaml(manifests: Sequence[Manifest], header: str = "") -> str:
    """The objects, in the order kubectl should create them, as one multi-document stream that
    ``kubectl apply -f -`` reads, after the ``header`` comment lines.

    Example:
        >>> print(to_yaml([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "t"}}]), end="")
        ---
        apiVersion: v1
        kind: Service
        metadata:
          name: t
    """
    return header + "".join(f"---\n{document(manifest)}" for manifest in manifests)


def file_name(manifest: Manifest) -> str:
    """``<kind>-<name>.yaml``, e.g. ``job-train.yaml``, ``service-train.yaml``."""
    return f"{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"


def write_folder(manifests: Sequence[Manifest], folder: Path, header: str = "") -> list[Path]:
    """Writes one file per object (:func:`file_name`, after the ``header``) into ``folder``, created
    if missing, replacing files of the same names: all of them or none. Returns the files."""
    check_folder(folder)
    finals = [folder / file_name(manifest) for manifest in manifests]
    for final in finals:
        if final.is_dir():
            raise SettingsRefused(
                f"--output {folder}: {final.name} there is a folder, where phalanx k8s writes a file",
                "nothing was written.",
                "move that folder away, or pick another --output",
            )
    temporaries: list[str] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for manifest in manifests:
            handle, temporary = tempfile.mkstemp(prefix=".phalanx-", suffix=".yaml", dir=folder)
            temporaries.append(temporary)
            with os.fdopen(handle, "w") as out:
                out.write(to_yaml([manifest], header))
        for temporary, final in zip(temporaries, finals):
            os.replace(temporary, final)
    except OSError as error:
        for temporary in temporaries:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise SettingsRefused(
            f"--output {folder}: the manifests cannot be written there ({error.strerror})",
            "the files are written to temporary names first, and those are removed again: none is half-written.",
            "pick a folder you can write to",
        ) from None
    return finals


def check_folder(folder: Path) -> None:
    """Refuses an ``--output`` that is a file, or inside one."""
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            raise SettingsRefused(
                f"--output {folder}: {path} is a file, not a folder",
                "phalanx k8s writes one file per object into the --output folder.",
                "name a folder (it is created if missing), or leave --output out to print the manifests",
            )
        if path.exists():
            return
