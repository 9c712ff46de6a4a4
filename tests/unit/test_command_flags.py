"""The bad-input matrix for each command's own flags, found by walking the command-line parser.

test_option_matrix.py covers the launch options' table. This covers every other flag of every
command (``launch --preflight-timeout``, ``k8s --gpus-per-node``, ``testbed cut --for``,
``bench collectives --minbytes``...). A flag's kind comes from its argparse type
(:class:`phalanx.settings.arguments.Argument`) or, for a value checked after parsing, from its
metavar; each kind has its bad values. A new flag of a known kind gets its cases with nothing to
write; a flag of no kind fails :func:`test_every_flag_has_a_kind_or_is_named_free_text`.

Each case runs the command in this process with a command line that, were the value accepted,
would start nothing (``--dry-run``, a printed script, a pure computation), and must end with exit
code 2, a message that names the flag, a HINT, no traceback and no process left.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections import Counter

import psutil
import pytest

from phalanx.cli.main import build_parser, main
from phalanx.settings.arguments import Argument
from phalanx.settings.options import LAUNCH_OPTIONS
from phalanx.testbed import beds, tear_down

#: Bad values of each kind. A value of a kind checked after parsing is only refused when the
#: command reaches its check; the command lines below make sure that it does.
BAD: dict[str, tuple[str, ...]] = {
    "count": ("-1", "1.5", "nan", "inf", "x", "3 times", ""),
    "seconds": ("-1", "0", "nan", "inf", "1e11", "x", "10 s", ""),
    "size": ("x", "-1", "1.5Q", ""),
    "rate": ("x", "-1", ""),
    "time": ("x", "-1", "nan", ""),
    "delay": ("x", "-1", "5", ""),
    "loss": ("x", "-1", "200%", "5", ""),
    "quantity": ("x", "-1", "a b", ""),
    "name": ("a b", "a\nb", 'a"b', ""),
}
#: The kind of a flag checked after parsing, by its metavar.
KIND_OF_METAVAR = {
    "N": "count",
    "R": "count",
    "COUNT": "count",
    "SIZE": "size",
    "RATE": "rate",
    "TIME": "time",
    "QUANTITY": "quantity",
    "NAME": "name",
}
NETWORK_CHOICE = "a choice of the bed's networks, which argparse lists when refusing"
#: Flags whose text another program judges (ssh, sbatch, the container runtime, Python's import)
#: or that name files and choices checked by tests of their own: no kind of bad values applies.
FREE_TEXT = {
    "launch --hosts": "host names, checked by the preflight over ssh (test_ssh_launch.py)",
    "launch --hostfile": "a file, read and refused by test_ssh_launch.py's cases",
    "launch --ssh-config": "ssh's own config file, given to ssh -F",
    "launch --ssh-option": "ssh -o options, judged by ssh",
    "launch --remote-python": "a path on the other hosts, checked by the preflight",
    "launch --env": "NAME[=VALUE], checked by test_ssh_launch.py",
    "slurm --sbatch": "an #SBATCH line, checked by test_bad_input.py's slurm cases",
    "k8s --image": "an image reference, checked by test_k8s_manifests.py",
    "k8s --kind": "a choice, checked by test_k8s_manifests.py",
    "k8s --env": "NAME=VALUE, checked by test_k8s_manifests.py",
    "k8s --volume": "CLAIM:PATH, checked by test_k8s_manifests.py",
    "k8s --output": "a folder the manifests are written to, checked by test_k8s_manifests.py",
    "bench collectives --collective": "names from a list, checked by test_bench_settings.py",
    "bench collectives --datatype": "a choice, checked by test_bench_settings.py",
    "bench collectives --op": "a choice, checked by test_bench_settings.py",
    "bench collectives --root": "a rank, checked against the world size by test_bench_settings.py",
    "bench collectives --average": "a choice, checked by test_bench_settings.py",
    "bench collectives --plot": "an output file",
    "bench ddp --model": "names from a list, checked by test_bench_settings.py",
    "bench ddp --compression": "names from a list, checked by test_bench_settings.py",
    "bench ddp --plot": "an output file",
    "plan --model": "MODULE:FACTORY, imported",
    **{
        f"testbed {verb}": NETWORK_CHOICE
        for verb in ("up --names-on", "shape --network", "cut --network", "restore --network")
    },
    **{
        f"testbed {verb} --to": "a host of the bed, refused by TestBed.host (test_testbed.py)"
        for verb in ("cut", "restore")
    },
    "plan --from-doctor": "a doctor report, checked by test_cost_model.py",
}
#: What each command needs besides the flag under test, so that the flag's check is reached and
#: an accepted value would start nothing. The flag under test comes last: argparse keeps it.
COMMAND_LINES = {
    "launch": ["--hosts", "h1,h2", "--dry-run", "train.py"],
    "slurm": ["train.py"],
    "k8s": ["--kind", "indexed-job", "--image", "registry.example.com/train:1", "train.py"],
    "doctor": ["--dry-run"],
    "bench collectives": ["--dry-run"],
    "bench ddp": ["--dry-run"],
    "plan": ["--params", "1e6", "--nnodes", "2", "--nproc-per-node", "2", "--bandwidth", "1gbit"],
    "testbed up": ["--hosts", "2"],
}
#: The bed an accepted `testbed up` value would build: removed after each case.
BED = "tflags"
LAUNCH_FIELDS = {option.field for option in LAUNCH_OPTIONS} | {"config"}


def command_flags() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every flag with a value, of every command and verb, but the launch
    options' (test_option_matrix.py) and torchrun's that phalanx answers (test_bad_input.py)."""
    found = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:  # argparse has no public list of a parser's actions
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif action.option_strings and action.nargs != 0 and action.help != argparse.SUPPRESS:
                launch_option = action.dest in LAUNCH_FIELDS and "--rdzv-endpoint" in parser._option_string_actions
                if not launch_option and action.dest != "config":  # env's --config: test_option_matrix.py
                    found.append((command, action))

    walk(build_parser(), "")
    return found


