"""``phalanx launch``: run SCRIPT on several hosts over ssh, from one command, after checking every host.

Examples:
  two hosts, 4 processes each (the first host hosts the rendezvous):
    phalanx launch --hosts gpu1,gpu2 --nproc-per-node 4 train.py --epochs 90
  a hostfile (lines `host slots=N`, as DeepSpeed, Horovod and OpenMPI have):
    phalanx launch --hostfile hosts.txt train.py
  check every host and print the command each would run, start nothing:
    phalanx launch --hosts gpu1,gpu2 --dry-run train.py

First a preflight asks every host at once (bounded by --preflight-timeout): ssh works without a
question, the same Python, phalanx and torch, this working folder with the same script (by
SHA-256), enough GPUs, a route to the first host and a connection to its rendezvous port (which
the first host holds open meanwhile). One table shows the answers; if any host fails, nothing
starts (exit 2) and each failing host gets a HINT.

Then every host runs `phalanx run` in this same folder with the same Python (--remote-python to
name another), the variables of this shell that --no-default-env lists (--env for more), and the
launch options given here. Each host's output comes back prefixed with its name.
Ctrl-C stops the job on every host (a second Ctrl-C kills it at once), as do SIGTERM and any
host's failure: the others get --grace seconds to end on their own, then SIGTERM, then SIGKILL,
and nothing is left running on any host; a lost ssh connection ends that host's processes too.

ssh is your own: ~/.ssh/config (or --ssh-config) gives users, ports, keys and jump hosts;
`ssh HOST true` must work without a password prompt. The launcher says BEAT to every host every
5 s; a host that hears nothing for 30 s (a cut link) stops its job as if Ctrl-C'd and killed.

The launch options below are phalanx run's, with these differences: --nnodes is the number of
hosts (another number is refused); --rdzv-endpoint defaults to the first host's own address that
every host reaches, on port 29400; --rdzv-id defaults to a fresh launch-<random>; --dry-run runs
the preflight and prints each host's command; --simulate-nodes, --standalone and
--headless-service are refused.

Exit codes: those of phalanx run, from the host that failed first (its root cause); 2 settings or
a host refused before anything started; 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phalanx.cli import command_parser
from phalanx.clusters.torchrun_variables import TorchrunVariables
from phalanx.jobs.ssh.job import FORWARDED
from phalanx.settings import arguments
from phalanx.settings.options import add_launch_options, add_script_arguments


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "launch",
        "run a training script on several hosts over ssh, after checking every host",
        __doc__,
        usage="phalanx launch --hosts H1,H2[:SLOTS] [options] SCRIPT [ARGS...]\n       phalanx launch --hostfile FILE [options] SCRIPT [ARGS...]",
    )
    markers = TorchrunVariables.markers
    group = parser.add_argument_group("hosts and ssh")
    group.add_argument("--hosts", metavar="H1,H2[:SLOTS]", help="the hosts, as ssh names them; the first hosts the "
                       "rendezvous; :SLOTS its processes")  # fmt: skip
    group.add_argument("--hostfile", metavar="FILE", help="a file of hosts, one a line: host slots=N")
    group.add_argument("--ssh-config", metavar="FILE", type=Path, help="ssh's config file (default ~/.ssh/config)")
    group.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                       help="an ssh -o option, e.g. --ssh-option Port=2222 (repeatable)")  # fmt: skip
    group.add_argument(
        "--remote-python",
        metavar="PATH",
        help="the Python to run on every host (default: this one's path, the same venv everywhere)",
    )
    group.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                       help="one more variable for every host (repeatable)")  # fmt: skip
    group.add_argument("--no-default-env", action="store_true",
                       help=f"do not pass on this shell's {', '.join(FORWARDED)}; torchrun's {', '.join(markers)} "
                       "describe the job, and are refused rather than passed on")  # fmt: skip
    group.add_argument("--preflight-timeout", type=arguments.seconds("--preflight-timeout", example=30), default=30.0, metavar="SECONDS",
                       help="the bound for the preflight of all hosts together (default 30)")  # fmt: skip
    group.add_argument("--grace", type=arguments.seconds("--grace", example=30), default=30.0, metavar="SECONDS",
                       help="after a failure or a stop, how long hosts get to end on their own before SIGTERM, "
                       "and again before SIGKILL (default 30)")  # fmt: skip
    add_launch_options(parser)
    add_script_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from phalanx.jobs.ssh.job import job_from_args, launch
    from phalanx.jobs.ssh.transport import Ssh

    ssh = Ssh(config=args.ssh_config, options=tuple(args.ssh_option))
    return launch(job_from_args(args), ssh, args.preflight_timeout)
