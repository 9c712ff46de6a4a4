"""``phalanx slurm``: a SLURM batch script that runs SCRIPT on every node, and survives preemption.

Examples:
  write the script, read it, submit it yourself:
    phalanx slurm --nnodes 2 --nproc-per-node 4 --gpus-per-node 4 --time 4:00:00 train.py --epochs 90 > train.sbatch
    sbatch train.sbatch
  submit at once:
    phalanx slurm --nnodes 2 --nproc-per-node 4 --gpus-per-node 4 --submit train.py

The script asks for --nnodes nodes with one task each (srun starts one `phalanx run` per node,
which reads the nodes from SLURM and starts --nproc-per-node workers there), appends every start
to one log, and survives preemption and the time limit: SLURM sends SIGUSR1 to the batch shell
--signal-lead seconds before (--signal=B:USR1@LEAD), the shell passes it to every node, the
workers (with phalanx's PreemptionGuard, as examples/train.py) stop after the same step and save
one checkpoint, exit 75, and the shell requeues the job (scontrol requeue, up to --max-requeues
times, counted by SLURM_RESTART_COUNT). The requeued job resumes exactly. `srun
--kill-on-bad-exit=1` ends the whole step when one node dies.

Launch options go to `phalanx run` on every node as written (--nnodes becomes #SBATCH --nodes);
--simulate-nodes, --standalone and --dry-run do not apply to a SLURM job.

Exit codes: 0 the script was written (or submitted: the job ID is printed); 2 settings refused
or sbatch refused the script (its message is printed).
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.cli import command_parser
from phalanx.jobs.slurm.sbatch import check_time_limit
from phalanx.settings import arguments
from phalanx.settings.options import add_launch_options, add_script_arguments


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "slurm",
        "write (or submit) a SLURM batch script: one phalanx run per node, requeue on preemption",
        __doc__,
        usage="phalanx slurm [options] [--submit] SCRIPT [ARGS...]",
    )
    group = parser.add_argument_group("SLURM")
    group.add_argument("--submit", action="store_true", help="submit the script with sbatch instead of printing it")
    group.add_argument(
        "--time",
        type=arguments.Argument("--time", "time", check_time_limit),
        metavar="TIME",
        help="time limit, as sbatch reads it (4:00:00, 2-00:00:00)",
    )
    group.add_argument("--partition", metavar="NAME", help="the partition to run in")
    group.add_argument("--account", metavar="NAME", help="the account to charge")
    group.add_argument("--job-name", metavar="NAME", help="the job's name (default: the script's name)")
    group.add_argument(
        "--gpus-per-node",
        type=arguments.count("--gpus-per-node", example=8),
        metavar="N",
        help="GPUs to allocate on each node",
    )
    group.add_argument(
        "--cpus-per-task",
        type=arguments.count("--cpus-per-task", example=16),
        metavar="N",
        help="CPUs to allocate to each node's phalanx run",
    )
    group.add_argument("--signal-lead", type=arguments.count("--signal-lead", example=120), default=120, metavar="SECONDS",
                       help="send SIGUSR1 this long before the time limit (default 120; SLURM may send it up to "
                       "60 s earlier)")  # fmt: skip
    group.add_argument("--max-requeues", type=arguments.count("--max-requeues", minimum=0, example=3), default=3, metavar="N",
                       help="requeue after a preemption or the time limit at most N times (default 3)")  # fmt: skip
    group.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                       help="one more #SBATCH line, e.g. --sbatch=--mem=64G (repeatable)")  # fmt: skip
    add_launch_options(parser)
    add_script_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from phalanx.console import say
    from phalanx.jobs.slurm.job import job_from_args, submit
    from phalanx.jobs.slurm.sbatch import render

    job = job_from_args(args)
    text = render(job)
    if not args.submit:
        print(text, end="")
        say(f"phalanx slurm: submit it with `sbatch FILE`; its log: {job.workdir}/{job.output} (%j is the job ID)")
        return 0
    return submit(job, text)
