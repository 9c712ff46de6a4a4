"""The batch script ``phalanx slurm`` writes: one ``phalanx run`` per node, and preemption that
ends in an exact resume (the flow is in the script's comments). The batch shell, not a node,
requeues the job: it runs outside any container the step may run in, where ``scontrol`` is.
"""

from __future__ import annotations

import datetime
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx import __version__
from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.settings.values import NodeRange

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")


def check_time_limit(text: str) -> str:
    """SLURM's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    if not _TIME.match(text):
        raise SettingsRefused(
            f"--time {text!r} is not a SLURM time limit",
            "SLURM reads MINUTES, MM:SS, HH:MM:SS, DAYS-HH, DAYS-HH:MM or DAYS-HH:MM:SS.",
            "for example --time 4:00:00 (four hours)",
        )
    return text


@dataclass(frozen=True)
class SlurmJob:
    """What the batch script asks SLURM for, and the ``phalanx run`` command every node runs."""

    #: The command after ``srun ...``: ``python -m phalanx run [flags] SCRIPT ARGS``.
    run_command: Sequence[str]
    nodes: NodeRange
    job_name: str
    workdir: str
    output: str
    signal_lead_s: int = 120
    max_requeues: int = 3
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    #: More ``#SBATCH`` lines, as written after it (``--mem=64G``).
    extra: Sequence[str] = field(default_factory=tuple)
    #: The command line that wrote the script, for its first comment.
    written_by: str = ""

    def directives(self) -> list[str]:
        nodes = str(self.nodes.min) if not self.nodes.is_elastic else f"{self.nodes.min}-{self.nodes.max}"
        lines = [f"--job-name={self.job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
        lines += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        lines += [f"--cpus-per-task={self.cpus_per_task}"] if self.cpus_per_task else []
        lines += [f"--time={self.time}"] if self.time else []
        lines += [f"--partition={self.partition}"] if self.partition else []
        lines += [f"--account={self.account}"] if self.account else []
        lines += [f"--chdir={self.workdir}", f"--output={self.output}", "--open-mode=append", "--requeue",
                  f"--signal=B:USR1@{self.signal_lead_s}", *self.extra]  # fmt: skip
        return lines


def render(job: SlurmJob) -> str:
    """The batch script's text, for ``sbatch``.

    Example:
        >>> job = SlurmJob(["phalanx", "run", "train.py"], NodeRange(2, 2), "train", "/home/me", "slurm-%j.out")
        >>> "#SBATCH --nodes=2" in render(job)
        True
    """
    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", *job.run_command]
    directives = "\n".join(f"#SBATCH {line}" for line in job.directives())
    return _TEMPLATE.format(
        version=__version__,
        stamp=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        written_by=(job.written_by or "phalanx slurm").replace("\n", "\n#   "),  # line breaks stay comments
        directives=directives,
        lead=job.signal_lead_s,
        max_requeues=job.max_requeues,
        preempted=int(ExitCode.PREEMPTED),
        srun=shlex.join(srun),
    )


_TEMPLATE = """\
#!/bin/bash
# Written by phalanx {version} on {stamp}:
#   {written_by}
{directives}

# One `phalanx run` per node (srun), which starts the workers there. SIGUSR1 (a preemption
# notice, or {lead} s before the time limit) goes to this shell, which passes it to every node:
# the workers stop after the same step, save one checkpoint and exit {preempted}. The job is then
# requeued, at most MAX_REQUEUES times in all, and the requeued job resumes from that checkpoint.
MAX_REQUEUES={max_requeues}
requeued=${{SLURM_RESTART_COUNT:-0}}
echo "phalanx slurm: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, start $((requeued + 1)) (requeued $requeued of at most $MAX_REQUEUES times), $(date)"

signalled=0
pass_on() {{
  signalled=1
  echo "phalanx slurm: SIGUSR1 at $(date +%T), passed on to every node (with phalanx's PreemptionGuard the workers stop after the same step and save a checkpoint)"
  kill -USR1 "$step" 2>/dev/null
}}
trap pass_on USR1

{srun} &
step=$!
# `wait` returns early when a trapped signal arrives: wait again until srun has ended.
while true; do
  wait "$step"
  code=$?
  kill -0 "$step" 2>/dev/null || break
done

if [ "$code" -eq {preempted} ] || {{ [ "$signalled" -eq 1 ] && [ "$code" -ne 0 ]; }}; then
  if [ "$code" -eq {preempted} ]; then why="stopped after saving a checkpoint"; else why="ended with exit $code after SIGUSR1"; fi
  if [ "$requeued" -lt "$MAX_REQUEUES" ]; then
    echo "phalanx slurm: the step $why; requeueing the job ($((requeued + 1)) of $MAX_REQUEUES)"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "phalanx slurm: scontrol requeue failed; sbatch this script again to continue" >&2
  else
    echo "phalanx slurm: the step $why, and no requeue is left ($MAX_REQUEUES used); sbatch this script again to continue"
  fi
fi
exit "$code"
"""
