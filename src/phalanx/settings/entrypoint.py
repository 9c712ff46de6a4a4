"""What every worker runs: a script or a module, and its arguments."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused


@dataclass(frozen=True)
class Entrypoint:
    """What every worker runs: a script path or a module (``-m``), and its arguments untouched."""

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, usage: str) -> Entrypoint:
        """SCRIPT (or -m MODULE) and its arguments as parsed; refused, ``usage`` the HINT, without one."""
        if not args.training_script:
            raise SettingsRefused("no training script given", hint=usage)
        return cls(args.training_script, tuple(args.training_script_args), is_module=bool(args.module))

    @property
    def argv(self) -> list[str]:
        """As ``python`` and ``phalanx run`` take it: ``[-m] TARGET ARGS...``."""
        return [*(["-m"] if self.is_module else []), self.target, *self.args]

    def source_file(self) -> Path | None:
        """The file whose content identifies the program (hashed in the cross-node check)."""
        if not self.is_module:
            return Path(self.target)
        # Workers run `python -m`, which looks in the current directory first; so do we (the
        # console script's own sys.path starts with its bin/ folder instead).
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(self.target)
        except (ImportError, ValueError):
            return None
        finally:
            sys.path.pop(0)
        if found is None or not found.origin or found.origin in ("built-in", "frozen"):
            return None
        return Path(found.origin)

    def check_exists(self) -> None:
        if self.is_module:
            if self.source_file() is None:
                raise SettingsRefused(
                    f"module {self.target!r} (given with -m) cannot be found",
                    "Python looks for it on sys.path, which starts with the current directory.",
                    "check the spelling, run from the folder above the package, or install it (pip install -e .)",
                )
            return
        path = Path(self.target)
        if not path.is_file():
            what = "is a folder, not a script" if path.is_dir() else "does not exist"
            raise SettingsRefused(
                f"the training script {self.target!r} {what} (looked in {Path.cwd()})",
                "every worker runs this file, so it must exist on every node at the same path.",
                "check the path, or use -m package.module to run a module",
            )

    def __str__(self) -> str:
        return " ".join(self.argv)
