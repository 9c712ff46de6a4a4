"""``phalanx``: multi-node synchronous data-parallel training with PyTorch.

Commands:
  run     launch a training script on one or many nodes (torchrun's vocabulary)
  launch  run a training script on several hosts over ssh, after checking every host
  slurm   write or submit a SLURM batch script: one phalanx run per node, requeue on preemption
  k8s     write Kubernetes manifests (Indexed Job, Kubeflow TrainJob or PyTorchJob): phalanx run in every pod
  env     this machine's report: versions, GPUs, network, limits, launch settings, known traps
  doctor  check nodes and network before training: a comparison, measurements, a verdict
  bench   measure collectives as nccl-tests does, and DDP training throughput
  plan    predict the all-reduce time a step for a model, layout and link, with each compression
  testbed several hosts on this machine (network namespaces): rehearse, shape and cut links

Every command exits with one of :class:`phalanx.exit_codes.ExitCode` (``phalanx --help`` lists them).
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
from typing import Any, NoReturn

from phalanx import __version__, exit_codes
from phalanx.cli import HelpFormatter, bench, doctor, env, k8s, launch, plan, run, slurm, testbed
from phalanx.errors import PhalanxError
from phalanx.quick_exit import exit_quickly
from phalanx.settings.options import refuse_torchrun_flags


class _Parser(argparse.ArgumentParser):
    """phalanx's parser and each command's. Its flags are never abbreviated (a new flag would change what an
    abbreviation means), and a flag it does not know is refused with its own usage and the
    nearest flag it has, not with the top-level usage that argparse gives."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)
        self.set_defaults(command_parser=self)  # the innermost command's wins

    def refuse_unknown(self, unknown: list[str]) -> NoReturn:
        shown = [flag for action in self._actions if action.help != argparse.SUPPRESS for flag in action.option_strings]
        given = unknown[0].partition("=")[0]
        if given in shown:  # given before a command's name (phalanx bench --json collectives)
            self.error(f"unrecognized arguments: {' '.join(unknown)} ({given} is an option of {self.prog}: give it "
                       f"after {self.prog.split()[-1]!r})")  # fmt: skip
        # a flag cut short (--gpus for --gpus-per-node) first: difflib ranks it below a short neighbour (--cpu)
        near = [flag for flag in shown if flag.startswith(given)][:3] or difflib.get_close_matches(given, shown, n=1)
        if len(given.lstrip("-")) < 2:
            near = []  # a stray "-" or "--" looks like every flag
        said = f" (did you mean {' or '.join(near)}?)" if near else ""
        self.error(f"unrecognized arguments: {' '.join(unknown)}{said}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="phalanx",
        description="Multi-node synchronous data-parallel training with PyTorch, on torchrun, that starts "
        "the first time. Start with: phalanx run --help",
        epilog=exit_codes.summary(),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in (run, launch, slurm, k8s, env, doctor, bench, plan, testbed):
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        try:
            argv = sys.argv[1:] if argv is None else argv
            args, unknown = parser.parse_known_args(argv)
            if unknown:  # those before the command are the top level's, not the command's
                before = argv[: argv.index(args.command)] if args.command in argv else argv
                mine = [argument for argument in unknown if argument in before]
                (parser if mine else args.command_parser).refuse_unknown(mine or unknown)
        except SystemExit as exit_:  # --help, --version, argparse's refusals: flushed where a closed pipe is caught
            sys.stdout.flush()
            return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
        if args.command is None:
            parser.print_help()
            return 2
        refuse_torchrun_flags(args)
        code = int(args.handler(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return code
    except PhalanxError as error:
        print(error.render(), file=sys.stderr)
        return int(error.exit_code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`phalanx env | head`): the rest is not wanted, and
        # the exit's own flush must not fail again. As a shell reports a process that SIGPIPE ended.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def run_command() -> NoReturn:
    """The ``phalanx`` command (and ``python -m phalanx``): :func:`main`, then a quick exit."""
    exit_quickly(main())


if __name__ == "__main__":
    run_command()
