"""``phalanx doctor``: Check the nodes and the network before a training job wastes a day.

Examples:
  phalanx doctor --simulate-nodes 2 --nproc-per-node 2
  phalanx doctor --nnodes 2 --nproc-per-node 8 --rdzv-endpoint 10.0.0.1:29400   (on every node)
  phalanx doctor --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --json > doctor.json; phalanx plan --from-doctor doctor.json ...

It runs a short job through the same launcher as `phalanx run` (so it meets the same launch
problems), with the same launch options, and:
  - compares every node's versions, GPUs and backend variables in one table and names the odd
    node out; checks GPU count against --nproc-per-node, duplicate hostnames, clock offsets;
  - measures each pair of nodes point to point (latency, bandwidth), and over plain TCP on each
    network two nodes share, and the all-reduce bus bandwidth of the whole world at a few sizes
    (nccl-tests' busbw);
  - times a fixed matmul on every rank and flags stragglers;
  - ends with a verdict: PROBLEM lines (a job would hang, fail or silently differ) and WARNING
    lines (it would be slow), each with a HINT. Warnings: a link under 2.5 Gbit/s, or one that
    needs per-process batches above 64 samples to hide the all-reduce behind dense compute; a
    network connecting every node at 1.5 times the workers' speed or more; a
    rank under 75% of the median matmul speed; a clock more than 1 s off rank 0's.

The report is printed by the node that ran global rank 0. Exit codes: 0 no problem found
(warnings allowed, unless --strict), 1 a problem was found or a worker failed, 2 settings
refused or the nodes were started with different settings, 3 nodes did not join in time (the
nodes that joined are named).
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.cli import command_parser
from phalanx.settings.options import add_launch_options


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "doctor",
        "check nodes and network: versions, links, all-reduce, stragglers, a verdict",
        __doc__,
    )
    group = parser.add_argument_group("doctor")
    group.add_argument(
        "--p2p-size",
        default="16M",
        metavar="SIZE",
        help="message size of the point-to-point bandwidth probe (default 16M)",
    )
    group.add_argument(
        "--max-bytes",
        default="16M",
        metavar="SIZE",
        help="largest all-reduce size; measured at 1M, 4M, ... up to it (default 16M)",
    )
    group.add_argument("--strict", action="store_true", help="exit 1 on warnings too (for CI gates)")
    group.add_argument("--json", action="store_true", help="print the report and verdict as JSON")
    add_launch_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from phalanx.bench.collective_settings import parse_size
    from phalanx.console import say
    from phalanx.diagnostics.doctor_report import format_report
    from phalanx.diagnostics.doctor_settings import DoctorSettings
    from phalanx.diagnostics.verdict import verdict
    from phalanx.exit_codes import ExitCode
    from phalanx.launch.tool import run_tool

    settings = DoctorSettings(p2p_bytes=parse_size(args.p2p_size, "--p2p-size"),
                              allreduce_max_bytes=parse_size(args.max_bytes, "--max-bytes"))  # fmt: skip
    outcome = run_tool(args, "phalanx.diagnostics.doctor_worker", dataclasses.asdict(settings))
    if outcome.report is None:
        if outcome.exit_code == 0 and not args.dry_run:
            say(
                "phalanx: the doctor's report is printed by the node that ran global rank 0 (and kept in its --log-dir)"
            )
        return outcome.exit_code
    findings = verdict(outcome.report)
    if args.json:
        print(json.dumps({**outcome.report, "findings": [f.to_json() for f in findings]}, indent=1))
    else:
        print(format_report(outcome.report, findings))
    failing = [f for f in findings if f.severity == "problem" or args.strict]
    return ExitCode.FAILED if failing or outcome.exit_code else ExitCode.OK
