"""How a command's launch settings become a :class:`~phalanx.launch.spec.LaunchSpec`: the given
settings (:func:`phalanx.settings.options.given_settings`), then what the cluster environment fills."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from phalanx.launch.cluster import with_cluster_environment
from phalanx.launch.spec import LaunchSpec
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import given_settings


def spec_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, entrypoint: Entrypoint | None = None
) -> LaunchSpec:
    """The one place an argparse Namespace turns into a typed spec.

    ``entrypoint`` replaces the script of `phalanx run` for commands that launch phalanx's own
    workers (doctor, bench); their parsers have the launch options but no SCRIPT.
    """
    environ = os.environ if environ is None else environ
    given, config_path, _ = given_settings(args, environ)
    settings = with_cluster_environment(given, environ)
    if entrypoint is None:
        entrypoint = Entrypoint.from_args(
            args, "phalanx run [options] train.py [ARGS...], or -m package.module [ARGS...]"
        )
    origins = {name: item.origin for name, item in given.items()}
    return LaunchSpec(entrypoint=entrypoint, config_file=config_path, origins=origins, **settings)
