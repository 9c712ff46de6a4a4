"""The exit codes of every phalanx command, in one place (documented in README.md), the words
that begin a stall report, which goes with STALLED, and the quick exit of a finished process."""

import enum
import gc
from typing import NoReturn


class ExitCode(enum.IntEnum):
    OK = 0
    #: A worker process failed (the root cause is printed last), or a check found a problem.
    FAILED = 1
    #: The settings were refused: before anything started, by a worker (a phalanx error that
    #: exits with this code, such as SettingsRefused), or the nodes disagree on them.
    REFUSED = 2
    #: The other nodes did not join within --join-timeout.
    JOIN_TIMEOUT = 3
    #: A worker's stall watchdog ended it: a rank stopped making progress (report in its log; phalanx
    #: run exits with it too when that report is the root cause).
    STALLED = 4
    #: The job had several ranks, but some never joined its process group: each trained alone.
    NOT_DISTRIBUTED = 5
    #: A worker stopped for preemption after saving a checkpoint (EX_TEMPFAIL: run it again).
    PREEMPTED = 75
    #: Interrupted by SIGINT (Ctrl-C); SIGTERM gives 143, as a shell would report.
    INTERRUPTED = 130


def exit_code_of(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128+N for a death by signal N (Python's
    ``returncode`` is -N then)."""
    return 128 - returncode if returncode < 0 else returncode


#: How the stall watchdog's report begins, in the log of a worker that exits with STALLED: the
#: watchdog writes it (phalanx.runtime.watchdog) and the launcher finds the report by it
#: (phalanx.launch.failure), to show it as the root cause.
STALL_REPORT = "phalanx: stall:"


def exit_quickly(code: int) -> NoReturn:
    """Ends a process that has finished its work (files closed, results written) with ``code``.

    At exit the interpreter searches every object still alive for reference cycles: with torch
    imported, about a second of CPU; two in a training process, which has more alive (on the
    2-core machine: ``python -c "import torch"`` exits in 1.05 s, and in 0.3 s after
    ``gc.freeze()``; a 2-process launch of examples/train.py ends 3.4 s sooner, its launcher's
    exit and its workers' together). Freezing the objects skips that search. Everything else
    still happens: atexit handlers run, objects are released as their modules go, standard
    output is flushed. Only an object that nothing but a cycle keeps alive is never finalized
    (the memory goes back with the process): so nothing may be left open when this is called.
    """
    gc.freeze()
    raise SystemExit(code)
