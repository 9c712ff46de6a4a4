"""What each ``phalanx testbed`` verb does, on :mod:`phalanx.testbed.bed`."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.console import format_table, say
from phalanx.errors import SettingsRefused
from phalanx.exit_codes import exit_code_of
from phalanx.testbed.bed import (
    DEFAULT_NAME,
    Shaping,
    TestBed,
    beds,
    build,
    check_can_build,
    link_key,
    state_file,
    tear_down,
)
from phalanx.testbed.together import signal_group


def _shaping(args: argparse.Namespace) -> Shaping:
    return Shaping(args.rate, args.delay, args.loss)


def up(args: argparse.Namespace) -> int:
    bed = build(args.name, [f"h{k}" for k in range(1, args.hosts + 1)], shaping=_shaping(args), subnet=args.subnet,
                data_network=args.data_network, names_on=args.names_on)  # fmt: skip
    print(_table(bed))
    first = bed.hosts[0]
    say(f"phalanx testbed: bed {bed.name!r} is up; this machine reaches it at {bed.bridge_address}\n"
        f"  run in a host   phalanx testbed exec {first.name} -- CMD   (or exec all -- CMD: every host at once)\n"
        f"  a job on all    phalanx testbed exec all -- phalanx run --nnodes {len(bed.hosts)} "
        f"--rdzv-endpoint {first.address} train.py\n"
        f"  remove it       phalanx testbed down{'' if bed.name == DEFAULT_NAME else ' --name ' + bed.name}")  # fmt: skip
    return 0


def shape(args: argparse.Namespace) -> int:
    bed = TestBed.load(args.name)
    bed.shape(_shaping(args), args.host or None, args.network)
    print(_table(bed))
    return 0


def cut(args: argparse.Namespace) -> int:
    bed = TestBed.load(args.name)
    what = f"{args.host} is cut off" + ("" if args.network == "main" else f" from the {args.network} network")
    restore_command = f"phalanx testbed restore {args.host}" + _link_options(args)
    if args.to:
        bed.cut_between(args.host, args.to, args.network)
        what = f"{args.host} and {args.to} are cut from each other on the {args.network} network"
    else:
        bed.cut_link(args.host, args.network)
    if args.seconds is None:
        say(f"phalanx testbed: {what}; `{restore_command}` reconnects {'them' if args.to else 'it'}")
        return 0
    say(f"phalanx testbed: {what} for {args.seconds:g} s (Ctrl-C restores at once)")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.seconds)
    finally:
        _restore(bed, args)
    say(f"phalanx testbed: {f'{args.host} and {args.to} are' if args.to else f'{args.host} is'} back")
    return 0


def restore(args: argparse.Namespace) -> int:
    _restore(TestBed.load(args.name), args)
    return 0


def _restore(bed: TestBed, args: argparse.Namespace) -> None:
    if args.to:
        bed.restore_between(args.host, args.to, args.network)
    else:
        bed.restore_link(args.host, args.network)


def _link_options(args: argparse.Namespace) -> str:
    return (f" --to {args.to}" if args.to else "") + ("" if args.network == "main" else f" --network {args.network}")


def run_in(args: argparse.Namespace) -> int:
    name, command = _split_exec_arguments(args.name, args.command)
    bed = TestBed.load(name)
    if not command:
        raise SettingsRefused("no command to run", hint=f"phalanx testbed exec {args.host} -- CMD [ARGS...]")
    # `phalanx` (and `python`) in the command are this environment's, also under sudo, which resets PATH
    own = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([own, *(d for d in os.environ.get("PATH", "").split(os.pathsep) if d != own)])
    if args.host != "all":
        argv = bed.host(args.host).command(command)
        os.execvp(argv[0], argv)  # the command takes this process's place: its signals, its exit code
    return _run_everywhere(bed, command)


def _split_exec_arguments(name: str, tokens: list[str]) -> tuple[str, list[str]]:
    """``exec HOST [--name BED] -- CMD``: the options between the host and ``--`` are exec's own."""
    if "--" not in tokens:
        return name, tokens
    own, command = tokens[: tokens.index("--")], tokens[tokens.index("--") + 1 :]
    if own and (len(own) != 2 or own[0] != "--name"):
        raise SettingsRefused(
            f"phalanx testbed exec: {' '.join(own)!r} before '--' is not an option of exec",
            hint="phalanx testbed exec HOST [--name BED] -- CMD [ARGS...]",
        )
    return (own[1] if own else name), command


def _run_everywhere(bed: TestBed, command: list[str]) -> int:
    """The command in every host at once, each line prefixed with its host; Ctrl-C stops them all."""
    processes = [subprocess.Popen(host.command(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for host in bed.hosts]  # fmt: skip
    relays = [threading.Thread(target=_relay, args=(host.name, process), daemon=True)
              for host, process in zip(bed.hosts, processes)]  # fmt: skip
    for relay in relays:
        relay.start()

    def stop(signum: int, _frame: object) -> None:  # Ctrl-C or SIGTERM: to every host's command, then wait
        for process in processes:
            signal_group(process, signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [process.wait() for process in processes]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for relay in relays:
        relay.join(timeout=5)
    return next((exit_code_of(code) for code in codes if code != 0), 0)


def _relay(name: str, process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(f"{name}| {line}")
        sys.stdout.flush()


def status(args: argparse.Namespace) -> int:
    if not state_file(args.name).exists():
        others = beds()
        say(f"phalanx testbed: no bed named {args.name!r}" + (f"; beds here: {', '.join(others)}" if others else ""))
        return 0
    print(_table(TestBed.load(args.name)))
    return 0


def down(args: argparse.Namespace) -> int:
    check_can_build()
    removed = tear_down(args.name)
    say(f"phalanx testbed: removed {len(removed)} namespace(s) and link(s) of bed {args.name!r}" if removed
        else f"phalanx testbed: nothing of a bed named {args.name!r} was left")  # fmt: skip
    return 0


def _table(bed: TestBed) -> str:
    rows = []
    for host in bed.hosts:
        (address, link), *data = [_link_cells(bed, host.name, network) for network in bed.networks]
        rows.append(
            [host.name, address, host.namespace, link, *(data[0] if data else ()), len(bed.processes(host.name))]
        )
    header = f"bed {bed.name}: {len(bed.hosts)} host(s) on 10.{bed.subnet}.0.0/24, this machine at {bed.bridge_address}"
    columns = ["host", "address", "namespace", "link"]
    if bed.data_subnet is not None:
        header += f"; data network on 10.{bed.data_subnet}.0.0/24"
        columns += ["data address", "data link"]
    return header + "\n" + format_table([*columns, "processes"], rows)


def _link_cells(bed: TestBed, host: str, network: str) -> tuple[str, str]:
    """A host's address on ``network``, and its link's state: its shape, cut, or cut from some hosts."""
    key = link_key(host, network)
    link = "cut" if key in bed.cut else str(bed.shaping.get(key, Shaping()))
    cut_from = [cut[1 - cut.index(host)] for cut in bed.pair_cuts if cut[2] == network and host in cut[:2]]
    return bed.host(host).link(network)[2], link + (f", cut from {', '.join(cut_from)}" if cut_from else "")


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": up, "shape": shape, "cut": cut, "restore": restore, "exec": run_in, "status": status, "down": down,
}  # fmt: skip
