"""Bad input beyond the launch options: what a newcomer mistypes in each command's own flags,
settings that contradict each other, torchrun's flags, files of the wrong kind. (Every launch
option's bad values, in every command and every way of giving them, and the config files that
cannot be read, are generated from the option table: tests/unit/test_option_matrix.py.)

Each case runs the command line in this process and checks that the input was refused as the
README promises: a message that says what was set (the words given), a HINT, the documented exit
code (2), and no process left behind. The cases that need a file get one in the test's folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys

import psutil
import pytest

from phalanx.cli.main import build_parser, main

#: name of a file in the test's folder -> its text (bytes: written as they are)
FILES = {
    "train.py": "",
    "run_not_a_table.toml": "run = 3\n",
    "hosts_typo.txt": "gpu1 slot=4\n",
    "hosts_twice.txt": "gpu1 slots=2\ngpu1 slots=2\n",
    "hosts_empty.txt": "# nobody\n",
    "doctor.json": "{not json",
}

CASES: list[tuple[str, list[str], str]] = [
    # -- phalanx run: each launch setting -------------------------------------------------------
    ("endpoint public", ["run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "8.8.8.8", "train.py"],
     "8.8.8.8 is a globally routable address"),
    ("endpoint loopback, several nodes", ["run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1", "train.py"],
     "loopback"),
    ("interface lo, several nodes", ["run", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "192.0.2.7", "--interface",
                                     "lo", "train.py"], "--interface lo is the loopback interface"),
    ("simulate with nnodes", ["run", "--simulate-nodes", "2", "--nnodes", "3", "train.py"],
     "--simulate-nodes 2 with --nnodes 3"),
    ("standalone with nnodes", ["run", "--standalone", "--nnodes", "2", "train.py"], "--standalone with --nnodes 2"),
    # -- torchrun's flags that phalanx does not take, in both spellings ------------------------
    *((f"torchrun's {argv[0]}", ["run", *argv, "train.py"], f"{argv[0].split('=')[0]} is torchrun's: phalanx does not take it")
      for argv in (["--no-python"], ["--node-rank", "1"], ["--node_rank=1"], ["--master-addr", "10.0.0.1"],
                   ["--master_port", "29500"], ["--rdzv-backend", "c10d"], ["--local-addr", "10.0.0.2"], ["--tee", "3"],
                   ["--redirects", "3"], ["--local-ranks-filter", "0"], ["--rdzv-conf", "timeout=9"],
                   ["--start-method", "fork"], ["--role", "trainer"])),
    # all of them at once, not one refusal per try
    ("torchrun's flags together", ["run", "--node_rank=0", "--master_addr=10.0.0.1", "--master_port=29500", "train.py"],
     "--node_rank, --master_addr, --master_port are torchrun's: phalanx does not take them"),
    ("torchrun's flag in phalanx slurm", ["slurm", "--master-port", "29500", "train.py"], "--rdzv-endpoint HOST:PORT"),
    ("several nodes, no endpoint", ["run", "--dry-run", "--nnodes", "2", "train.py"], "--nnodes 2 without --rdzv-endpoint"),
    ("script missing", ["run", "missing.py"], "the training script 'missing.py' does not exist"),
    ("module missing", ["run", "-m", "no.such.module"], "module 'no.such.module' (given with -m) cannot be found"),
    ("no script", ["run"], "no training script given"),
    # -- the config file ------------------------------------------------------------------------
    ("config run not a table", ["run", "--config", "run_not_a_table.toml", "train.py"], "'run' must be a table"),
    # -- phalanx doctor -------------------------------------------------------------------------
    ("doctor nnodes zero", ["doctor", "--nnodes", "0"], "--nnodes 0: a job needs at least 1 node"),
    ("doctor nproc zero", ["doctor", "--nproc-per-node", "0"], "--nproc-per-node 0"),
    ("doctor simulate zero", ["doctor", "--simulate-nodes", "0"], "--simulate-nodes must be at least 1"),
    ("doctor join timeout", ["doctor", "--join-timeout", "-3"], "--join-timeout -3 is not a positive number of seconds"),
    # -- phalanx bench --------------------------------------------------------------------------
    ("bench iterations zero", ["bench", "collectives", "--iters", "0"], "-n 0: must be at least 1"),
    ("bench warmup negative", ["bench", "collectives", "--warmup_iters", "-1"], "-w -1: must be at least 0"),
    ("bench collective unknown", ["bench", "collectives", "--collective", "all_nothing"], "all_nothing"),
    ("bench datatype unknown", ["bench", "collectives", "--datatype", "int3"], "int3"),
    ("bench op unknown", ["bench", "collectives", "--op", "xor"], "xor"),
    ("bench sizes reversed", ["bench", "collectives", "-b", "1M", "-e", "1K"], "-b 1048576 is larger than -e 1024"),
    ("bench size word", ["bench", "collectives", "-b", "lots"], "lots"),
    ("bench ddp model unknown", ["bench", "ddp", "--model", "nope"], "--model 'nope': unknown model nope"),
    ("bench ddp compression unknown", ["bench", "ddp", "--compression", "zip"], "zip"),
    ("bench ddp steps zero", ["bench", "ddp", "--steps", "0"], "--steps"),
    # -- phalanx plan ---------------------------------------------------------------------------
    ("plan model path", ["plan", "--model", "nope"], "--model 'nope' is not an import path with a ':'"),
    ("plan params word", ["plan", "--params", "x"], "--params 'x' is not a parameter count"),
    ("plan bandwidth word", ["plan", "--params", "25M", "--nnodes", "2", "--bandwidth", "fast"],
     "--bandwidth 'fast' is not a bandwidth"),
    ("plan latency word", ["plan", "--params", "25M", "--nnodes", "2", "--bandwidth", "10gbit", "--latency", "soon"],
     "soon"),
    ("plan no bandwidth", ["plan", "--params", "25M", "--nnodes", "2"], "--nnodes 2 needs the network's bandwidth"),
    ("plan bandwidth for one node", ["plan", "--params", "25M", "--bandwidth", "10gbit"], "--bandwidth with --nnodes 1"),
    ("plan doctor report broken", ["plan", "--params", "25M", "--nnodes", "2", "--from-doctor", "doctor.json"],
     "--from-doctor doctor.json is not JSON"),
    ("plan doctor report missing", ["plan", "--params", "25M", "--nnodes", "2", "--from-doctor", "none.json"],
     "--from-doctor none.json: the file does not exist"),
    # -- phalanx launch, slurm, k8s, testbed ------------------------------------------------------
    ("launch hostfile typo", ["launch", "--hostfile", "hosts_typo.txt", "train.py"], "'slot=4' is not understood"),
    ("launch hostfile twice", ["launch", "--hostfile", "hosts_twice.txt", "train.py"], "gpu1 is named twice"),
    ("launch hostfile empty", ["launch", "--hostfile", "hosts_empty.txt", "train.py"], "names no host"),
    ("launch slots disagree", ["launch", "--hosts", "a:2,b:2", "--nproc-per-node", "4", "train.py"],
     "--nproc-per-node is 4, but the host list gives slots"),
    ("launch ipv6 host", ["launch", "--hosts", "fe80::1,b", "train.py"], "looks like an IPv6 address"),
    ("slurm simulate", ["slurm", "--simulate-nodes", "2", "train.py"], "--simulate-nodes with phalanx slurm"),
    ("slurm time limit", ["slurm", "--time", "forever", "train.py"], "forever"),
    # -- text written into the batch script: each name flag, each character that breaks it ----------
    *((f"slurm {flag} with {what}", ["slurm", f"{flag}={value}", "train.py"], f"{flag} {value!r} cannot be written")
      for flag in ("--job-name", "--partition", "--account")
      for what, value in (("a space", "a b"), ("a newline", "a\nb"), ("a quote", "a'b"), ("a slash", "a/b"),
                          ("nothing", ""))),
    ("slurm --sbatch of two lines", ["slurm", "--sbatch=--mem=1G\n--exclusive", "train.py"], "is not one #SBATCH option"),
    ("slurm --sbatch not an option", ["slurm", "--sbatch=mem=1G", "train.py"], "is not one #SBATCH option"),
    ("k8s no image", ["k8s", "train.py"], "--image"),
    ("k8s unknown kind", ["k8s", "--image", "x:1", "--kind", "deployment", "train.py"], "deployment"),
    ("testbed unknown bed", ["testbed", "exec", "--name", "nobed", "h1", "--", "true"],
     "there is no test bed named 'nobed'"),
]  # fmt: skip


@pytest.fixture
def folder(tmp_path, monkeypatch):
    for name, text in FILES.items():
        if isinstance(text, bytes):
            (tmp_path / name).write_bytes(text)
        else:
            (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT", "300")  # nothing inherited changes the answers
    return tmp_path


def test_every_case_has_a_name_of_its_own():
    assert len({name for name, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_refused_with_what_why_and_a_hint(folder, argv, words):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own refusals (a choice that does not exist)
            code = exit_.code
    said = err.getvalue()
    assert code == 2, said
    assert words in said, said
    assert "phalanx: error:" in said or "error: argument" in said, said
    if "phalanx: error:" in said:
        assert "\nHINT: " in said, said  # phalanx's own refusals say what to do
    assert out.getvalue() == "", out.getvalue()  # nothing that looks like a result
    assert psutil.Process().children(recursive=True) == []  # nothing left running


#: A command line of each command that writes to its output, by command (and verb).
OUTPUT_LINES = {
    "run": ["--dry-run", "--simulate-nodes", "2", "train.py"],
    "slurm": ["train.py"],
    "k8s": ["--image", "registry.example.com/train:1", "train.py"],
    "env": ["--json"],
    "doctor": ["--dry-run"],
    "bench collectives": ["--dry-run"],
    "bench ddp": ["--dry-run"],
    "plan": ["--params", "25M", "--nnodes", "2", "--nproc-per-node", "2", "--bandwidth", "1gbit"],
}
#: Commands whose output needs what this test does not make, and where that output is tested.
OUTPUT_ELSEWHERE = {
    "launch": "its output is the hosts', over a real sshd (tests/netns/test_ssh_launch.py)",
    **{f"testbed {verb}": "needs root and a bed (tests/netns/test_testbed.py)"
       for verb in ("up", "shape", "cut", "restore", "exec", "status", "down")},
}  # fmt: skip


def leaf_commands(parser: argparse.ArgumentParser, command: str = "") -> list[str]:
    """Every command and verb of the parser, as typed: "run", "bench ddp", "testbed up"."""
    found = []
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += leaf_commands(sub, f"{command} {name}".strip())
    return found or [command]


def test_every_command_s_output_into_a_closed_pipe_is_tested():
    assert set(leaf_commands(build_parser())) == set(OUTPUT_LINES) | set(OUTPUT_ELSEWHERE)


@pytest.mark.parametrize(
    "argv",
    [[*command.split(), *line] for command, line in OUTPUT_LINES.items()] + [["env"], ["run", "--help"]],
    ids=[*OUTPUT_LINES, "env table", "run help"],
)
def test_output_into_a_closed_pipe_ends_quietly(folder, argv):
    """`phalanx ... | head`: the reader is gone before the command writes (its end of the pipe is
    closed first, so the write fails every time). The shell's code for a SIGPIPE, no traceback.
    --help too: argparse writes it before it exits."""
    read, write = os.pipe()
    os.close(read)
    try:
        buffered = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # as most terminals
        done = subprocess.run([sys.executable, "-m", "phalanx", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=folder, env=buffered)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
