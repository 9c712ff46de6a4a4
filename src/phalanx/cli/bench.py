"""``phalanx bench``: measure the network as training uses it.

  phalanx bench collectives   nccl-tests' method and table for all_reduce, all_gather,
                              reduce_scatter, broadcast and all_to_all, on gloo or nccl
  phalanx bench ddp           training throughput of small models with each gradient
                              compression: samples/s, scaling efficiency, time on communication

Each runs as a job through the same launcher as `phalanx run`, so it takes the same launch
options and runs on one machine (--nproc-per-node 2), simulated nodes (--simulate-nodes 2) or
real nodes (the same command on every node, with --nnodes and --rdzv-endpoint).
"""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.bench.ddp_models import MODELS
from phalanx.cli import HelpFormatter
from phalanx.settings.arguments import parsed
from phalanx.settings.options import add_launch_options

COLLECTIVES_HELP = """\
Measures collectives the way nccl-tests does, through phalanx's launcher.

Examples:
  phalanx bench collectives --nproc-per-node 2
  phalanx bench collectives --simulate-nodes 2 --collective all -b 8 -e 16M -f 4
  phalanx bench collectives --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --json > net.json   (on both nodes)

Definitions (nccl-tests' doc/PERFORMANCE.md): time is the mean of -n back-to-back calls, then
combined over the ranks as -a says (default: their mean); algbw = bytes / time, where bytes is
the size for all_reduce and broadcast and n x the per-rank count for all_gather, reduce_scatter
and all_to_all; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather,
reduce_scatter and all_to_all, x 1 for broadcast. busbw is the figure to hold against the
link's line rate. #wrong counts elements that differ from the expected result after -c checks.
torch.distributed has no out-of-place all_reduce or broadcast and no in-place all_to_all:
those cells say n/a.

The report is printed by the node that ran global rank 0. Exit codes: 0 ok, 1 a check found
wrong elements or a worker failed, 2 settings refused, 3 nodes did not join in time.
"""

DDP_HELP = f"""\
Measures DDP training throughput through phalanx's launcher: for each model and gradient
compression, real training steps through phalanx.runtime.model.wrap_model (a fixed synthetic batch
made on the device from a fixed seed, forward, cross-entropy, backward with DDP's gradient
all-reduce, SGD step).

Examples:
  phalanx bench ddp --nproc-per-node 2
  phalanx bench ddp --simulate-nodes 2 --model linear --compression none,fp16,powersgd --plot ddp.png
  phalanx bench ddp --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --json > ddp.json   (on both nodes)

Models (--model), each scoring 10 classes:
{chr(10).join(f"  {m.name:<12} {m.summary}: {m.parameters:,} parameters" for m in MODELS.values())}

Compressions (--compression, wrap_model's names): none (fp32 all-reduce), fp16 and bf16 (half
the bytes; bf16 needs NCCL), powersgd (rank-1 factors with error feedback; its first 2 steps
are plain all-reduces and its 3rd allocates its memories: the warm-up is at least 3 steps).
all: every one the backend can run. Not auto: it times the others in a run's first steps and
keeps the fastest, which is what this bench shows you side by side.

Method. The job runs at the launched world size N. Each round, rank 0 first trains its own copy
of the model alone, without DDP (the 1-process baseline), while the other ranks wait in a gloo
barrier (a gloo group of its own on NCCL), which blocks in a socket read and so takes no CPU
from it (the report shows the CPU they used); then every rank runs a DDP step; then the same step inside model.no_sync(), which
leaves DDP's communication out. The three kinds interleave so that they meet the same noise.
Every time is the median over --steps rounds per rank, then the slowest rank's.
  samples/s     = N x batch / step time
  scaling eff.  = samples/s / (N x 1-process samples/s) = 1-process step time / step time
  comm %        = 1 - compute time (no_sync) / step time, at least 0: the share of a DDP step
                spent on communication that the backward pass does not hide
With more ranks than CPU cores on a host, the efficiency measures the shared cores too (the
report says so).

The report is printed by the node that ran global rank 0. Exit codes: 0 ok, 1 a worker failed,
2 settings refused, 3 nodes did not join in time.
"""