FLAGS = command_flags()


def kind_of(action: argparse.Action) -> str | None:
    if isinstance(action.type, Argument):
        return action.type.kind
    return KIND_OF_METAVAR.get(action.metavar or "")


def flag_of(command: str, action: argparse.Action) -> str:
    return f"{command} {max(action.option_strings, key=len)}"


CASES = [
    (command, tuple(action.option_strings), kind_of(action), value)
    for command, action in FLAGS
    if kind_of(action) is not None
    for value in BAD[kind_of(action)]
]


def test_every_flag_has_a_kind_or_is_named_free_text():
    kindless = {flag_of(command, action) for command, action in FLAGS if kind_of(action) is None}
    assert kindless == set(FREE_TEXT), "give these a kind (phalanx.settings.arguments) or a line in FREE_TEXT"


def test_no_flag_takes_a_bare_number():
    """type=int or type=float let argparse refuse with no HINT, and let nan, inf and negative
    numbers through: a number is an arguments.count or arguments.seconds."""
    bare = [flag_of(command, action) for command, action in FLAGS if action.type in (int, float)]
    assert bare == []


def test_the_matrix_size_per_kind_and_command():
    by_kind = Counter(kind for _, _, kind, _ in CASES)
    by_command = Counter(command.split()[0] for command, _, _, _ in CASES)
    print(f"MEASURED: {len(CASES)} cases; by kind {dict(by_kind)}; by command {dict(by_command)}")
    assert len({flag for _, flag, _, _ in CASES}) >= 25


@pytest.mark.parametrize("command, flags, kind, value", CASES, ids=[f"{c}-{f[-1]}-{v!r}" for c, f, _, v in CASES])
def test_a_bad_value_of_a_command_s_own_flag_is_refused(command, flags, kind, value, folder):
    flag = max(flags, key=len)
    base = COMMAND_LINES.get(command, [])
    script = base[-1:] if base[-1:] == ["train.py"] else []  # what follows the script is the script's
    argv = [*command.split(), *base[: len(base) - len(script)], f"{flag}={value}", *script]
    if command.startswith("testbed"):
        argv[2:2] = ["--name", BED]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's own refusals
                code = exit_.code
    finally:
        if BED in beds():  # a wrongly accepted value built a bed: nothing may stay
            tear_down(BED)
            pytest.fail(f"{argv} built a test bed")
    said = err.getvalue()
    assert code == 2, said
    assert "phalanx: error:" in said and "\nHINT: " in said, said
    assert any(f"{name} " in said for name in flags), said  # the flag, or its alias (bench names -b as nccl-tests)
    assert "Traceback" not in said, said
    assert psutil.Process().children(recursive=True) == []
