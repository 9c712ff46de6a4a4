"""``phalanx run``: launch SCRIPT (or -m MODULE) with torchrun on this node, the same command on every node.

Examples:
  one machine, 2 processes:
    phalanx run --nproc-per-node 2 train.py --epochs 5
  rehearse 2 nodes on this machine (the tutorial: debug on one machine first):
    phalanx run --simulate-nodes 2 --nproc-per-node 2 train.py
  two real machines, this same line on both (10.0.0.1 is the main node):
    phalanx run --nnodes 2 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29400 train.py
  see what would run, start nothing:
    phalanx run --dry-run --simulate-nodes 2 train.py
  inside a SLURM allocation, one per node (the nodes come from SLURM):
    srun --ntasks-per-node=1 phalanx run --nproc-per-node 4 train.py

What phalanx does on top of torchrun: the node that owns the endpoint's address hosts the
rendezvous store; each node advertises the address that routes to the endpoint (not its
hostname) and names that interface in GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; settings that
cannot work are refused before anything starts; the nodes compare their settings before the
first step; rank 0's node prints the rank table; each rank logs to LOG_DIR/<run>/attempt_N/rankR/;
a failure ends with its root cause.

Under a scheduler (SLURM, Kubeflow, an Indexed Job, SkyPilot, torchrun's PET_ variables) the
nodes, this node's rank, the endpoint and the job ID come from its variables, and a node count
that contradicts them is refused (docs/clusters.md). SIGUSR1 and SIGUSR2 are passed on to the
workers (SLURM's preemption notice) instead of ending phalanx run.
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx import exit_codes
from phalanx.cli import command_parser
from phalanx.launch.options import spec_from_args
from phalanx.settings.options import add_launch_options, add_script_arguments


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "run",
        "launch a training script on one or many nodes",
        __doc__,
        usage="phalanx run [options] SCRIPT [ARGS...]\n       phalanx run [options] -m MODULE [ARGS...]",
        epilog=exit_codes.summary(),
    )
    add_launch_options(parser)
    add_script_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from phalanx.launch.job import launch

    return launch(spec_from_args(args))
