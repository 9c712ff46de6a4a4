"""Heal mode's worker: the script runs in a child process, which is replaced when it fails
(docs/launch-design.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from phalanx.exit_codes import ExitCode, exit_code_of
from phalanx.launch import out_of_memory
from phalanx.launch.signals import die_with_parent
from phalanx.worker_env import WorkerEnv, heal_armed_of, launcher_takeover

#: What the supervisor passes on to its child: the launcher's stop, interrupt and notices.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: Exit codes a replacement cannot mend: the child stopped as asked (a preemption, an interrupt),
#: its settings were refused (a replacement would be too), or the ranks could not heal and leave
#: the job to the launcher's restart.
NOT_REPLACED = (ExitCode.OK, ExitCode.REFUSED, ExitCode.PREEMPTED, ExitCode.INTERRUPTED, ExitCode.HEAL_FAILED)


class Supervisor:
    """Runs ``python -m phalanx.launch.bootstrap ARGV`` as a child, replacing it when it fails.

    Args:
        argv: the script and its arguments (or ``-m MODULE ARGS``).
        allowed: how many replacements of this rank may start.
        armed: the file phalanx.Run writes once its loop can heal; a failure before it is not
            healed (None: replace any failure).
    """

    def __init__(self, argv: list[str], allowed: int, armed: Path | None = None) -> None:
        self.argv, self.allowed, self.armed = argv, allowed, armed
        self.signalled: int | None = None
        #: The signal the last child died of, if it died of one.
        self.died_of: int | None = None
        #: The kernel's words when its out-of-memory killer ended the last child (:mod:`.out_of_memory`).
        self.why = ""
        self._child: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        """Supervises until the script ends for good; returns the exit code to end with."""
        for signum in FORWARDED:
            signal.signal(signum, self._pass_on)
        replacements = 0
        while True:
            code = self._run_child(None if replacements == 0 else replacements - 1)
            if code in NOT_REPLACED or self.signalled is not None:
                return code
            failed = f"phalanx: the script failed (exit code {code})"
            if self.armed is not None and not self.armed.exists():
                self._say(f"{failed} before its phalanx.Run could heal (it never started its loop in heal mode): "
                          f"leaving it to {launcher_takeover(os.environ)}")  # fmt: skip
                return code
            if replacements >= self.allowed:
                self._say(f"{failed} and this rank was replaced {replacements} time(s) already, as many as allowed: "
                          f"leaving it to {launcher_takeover(os.environ)}")  # fmt: skip
                return code
            replacements += 1
            self._say(f"{failed}; starting replacement {replacements} of this rank, which joins the surviving ranks")

    def _say(self, line: str) -> None:
        """A line about the child's end, and the kernel's words with a HINT where it ended it."""
        why = f"\n  {self.why}\nHINT: {out_of_memory.HINT}" if self.why else ""
        print(line + why, file=sys.stderr, flush=True)

    def _run_child(self, before: int | None) -> int:
        env = {**os.environ, **WorkerEnv(supervisor_pid=os.getpid(), replacement=before).to_env()}
        record = WorkerEnv.from_env(os.environ).group_record
        if record:  # the child before's exit record: the launcher must not take it for this one's
            Path(record).unlink(missing_ok=True)
        watch = out_of_memory.OomWatch()
        # In a session of its own: the launcher's signals to this process's group reach it once,
        # passed on by this process, and it leads its own group (which its entry point guards).
        self._child = subprocess.Popen([sys.executable, "-u", "-m", "phalanx.launch.bootstrap", *self.argv], env=env,
                                       start_new_session=True)  # fmt: skip
        returncode = self._child.wait()
        self.died_of = -returncode if returncode < 0 else None
        self.why = watch.explain(self._child.pid, returncode) if returncode else ""
        watch.close()
        return exit_code_of(returncode)

    def _pass_on(self, signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.signalled = signum
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)


def supervise(argv: list[str]) -> int:
    """The supervisor's entry: dies with its launcher, then supervises the script."""
    worker = WorkerEnv.from_env(os.environ)
    die_with_parent(worker.launcher_pid)
    armed = heal_armed_of(worker.keep_request) if worker.keep_request else None
    supervisor = Supervisor(argv, worker.heal or 0, armed)
    code = supervisor.run()
    if supervisor.died_of is not None:  # the launcher reads a death by signal as one (not as exit 128+N)
        sys.stdout.flush()
        if supervisor.died_of not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
            signal.signal(supervisor.died_of, signal.SIG_DFL)
        os.kill(os.getpid(), supervisor.died_of)
    return code