def add_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure collectives (nccl-tests' method) and DDP training throughput",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=HelpFormatter,
    )
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    _add_benchmark(kinds, "collectives", "collective bandwidth with nccl-tests' definitions", COLLECTIVES_HELP,
                   _add_collective_flags, run_collectives)  # fmt: skip
    _add_benchmark(kinds, "ddp", "DDP training throughput, scaling efficiency and communication share per model and "
                   "compression", DDP_HELP, _add_ddp_flags, run_ddp)  # fmt: skip


def _add_benchmark(kinds: Any, name: str, summary: str, description: str, add_flags: Any, handler: Any) -> None:
    parser = kinds.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)
    add_flags(parser)
    add_launch_options(parser)
    parser.set_defaults(handler=handler)


def _add_collective_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what to measure (nccl-tests' flags)")
    add = group.add_argument
    add(
        "--collective",
        default="all_reduce",
        metavar="NAMES",
        help="all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, comma-separated, or all (default all_reduce)",
    )
    add("-b", "--minbytes", default="1K", metavar="SIZE", help="smallest size, bytes or with K/M/G (default 1K)")
    add("-e", "--maxbytes", default="64M", metavar="SIZE", help="largest size (default 64M)")
    add(
        "-f",
        "--stepfactor",
        default="4",
        metavar="N",
        help="multiply the size by N from one row to the next (default 4)",
    )
    add("-i", "--stepbytes", default="1M", metavar="SIZE", help="with -f 1: add this to the size instead (default 1M)")
    add("-n", "--iters", default="20", metavar="N", help="timed calls per row (default 20)")
    add(
        "-w",
        "--warmup_iters",
        default="5",
        metavar="N",
        help="untimed calls first, at the largest and smallest size (default 5)",
    )
    add(
        "-c",
        "--check",
        default="1",
        metavar="N",
        help="check the result on fresh data N times per row; 0 skips (default 1)",
    )
    add(
        "-d",
        "--datatype",
        default="float",
        metavar="TYPE",
        help="int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 (default float)",
    )
    add("-o", "--op", default="sum", metavar="OP", help="reduction: sum, prod, max, min, avg (default sum)")
    add("-r", "--root", default="0", metavar="RANK", help="root rank of broadcast (default 0)")
    add(
        "-a",
        "--average",
        default="1",
        metavar="MODE",
        help="per-rank times combined as 0 rank 0, 1 mean, 2 min, 3 max (default 1)",
    )
    add("--corrupt", default="0", help=argparse.SUPPRESS)  # self-test: rank 0 alters N result elements before the check
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    out.add_argument(
        "--plot", default=None, metavar="PNG", help="also draw busbw against size into this PNG (needs matplotlib)"
    )
    out.add_argument("--line-rate", default=None, metavar="RATE",
                     help="the link's line rate for the report and plot, e.g. 1gbit or 12.5GB/s "
                     "(default: the speed the OS reports for the interface, when it knows)")  # fmt: skip


def _integer(text: str, flag: str) -> int:
    from phalanx.errors import SettingsRefused

    try:
        return int(text)
    except ValueError:
        raise SettingsRefused(f"{flag} {text!r} is not a whole number", hint=f"for example {flag} 20") from None


def collective_settings_from_args(args: argparse.Namespace) -> Any:
    from phalanx.bench.collective_settings import (
        CollectiveSettings,
        parse_collectives,
        parse_dtype,
        parse_op,
        parse_size,
    )

    return CollectiveSettings(
        collectives=parse_collectives(args.collective),
        min_bytes=parse_size(args.minbytes, "-b"),
        max_bytes=parse_size(args.maxbytes, "-e"),
        step_factor=_integer(args.stepfactor, "-f"),
        step_bytes=parse_size(args.stepbytes, "-i"),
        iters=_integer(args.iters, "-n"),
        warmup_iters=_integer(args.warmup_iters, "-w"),
        check=_integer(args.check, "-c"),
        dtype=parse_dtype(args.datatype),
        op=parse_op(args.op),
        root=_integer(args.root, "-r"),
        average=_integer(args.average, "-a"),
        corrupt=_integer(args.corrupt, "--corrupt"),
    )


def _line_rate(text: str | None) -> float | None:
    from phalanx.bench.link import parse_bandwidth

    return None if text is None else parsed(lambda value: parse_bandwidth(value, name="--line-rate"), text)


def _world(setups: list[Any]) -> tuple[str, int]:
    """The launched job's backend and process count: the same on every node."""
    return setups[0].backend, setups[0].nnodes_max * setups[0].nproc_per_node


def _show(outcome: Any, args: argparse.Namespace, format_report: Any, plot: Any) -> bool:
    """Prints rank 0's report (JSON or the table) and draws the plot; False when this node has none."""
    import json

    from phalanx.console import say

    if outcome.report is None:
        if outcome.exit_code == 0 and not args.dry_run:
            say("phalanx: the report is printed by the node that ran global rank 0 (and kept in its --log-dir)")
        return False
    print(json.dumps(outcome.report, indent=1) if args.json else format_report(outcome.report))
    if args.plot:
        plot(outcome.report, args.plot)
        say(f"phalanx: plot written to {args.plot}")
    return True


def run_collectives(args: argparse.Namespace) -> int:
    from phalanx.bench.collective_report import format_report, total_wrong
    from phalanx.bench.plot import check_plot_path, plot_busbw
    from phalanx.exit_codes import ExitCode
    from phalanx.launch.tool import run_tool

    settings = collective_settings_from_args(args)
    line_rate = _line_rate(args.line_rate)
    if args.plot:
        check_plot_path(args.plot)
    outcome = run_tool(
        args,
        "phalanx.bench.collectives_worker",
        {"collectives": settings.to_dict(), "line_rate": line_rate},
        lambda setups: settings.check_world(*_world(setups)),
    )
    if _show(outcome, args, format_report, plot_busbw) and total_wrong(outcome.report):
        return ExitCode.FAILED
    return outcome.exit_code


def _add_ddp_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what to measure")
    add = group.add_argument
    add("--model", default="all", metavar="NAMES", help=f"{', '.join(MODELS)}, comma-separated, or all (default all)")
    add(
        "--compression",
        default="all",
        metavar="NAMES",
        help="none, fp16, bf16, powersgd, comma-separated, or all that the backend can run (default all)",
    )
    add(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        default="32",
        metavar="N",
        help="samples per process per step (default 32)",
    )
    add("--steps", default="20", metavar="N", help="timed rounds; every time is a median over them (default 20)")
    add(
        "--warmup-steps",
        "--warmup_steps",
        dest="warmup_steps",
        default="3",
        metavar="N",
        help="untimed rounds first (default 3; powersgd: at least 3)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    out.add_argument("--plot", default=None, metavar="PNG", help="also draw samples/s per model and compression into this PNG "
                     "(needs matplotlib)")  # fmt: skip


def ddp_settings_from_args(args: argparse.Namespace) -> Any:
    from phalanx.bench.ddp_settings import DdpSettings, parse_compressions, parse_models

    compressions, skip_unsupported = parse_compressions(args.compression)
    return DdpSettings(
        models=parse_models(args.model),
        compressions=compressions,
        skip_unsupported=skip_unsupported,
        batch_size=_integer(args.batch_size, "--batch-size"),
        steps=_integer(args.steps, "--steps"),
        warmup_steps=_integer(args.warmup_steps, "--warmup-steps"),
    )


def run_ddp(args: argparse.Namespace) -> int:
    from phalanx.bench.ddp_report import format_report
    from phalanx.bench.plot import check_plot_path, plot_ddp_throughput
    from phalanx.launch.tool import run_tool

    settings = ddp_settings_from_args(args)
    if args.plot:
        check_plot_path(args.plot)
    outcome = run_tool(
        args, "phalanx.bench.ddp_worker", {"ddp": settings.to_dict()}, lambda setups: settings.runnable(*_world(setups))
    )
    _show(outcome, args, format_report, plot_ddp_throughput)
    return outcome.exit_code
