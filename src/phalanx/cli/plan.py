"""``phalanx plan``: predict how long each step's gradient all-reduce takes, with and without compression, before you launch.

Examples:
  the tutorial's 2 nodes x 4 GPUs, a GPT-2-small model (124M), 10 Gbit Ethernet:
    phalanx plan --params 124439808 --nnodes 2 --nproc-per-node 4 --bandwidth 10gbit
  a model from your code (PowerSGD needs its shapes), 2 nodes on a 1 Gbit link:
    phalanx plan --model mymodels:SimpleModel --nnodes 2 --bandwidth 1gbit
  with the link that doctor measured on the cluster:
    phalanx doctor --json > doctor.json
    phalanx plan --params 1.3B --nnodes 8 --nproc-per-node 8 --from-doctor doctor.json
  one node of 8 GPUs (no network: give the intra-node bandwidth):
    phalanx plan --params 1.3B --nproc-per-node 8 --intra-bandwidth 150GB/s

The prediction is the ring all-reduce's cost: t = 2(n-1)/n x S / B + k x 2(n-1) x L for n = nnodes x
nproc-per-node ranks, S bytes a step, k all-reduces a step (DDP's 25 MiB buckets), B the slowest
link's bandwidth and L its latency. With several nodes the slowest link is the network between
them; on one node there is none, and the intra-node transport decides.

Compressions, as phalanx.runtime.model.wrap_model(compression=...) and torch's DDP hooks do them:
none (fp32, 4 B a parameter), fp16 and bf16 (2 B), powersgd (rank-r factors of each gradient
matrix; needs --model, since a count says nothing of shapes).

Model size: --params takes a count (25M, 1.3B, 124439808: K, M, B, T are powers of 1000);
--model takes package.module:factory (called without arguments on torch's meta device, so it
costs no memory) or package.module:attribute (an nn.Module), imported from the current folder.

Bandwidth units are spelled out: 1gbit, 10Gbit/s, 25gbps (bits per second); 12.5GB/s,
1.25GiB/s (bytes per second). 10Gb or 10GBps are refused: a factor of 8 hides in one letter.
Latency: 50us, 0.2ms; default 50 us for a network (TCP through an Ethernet switch) and 10 us
within a node.

The prediction is the all-reduce alone: DDP overlaps it with the backward pass, and
compression costs compute that is not counted. It says which way to look; measure before
you choose. Exit codes: 0 the prediction printed, 2 settings refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phalanx.cli import command_parser
from phalanx.console import say
from phalanx.errors import SettingsRefused
from phalanx.settings.arguments import parsed
from phalanx.settings.values import parse_int, parse_nnodes

DEFAULT_NETWORK_LATENCY = "50us"
DEFAULT_INTRA_NODE_LATENCY = "10us"


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "plan",
        "predict the all-reduce time a step for a model, layout and link, with each compression",
        __doc__,
    )
    model = parser.add_argument_group("the model (one of)")
    model.add_argument("--params", metavar="COUNT", help="trainable parameters: 25M, 1.3B or 124439808")
    model.add_argument("--model", metavar="MODULE:FACTORY", help="package.module:factory or package.module:attribute")
    layout = parser.add_argument_group("the layout (as phalanx run)")
    for flag, text in (("nnodes", "number of nodes (default 1)"), ("nproc-per-node", "processes per node (default 1)")):
        layout.add_argument(f"--{flag}", dest=flag.replace("-", "_"), metavar="N", default="1", help=text)
        if "-" in flag:
            layout.add_argument(f"--{flag.replace('-', '_')}", dest=flag.replace("-", "_"), help=argparse.SUPPRESS)
    link = parser.add_argument_group("the link")
    link.add_argument(
        "--bandwidth", metavar="RATE", help="the slowest inter-node link: 1gbit, 10Gbit/s, 25gbps, 12.5GB/s"
    )
    link.add_argument(
        "--latency",
        metavar="TIME",
        help=f"latency of one message on the link that bounds the ring (default {DEFAULT_NETWORK_LATENCY} "
        f"between nodes, {DEFAULT_INTRA_NODE_LATENCY} within one)",
    )
    link.add_argument(
        "--from-doctor",
        metavar="FILE",
        type=Path,
        help="bandwidth and latency of the slowest link from `phalanx doctor --json`",
    )
    link.add_argument("--intra-bandwidth", metavar="RATE", help="bandwidth within a node (NVLink, PCIe, shared memory)")
    parser.add_argument(
        "--powersgd-rank", metavar="R", default="1", help="PowerSGD's matrix approximation rank (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.set_defaults(handler=plan)


def plan(args: argparse.Namespace) -> int:
    import json

    from phalanx.bench.cost_model import predict, ring_bound
    from phalanx.bench.plan_report import format_report, report_as_dict

    layout = _layout(args)
    powersgd_rank = parsed(lambda value: parse_int(value, minimum=1, name="--powersgd-rank"), args.powersgd_rank)
    network, intra_node = _network_link(args, layout), _intra_node_link(args, layout)
    size = _model_size(args)  # last: --model imports torch and the user's code
    prediction = predict(size, layout, ring_bound(layout, network, intra_node), powersgd_rank)
    print(json.dumps(report_as_dict(prediction), indent=2) if args.json else format_report(prediction))
    return 0


def _layout(args: argparse.Namespace) -> Any:
    from phalanx.bench.cost_model import Layout

    nodes = parsed(parse_nnodes, args.nnodes)
    if nodes.is_elastic:
        raise SettingsRefused(
            f"--nnodes {nodes}: plan predicts one layout, and an elastic job's size changes",
            hint=f"plan each size you expect: --nnodes {nodes.min}, then --nnodes {nodes.max}",
        )
    per_node = parsed(lambda value: parse_int(value, minimum=1, name="--nproc-per-node"), args.nproc_per_node)
    return Layout(nodes.min, per_node)


def _latency(args: argparse.Namespace, default: str, default_origin: str) -> tuple[float, str]:
    from phalanx.bench.link import parse_latency

    if args.latency is not None:
        return parsed(parse_latency, args.latency), f"--latency {args.latency}"
    return parsed(parse_latency, default), f"{default_origin}; set --latency"


def _network_link(args: argparse.Namespace, layout: Any) -> Any:
    from phalanx.bench.link import Link, format_bandwidth, parse_bandwidth, read_doctor_file

    if layout.nnodes == 1:
        given = [
            flag for flag, value in (("--bandwidth", args.bandwidth), ("--from-doctor", args.from_doctor)) if value
        ]
        if given:
            raise SettingsRefused(
                f"{' and '.join(given)} with --nnodes 1",
                "one node has no network between nodes: the ring runs over the intra-node transport.",
                "give --intra-bandwidth for one node, or --nnodes 2 or more to plan over the network",
            )
        return None
    if args.bandwidth is not None and args.from_doctor is not None:
        raise SettingsRefused(
            "--bandwidth and --from-doctor both give the link's bandwidth",
            hint="give one: --bandwidth to plan a link you know, --from-doctor FILE for the one doctor measured",
        )
    if args.from_doctor is not None:
        found = read_doctor_file(args.from_doctor)
        measured = f"measured by phalanx doctor, {args.from_doctor}" + (
            " on simulated nodes: loopback" if found.loopback else ""
        )
        if found.loopback:
            say(f"phalanx: CAUTION: {args.from_doctor} was measured by `phalanx doctor` on simulated nodes of one machine: "
                f"its {format_bandwidth(found.bandwidth_bytes_per_s)} is loopback's, not a network's, so the times below "
                f"are far shorter than {layout.nnodes} real nodes would take\n"
                "HINT: run `phalanx doctor --json` across the real nodes, or give their link with --bandwidth")  # fmt: skip
        if args.latency is None:
            return Link(found.bandwidth_bytes_per_s, found.latency_s, measured, measured)
        latency, latency_origin = _latency(args, DEFAULT_NETWORK_LATENCY, "")
        return Link(found.bandwidth_bytes_per_s, latency, measured, latency_origin)
    if args.bandwidth is None:
        raise SettingsRefused(
            f"--nnodes {layout.nnodes} needs the network's bandwidth",
            "the ring between nodes is bounded by the slowest link between them.",
            "give --bandwidth (e.g. --bandwidth 10gbit), or --from-doctor FILE from `phalanx doctor --json` on the cluster",
        )
    bandwidth = parsed(parse_bandwidth, args.bandwidth)
    latency, latency_origin = _latency(args, DEFAULT_NETWORK_LATENCY, "default for TCP over Ethernet")
    return Link(bandwidth, latency, f"--bandwidth {args.bandwidth}", latency_origin)


def _intra_node_link(args: argparse.Namespace, layout: Any) -> Any:
    from phalanx.bench.link import Link, parse_bandwidth

    if args.intra_bandwidth is None:
        return None
    bandwidth = parsed(lambda value: parse_bandwidth(value, name="--intra-bandwidth"), args.intra_bandwidth)
    if layout.nnodes > 1:
        # Between nodes the network's latency is counted on every ring step (the output says so).
        return Link(bandwidth, 0.0, f"--intra-bandwidth {args.intra_bandwidth}", "not used: the network's applies")
    latency, latency_origin = _latency(args, DEFAULT_INTRA_NODE_LATENCY, "assumed for one node")
    return Link(bandwidth, latency, f"--intra-bandwidth {args.intra_bandwidth}", latency_origin)


def _model_size(args: argparse.Namespace) -> Any:
    from phalanx.bench.model_size import size_from_count, size_from_model

    if (args.params is None) == (args.model is None):
        raise SettingsRefused(
            "give the model's size: --params or --model" if args.params is None else "--params and --model both given",
            "plan needs one of them: a parameter count, or the model itself (which PowerSGD's prediction needs).",
            "for example --params 25M, or --model mymodels:build_model",
        )
    if args.params is not None:
        return parsed(size_from_count, args.params)
    return size_from_model(args.model)
