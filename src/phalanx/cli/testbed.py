"""``phalanx testbed``: several hosts on this machine, for rehearsing a multi-node job.

Examples:
  rehearse a 2-host job over 1 Gbit, and cut one host off for 5 s mid-training:
    phalanx testbed up --hosts 2 --rate 1gbit
    phalanx testbed exec all -- phalanx run --nnodes 2 --rdzv-endpoint 10.200.0.1 examples/train.py
    phalanx testbed cut h2 --for 5            (from another terminal)
    phalanx testbed down

Each host is a network namespace on a bridge, with an address of its own (10.<subnet>.0.<k>;
`up` and `status` print them) and an eth0. Inside a host the other hosts' names resolve to their
addresses, while the machine's hostname resolves to 127.0.0.1 and the host's own name to
127.0.1.1: the /etc/hosts trap of many real clusters. Links can be shaped (rate with tbf;
delay and loss with netem, where the kernel has it) and cut (packets vanish, as with a pulled
cable, until `restore`). This machine reaches every host through the bridge (10.<subnet>.0.254).

With --data-network each host also has an eth1 on a second network, "data" (the next free
10.x.0.0/24), as hosts with a management and a fast network have: --network data shapes, cuts and
restores that network's links alone, --names-on data makes the hosts' names resolve to it, and
`cut H1 --to H2` drops the packets between two hosts only (iptables), the rest of the bed intact.

Everything a bed makes carries its name (--name, default phx): `down` removes it all, also a bed
whose `up` was interrupted, and kills what still runs in its hosts. Needs root.

Exit codes: 0 done (exec: the command's own code; `exec all`: the first failing host's); 2
settings refused (not root, a bed that exists already, an unknown host, netem missing).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from phalanx.cli import command_parser
from phalanx.settings import arguments
from phalanx.testbed.bed import DEFAULT_NAME, NETWORKS, check_name, check_shaping


def add_parser(commands: Any) -> None:
    parser = command_parser(
        commands,
        "testbed",
        "several hosts on this machine (network namespaces): rehearse, shape and cut links",
        __doc__,
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--name",
            default=DEFAULT_NAME,
            type=arguments.Argument("--name", "name", check_name),
            help=f"the bed's name (default {DEFAULT_NAME})",
        )
        return sub

    up = verb("up", "build a bed of K hosts (h1 ... hK)")
    up.add_argument(
        "--hosts", type=arguments.count("--hosts", example=2), required=True, metavar="K", help="how many hosts"
    )
    _shaping_options(up)
    up.add_argument(
        "--subnet",
        type=arguments.count("--subnet", minimum=0, example=200),
        metavar="N",
        help="use 10.N.0.0/24 (default: the first free of 10.200-249)",
    )
    up.add_argument(
        "--data-network",
        action="store_true",
        help="give every host a second network, data (eth1; --rate and the like shape the main network only)",
    )
    up.add_argument(
        "--names-on", choices=NETWORKS, default="main", help="the network the hosts' names resolve to (default main)"
    )
    shape = verb("shape", "shape the links of some hosts (all without HOST)")
    shape.add_argument("host", nargs="*", metavar="HOST")
    _shaping_options(shape)
    _network_option(shape)
    cut = verb(
        "cut",
        "cut a host's link (or, with --to, two hosts from each other): its packets vanish until restore "
        "(or --for seconds)",
    )
    cut.add_argument("host", metavar="HOST")
    _network_option(cut)
    cut.add_argument("--to", metavar="OTHER", help="drop only the packets between HOST and OTHER (iptables)")
    cut.add_argument(
        "--for",
        dest="seconds",
        type=arguments.seconds("--for", example=5),
        metavar="SECONDS",
        help="restore the link after this long",
    )
    restore = verb("restore", "restore a host's cut link (or, with --to, what `cut HOST --to OTHER` cut)")
    restore.add_argument("host", metavar="HOST")
    _network_option(restore)
    restore.add_argument("--to", metavar="OTHER", help="undo `cut HOST --to OTHER`")
    run_in = verb("exec", "run a command in a host (its network, its /etc/hosts); HOST all: in every host at once")
    run_in.add_argument("host", metavar="HOST")
    run_in.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    verb("status", "the bed's hosts, addresses, links and processes")
    verb("down", "remove the bed: kill its processes, delete its namespaces and links")
    parser.set_defaults(handler=run)


def _network_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network", choices=NETWORKS, default="main", help="main (eth0) or data (eth1); default main")


def _shaping_options(parser: argparse.ArgumentParser) -> None:
    helps = {"rate": "link rate, as tc writes it: 1gbit, 100mbit", "delay": "added delay each way, as tc writes it: "
             "1ms (needs netem)", "loss": "packet loss each way: 0.1%% (needs netem)"}  # fmt: skip
    for part, metavar in (("rate", "RATE"), ("delay", "TIME"), ("loss", "PERCENT")):
        parse = functools.partial(check_shaping, part)
        parser.add_argument(
            f"--{part}", type=arguments.Argument(f"--{part}", part, parse), metavar=metavar, help=helps[part]
        )


def run(args: argparse.Namespace) -> int:
    from phalanx.testbed import commands

    return commands.VERBS[args.verb](args)
