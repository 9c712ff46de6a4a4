"""``phalanx slurm``'s settings as a :class:`SlurmJob`, and its submission with ``sbatch``."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from phalanx.console import say
from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.jobs import command_line, run_arguments
from phalanx.jobs.inherited import refuse_torchrun_markers
from phalanx.jobs.slurm.sbatch import SlurmJob
from phalanx.launch.job import check_log_dir
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import blaming, given_settings, refuse_settings
from phalanx.settings.values import NodeRange

#: Launch options that describe a run on this machine, not a SLURM job.
_NOT_FOR_SLURM = {"simulate_nodes": "rehearses on this machine; a SLURM job runs on SLURM's nodes",
                  "standalone": "means one node with a private rendezvous; a SLURM job runs on SLURM's nodes",
                  "dry_run": "prints the plan; phalanx slurm prints the script unless --submit is given"}  # fmt: skip


#: sbatch's words where it reached no controller, or was not let in: no slurm.conf and no
#: configless source, a controller down, unreachable or too slow, an authentication (munge) that
#: failed. No option of the script is at fault then.
_NO_CONTROLLER = ("Could not establish a configuration source", "Unable to contact slurm controller",
                  "Socket timed out on send/recv operation", "Protocol authentication error")  # fmt: skip


#: What a name written into an #SBATCH line may hold besides letters and digits, by flag, and an
#: example: the job's name is also the batch script's file name; partitions and accounts may be
#: lists separated by commas.
_NAMES = {"--job-name": ("_.+-", "train-1"), "--partition": ("_.+,-", "gpu"), "--account": ("_.+,-", "ml-team")}


def _check_names(args: argparse.Namespace) -> None:
    """Refuses a name that would break the #SBATCH line it is written into (a space, a quote, a
    newline: sbatch splits or ends the option there), or the script's file name (a slash), and
    an --sbatch line of more than one line."""
    for flag, (punctuation, example) in _NAMES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not re.fullmatch(f"[A-Za-z0-9{re.escape(punctuation)}]+", value):
            raise SettingsRefused(
                f"{flag} {value!r} cannot be written into the batch script",
                f"its #SBATCH line takes letters, digits and {' '.join(punctuation)}: sbatch would split the option "
                "at a space, and a quote, a newline or a slash would break the line or the script's file name.",
                f"for example {flag} {example}",
            )
    for line in args.sbatch:
        if "\n" in line or "\r" in line or not line.startswith("-"):
            raise SettingsRefused(
                f"--sbatch {line!r} is not one #SBATCH option",
                "each --sbatch becomes one line '#SBATCH OPTION'; a line break would end it there.",
                "give each option as its own --sbatch, e.g. --sbatch=--mem=64G --sbatch=--exclusive",
            )


def job_from_args(args: argparse.Namespace) -> SlurmJob:
    """The job ``phalanx slurm`` was asked for; refuses what cannot work before anything is written."""
    entrypoint = Entrypoint.from_args(args, "phalanx slurm [options] train.py [ARGS...]")
    entrypoint.check_exists()
    _check_names(args)
    refuse_torchrun_markers(os.environ, "the batch job's nodes inherit this shell's variables")
    settings, config_path, _ = given_settings(args, os.environ)
    config_path = config_path.resolve() if config_path else None  # the batch script runs elsewhere
    refuse_settings(settings, _NOT_FOR_SLURM, "phalanx slurm", "to rehearse first: phalanx run --simulate-nodes N ...")
    nnodes = settings["nnodes"].value if "nnodes" in settings else NodeRange(1, 1)
    log_dir = settings["log_dir"].value if "log_dir" in settings else Path("phalanx-logs")
    # SLURM creates no folder for the job's log: a job whose folder is missing fails with no word
    with blaming(settings["log_dir"].origin if "log_dir" in settings else ""):
        check_log_dir(Path(os.getcwd()) / log_dir, "SLURM writes the batch job's log there (slurm-<job ID>.out).")
    script = entrypoint.target if entrypoint.is_module else Path(entrypoint.target).stem
    run = run_arguments(args, {"nnodes", *_NOT_FOR_SLURM}, config_path, entrypoint)  # nnodes: #SBATCH --nodes
    return SlurmJob(
        run_command=[sys.executable, "-m", "phalanx", "run", *run],
        nodes=nnodes,
        job_name=args.job_name or re.sub(r"[^A-Za-z0-9_.-]", "-", script),
        workdir=os.getcwd(),
        output=str(log_dir / "slurm-%j.out"),
        signal_lead_s=args.signal_lead,
        max_requeues=args.max_requeues,
        time=args.time,
        partition=args.partition,
        account=args.account,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        extra=tuple(args.sbatch),
        written_by=command_line("slurm"),
    )


def submit(job: SlurmJob, text: str) -> int:
    """Writes the script beside the job's log and submits it; says where the log goes."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SettingsRefused(
            "--submit, but this machine has no sbatch",
            "jobs are submitted from a SLURM login node (or any host with SLURM's client tools).",
            "run phalanx slurm there, or drop --submit to print the script and copy it over",
        )
    folder = Path(job.workdir) / Path(job.output).parent  # made by job_from_args (check_log_dir)
    script = folder / f"{job.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    script.write_text(text)
    try:
        done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise SettingsRefused(
            f"sbatch did not answer within 120 s ({script})",
            "the SLURM controller may be down or overloaded; the job may or may not have been submitted.",
            "look with squeue --me, and submit the script again if it is not there",
        ) from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        say(f"phalanx: error: sbatch refused {script}:\n  " + "\n  ".join(said.splitlines()))
        if any(words in said for words in _NO_CONTROLLER):
            say("HINT: sbatch on this host cannot reach a SLURM controller, or is not let in (sinfo shows the same): "
                "run phalanx slurm --submit on a login node of the cluster, or drop --submit and submit the script "
                "there")  # fmt: skip
        else:
            say("HINT: fix the option it names (the script's #SBATCH lines come from phalanx slurm's flags)")
        return ExitCode.REFUSED
    job_id = done.stdout.strip().split(";")[0]
    log = Path(job.workdir) / job.output.replace("%j", job_id)
    print(job_id)
    say(f"phalanx slurm: submitted job {job_id} ({script})\n"
        f"  log       {log} (every start and requeue appends to it)\n"
        f"  follow    tail -f {shlex.quote(str(log))}\n"
        f"  preempt   scancel --signal=USR1 --batch {job_id}   (a checkpoint, then a requeue)\n"
        f"  cancel    scancel {job_id}")  # fmt: skip
    return ExitCode.OK
