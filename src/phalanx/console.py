"""Plain-text output shared by every command: aligned tables and prefixed status lines.

Kept dependency-free and free of colour codes, so the same text reads well in a terminal and
in a log file.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = [indent + "  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def say(message: str) -> None:
    """A status line from the launcher itself (not from a worker), flushed at once."""
    print(message, file=sys.stderr, flush=True)


def ranges(numbers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5': rank lists as the tutorial's table writes them."""
    parts = []
    for _, run in itertools.groupby(enumerate(sorted(numbers)), key=lambda pair: pair[1] - pair[0]):
        values = [number for _, number in run]  # consecutive: their difference to the index is the same
        parts.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
    return ",".join(parts)
