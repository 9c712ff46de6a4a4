"""The ``phalanx`` command line: thin parsers over the library (:mod:`phalanx.launch`)."""

from __future__ import annotations

import argparse
import re
import textwrap
from typing import Any

#: Prose in --help is refilled to the terminal's width, but no wider than this.
_PROSE_WIDTH = 100


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with its prose refilled where it is wider than the terminal (argparse keeps a
    description's line breaks, so text wrapped for one width broke mid-phrase in a narrower one).
    Lines that start at the margin run on as a paragraph; an indented line whose text hangs (a
    list item ``- ``, or a short term and two spaces) runs on with the lines indented to its text; any
    other indented line (an example command, a table row) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        width = min(width, _PROSE_WIDTH)
        lines = text.splitlines()
        filled: list[str] = []
        while lines:
            first = lines.pop(0)
            hang = _HANG.match(first)
            if first[:1].strip():
                prefix, column = "", 0
            elif hang:
                prefix, column = hang.group(1), len(hang.group(1))
            else:
                filled.append(indent + first if first else "")
                continue
            paragraph = [first]
            while lines and lines[0][:1].strip() if not column else lines and _indent(lines[0]) == column:
                paragraph.append(lines.pop(0))
            if max(map(len, paragraph)) + len(indent) <= width:
                filled += [indent + line for line in paragraph]
                continue
            words = " ".join(line.strip() for line in paragraph)[len(prefix.strip()) :].strip()
            filled += textwrap.wrap(words, width, initial_indent=indent + prefix,
                                    subsequent_indent=indent + " " * column, break_long_words=False,
                                    break_on_hyphens=False)  # fmt: skip
        return "\n".join(filled)


#: An indented line whose text hangs: a list item, or a term then two spaces (group 1: up to the text).
_HANG = re.compile(r"(\s+(?:- |\S(?:\S| (?! )){0,27}\s{2,}))\S")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" ")) if line.strip() else -1


def command_parser(
    commands: Any, name: str, help_text: str, manual: str, usage: str | None = None, epilog: str | None = None
) -> argparse.ArgumentParser:
    """A command's parser, whose --help is its module docstring: the first line after ``NAME:``,
    then the rest as written (examples, exit codes), then ``epilog``."""
    summary, _, details = manual.partition("\n\n")
    return commands.add_parser(
        name, help=help_text, description=summary.split(": ", 1)[1] + "\n\n" + details,
        formatter_class=HelpFormatter, usage=usage, epilog=epilog,
    )  # fmt: skip
