"""The exit codes of every phalanx command, in one place (documented in README.md)."""

import enum
import textwrap


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
    #: --heal: a rank could not heal (no replacement joined in time, no survivor held the state,
    #: the launch's store lost):
    #: it kept the state after the last step, and its supervisor leaves the job to --max-restarts.
    HEAL_FAILED = 6
    #: A worker stopped for preemption after saving a checkpoint (EX_TEMPFAIL: run it again).
    PREEMPTED = 75
    #: Interrupted by SIGINT (Ctrl-C); SIGTERM gives 143, as a shell would report.
    INTERRUPTED = 130


#: Each exit code in a few words, for ``--help`` (README.md's table says more).
_SUMMARY = {
    ExitCode.OK: "ok",
    ExitCode.FAILED: "a worker failed (its root cause printed last)",
    ExitCode.REFUSED: "settings refused (by phalanx or a worker) or the nodes disagree",
    ExitCode.JOIN_TIMEOUT: "nodes did not join in time",
    ExitCode.STALLED: "a stalled rank (the watchdog's report)",
    ExitCode.NOT_DISTRIBUTED: "ranks that each trained alone",
    ExitCode.HEAL_FAILED: "--heal: the ranks could not heal",
    ExitCode.PREEMPTED: "the workers stopped for preemption (run again to continue)",
}


def summary() -> str:
    """Every exit code in one sentence, for the epilog of ``--help``.

    Example:
        >>> summary().startswith("Exit codes: 0 ok, 1 a worker failed")
        True
    """
    codes = ", ".join(f"{int(code)} {words}" for code, words in _SUMMARY.items())
    return textwrap.fill(f"Exit codes: {codes}, 128+N stopped by signal N ({ExitCode.INTERRUPTED} for Ctrl-C).", 96)


def exit_code_of(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128+N for a death by signal N (Python's
    ``returncode`` is -N then)."""
    return 128 - returncode if returncode < 0 else returncode
