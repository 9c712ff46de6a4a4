"""The error every phalanx command raises for input it refuses.

A refusal says three things, as a newcomer needs them: what was set (and where it came from),
why that cannot work, and what to do instead (the HINT line).
"""

from __future__ import annotations

from phalanx.exit_codes import ExitCode


class PhalanxError(Exception):
    """A problem phalanx explains to the user, with the exit code the command ends with."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, what: str, why: str = "", hint: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.why = why
        self.hint = hint

    def render(self) -> str:
        lines = [f"phalanx: error: {self.what}"]
        lines += [f"  {line}" for line in self.why.splitlines()]  # a why of several lines: each indented
        if self.hint:
            lines.append(f"HINT: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


class SettingsRefused(PhalanxError):
    """Settings that cannot work: refused before anything starts (exit code 2)."""

    exit_code = ExitCode.REFUSED


class NodesDisagree(PhalanxError):
    """The nodes of one job were started with different settings (exit code 2)."""

    exit_code = ExitCode.REFUSED


class PeersUnreachable(PhalanxError):
    """The nodes met, but peers cannot connect to a node where its workers would listen (exit code 2)."""

    exit_code = ExitCode.REFUSED


class JoinTimeout(PhalanxError):
    """The other nodes did not join in time (exit code 3)."""

    exit_code = ExitCode.JOIN_TIMEOUT


class CheckpointNotSaved(PhalanxError):
    """A checkpoint could not be written (a full disk, a folder that is not writable); nothing of
    it was kept, and the previous checkpoints are intact (exit code 1)."""

    exit_code = ExitCode.FAILED
