"""The launcher's side of a keep request: before it stops workers that wait for a lost node.

A node that goes silent (its machine down, its network cut) raises nothing on the others: their
workers wait in a collective until its timeout. The liveness watch (:mod:`.liveness`) declares
the node lost and the launcher stops its own workers; first it writes why on each rank's keep
request, a FIFO the rank listens on (``phalanx.runtime.survivor``), and gives the ranks that
listen up to :data:`KEEP_BOUND_S` to keep the state after their last step and end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from phalanx.worker_env import KEEP_REPORT

#: At most this long, the ranks that were asked get to keep their state and end before they are killed.
KEEP_BOUND_S = 60.0


def ask_to_keep(requests: Iterable[Path], why: str) -> int:
    """Writes ``why`` on every keep request a rank listens on; returns how many were asked.

    A FIFO nobody reads (a script without phalanx.Run, a rank that ended) cannot be opened for
    writing without blocking, so it is passed over (ENXIO), as is one that is not there.
    """
    asked = 0
    for request in requests:
        try:
            fd = os.open(request, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, why.encode())
            asked += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def keep_report(stderr_log: Path) -> str | None:
    """The last line a rank wrote about the state it kept (:data:`KEEP_REPORT`), without the
    prefix; None where it wrote none."""
    try:
        text = stderr_log.read_text(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith(KEEP_REPORT)]
    return lines[-1][len(KEEP_REPORT) :].strip() if lines else None
