"""The job writers: a SLURM batch script (:mod:`.slurm`), Kubernetes manifests (:mod:`.k8s`) and
the ssh fan-out of ``phalanx launch`` (:mod:`.ssh`). Each writes what every node runs, over the
one resolver of :mod:`phalanx.settings`; the scheduler's facts that the node then reads back
(ports, pod and host names, variables) come from its reader in :mod:`phalanx.clusters`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Collection
from pathlib import Path

from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import given_flags


def run_arguments(
    args: argparse.Namespace, leave_out: Collection[str], config_path: Path | None, entrypoint: Entrypoint
) -> list[str]:
    """What follows ``phalanx run`` on every node: the launch flags given (less ``leave_out``),
    the config file, then the script and its arguments."""
    config = ["--config", str(config_path)] if config_path is not None else []
    return [*given_flags(vars(args), leave_out=leave_out), *config, *entrypoint.argv]


def command_line(command: str) -> str:
    """This command line, for the first comment of what it writes (``phalanx COMMAND`` from Python)."""
    return shlex.join(["phalanx", *sys.argv[1:]]) if sys.argv[1:2] == [command] else f"phalanx {command}"
