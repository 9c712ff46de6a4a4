"""The ``phalanx`` command line: thin parsers over the library (:mod:`phalanx.launch`)."""

from __future__ import annotations

import argparse
from typing import Any


def command_parser(
    commands: Any, name: str, help_text: str, manual: str, usage: str | None = None, epilog: str | None = None
) -> argparse.ArgumentParser:
    """A command's parser, whose --help is its module docstring: the first line after ``NAME:``,
    then the rest as written (examples, exit codes), then ``epilog``."""
    summary, _, details = manual.partition("\n\n")
    return commands.add_parser(
        name, help=help_text, description=summary.split(": ", 1)[1] + "\n\n" + details,
        formatter_class=argparse.RawDescriptionHelpFormatter, usage=usage, epilog=epilog,
    )  # fmt: skip
