"""``phalanx env``: this machine's report, the facts a multi-node job depends on, and its known traps.

Examples:
  read it:
    phalanx env
  keep it, or compare two nodes' reports:
    phalanx env --json > node1.json
  the launch settings of a config file (and this shell's PHALANX_* variables):
    phalanx env --config phalanx.toml

What it reports: host (hostname and what it resolves to, how long looking up an address's name
takes, OS, kernel, CPUs, memory, Python); torch (version, CUDA build and whether CUDA is usable,
cuDNN, NCCL, which of gloo, nccl and mpi torch.distributed has); the GPUs torch sees and the
NVIDIA driver; network interfaces (state, addresses, MTU, link speed where the OS knows it,
loopback marked); InfiniBand/RoCE ports (state, rate); /dev/shm size and free space; the
open-files and locked-memory limits; the NCCL_*, GLOO_*, TORCH_*, MASTER_*, PHALANX_* variables
that are set (and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES); and the
launch settings `phalanx run` would use here from PHALANX_<FLAG> variables and the --config file
(or $PHALANX_CONFIG), with where each came from. It ends with a WARNING and a HINT for each
known trap it finds: a hostname that resolves to a loopback address (the /etc/hosts trap), a
name server that does not answer (torch's store client waits for it at every connect), /dev/shm
under 1 GiB, an open-files limit under 4096, a CPU-only torch on a machine with an NVIDIA
driver, GLOO_/NCCL_SOCKET_IFNAME naming a missing interface, InfiniBand ports that are not
ACTIVE, a locked-memory limit with RDMA devices.
Differences between nodes are `phalanx doctor`'s to find.

--json prints the same report as one JSON document (its keys are listed in
phalanx.diagnostics.env_report), for tools and for comparing nodes.

Exit codes: 0 the report was printed (warnings do not change it); 2 the --config file cannot be
read or has an unknown setting, or a setting `phalanx run` would refuse (the report is printed
first, the refusal last).
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.cli import command_parser


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "env",
        "this machine's report: versions, GPUs, network, limits, known traps",
        __doc__,
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file of launch settings, as phalanx run --config reads it (default: $PHALANX_CONFIG)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json
    import os

    from phalanx.diagnostics.env_report import collect_env_report
    from phalanx.diagnostics.env_text import render
    from phalanx.errors import SettingsRefused
    from phalanx.settings.options import read_config

    config_path, config = read_config(args.config, os.environ)
    report = collect_env_report(os.environ, config, config_path)
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report), flush=True)
    refused = report.refused_settings
    if refused:
        first = refused[0]
        others = f" (and {len(refused) - 1} more, listed in the report)" if len(refused) > 1 else ""
        raise SettingsRefused(
            f"{first.refused}{others}", "phalanx run would refuse it before starting anything.", first.hint or ""
        )
    return 0
