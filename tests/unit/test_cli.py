"""The command line as a user meets it: help, refusals and their exit codes, import cost."""

import re
import subprocess
import sys

import pytest

from phalanx.cli.main import main


def test_help_and_cheap_imports():
    # `phalanx --help` and `phalanx run --help` must not load torch (let alone torch.distributed.run).
    for argv in (["--help"], ["run", "--help"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "phalanx", *argv], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0
        imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
        assert "phalanx.cli.main" in imported
        assert not [name for name in imported if name == "torch" or name.startswith("torch.")]
    assert "--simulate-nodes" in result.stdout and "Exit codes" in result.stdout


@pytest.mark.parametrize(
    "argv, says",
    [
        (["run", "--nnodes", "2", "--rdzv-endpoint", "localhost:29400", "SCRIPT"], "is a loopback address"),
        (["run", "--nnodes", "2", "--standalone", "SCRIPT"], "--standalone with --nnodes 2"),
        (["run", "--rdzv-endpoint", "10.0.0.1:99999", "SCRIPT"], "from 1 to 65535"),
        (["run", "--nnodes", "3:1", "SCRIPT"], "larger than the maximum"),
        (["run", "missing_script.py"], "does not exist"),
        (["run", "--interface", "nosuch9", "SCRIPT"], "no network interface of that name"),
    ],
)
def test_refusals_exit_2_with_a_hint(argv, says, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    argv = [str(script) if arg == "SCRIPT" else arg for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx: error: ") and says in err
    assert "\nHINT: " in err


@pytest.mark.parametrize(
    "argv, usage, says",
    [
        (["run", "--nproc-per-ndoe", "2", "SCRIPT"], "usage: phalanx run ", "(did you mean --nproc-per-node?)"),
        # an abbreviation is refused too, not taken: a new flag would change what it means
        (["run", "--nproc", "2", "SCRIPT"], "usage: phalanx run ", "--nproc (did you mean --nproc-per-node?)"),
        (["doctor", "--simulate-nodez", "2"], "usage: phalanx doctor ", "-nodez 2 (did you mean --simulate-nodes?)"),
        (["bench", "collectives", "--colective", "x"], "usage: phalanx bench collectives ", "(did you mean --collecti"),
        (["env", "--jsn"], "usage: phalanx env ", "--jsn (did you mean --json?)"),
        # a flag cut short: its whole name, not a near short one (--cpu)
        (["k8s", "--image", "i", "--gpus", "4", "SCRIPT"], "usage: phalanx k8s ", "(did you mean --gpus-per-node?)"),
        (["slurm", "--gpus", "4", "SCRIPT"], "usage: phalanx slurm ", "(did you mean --gpus-per-node?)"),
        # a command's own flag given before its name, and a stray dash, which starts every flag
        (
            ["bench", "--json", "collectives"],
            "usage: phalanx bench collectives ",
            "--json (--json is an option of phalanx bench collectives: give it after 'collectives')",
        ),
        (["env", "-"], "usage: phalanx env ", "unrecognized arguments: -\n"),
        (["--bogus"], "usage: phalanx ", "unrecognized arguments: --bogus\n"),
        # before the command: the top level's, not the command's
        (["--versio", "run", "SCRIPT"], "usage: phalanx [-h]", "--versio (did you mean --version?)\n"),
    ],
)
def test_an_unknown_flag_gets_its_commands_usage_and_the_nearest_flag(argv, usage, says, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main([str(script) if arg == "SCRIPT" else arg for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and says in err, err


def test_a_hidden_spelling_is_never_suggested(capsys):
    # --nproc_per_node (torchrun's spelling) and the refused torchrun flags (--node-rank) stay out of
    # --help, and so out of the suggestions
    assert main(["run", "--nproc_per_nod", "2", "x.py"]) == 2
    assert main(["run", "--node-ranc", "x.py"]) == 2
    first, second = capsys.readouterr().err.split("usage: ")[1:]
    assert "--nproc_per_nod (did you mean --nproc-per-node?)" in first, first
    assert "unrecognized arguments: --node-ranc" in second and "rank" not in second.split("--node-ranc")[1], second


def test_every_exit_code_is_in_help_and_in_the_readme():
    from pathlib import Path

    from phalanx.exit_codes import ExitCode, summary

    def words(text: str) -> str:
        return " ".join(text.split())

    said = words(summary())
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for code in ExitCode:
        if code != ExitCode.INTERRUPTED:  # a signal's: 128+N
            assert f", {int(code)} " in said or said.startswith(f"Exit codes: {int(code)} "), code
            assert f"\n| {int(code)} | " in readme, code
    for argv in (["--help"], ["run", "--help"]):
        shown = subprocess.run([sys.executable, "-m", "phalanx", *argv], capture_output=True, text=True, timeout=60)
        assert said in words(shown.stdout), argv


def test_help_prose_is_refilled_to_the_terminal_and_examples_are_kept():
    import argparse

    from phalanx.cli import HelpFormatter

    text = (
        "A paragraph of prose written for a wider terminal, one line of it far longer than sixty columns.\n"
        "Its second line.\n"
        "\n"
        "  - a list item that is too long for sixty columns and so wraps under its own text\n"
        "    with its continuation\n"
        "  term         a definition that is also far too long for a terminal of sixty\n"
        "               columns, run on\n"
        "    phalanx run --nnodes 2 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29400 train.py\n"
        "  phalanx doctor --nnodes 2 --rdzv-endpoint 10.0.0.1:29400   (on every node)\n"
    )
    filled = HelpFormatter("prog", width=60)._fill_text(text, 60, "")
    lines = filled.splitlines()
    assert lines[0].startswith("A paragraph") and lines[1].endswith("columns. Its second line.") and lines[2] == "", (
        filled
    )
    assert (
        "  - a list item that is too long for sixty columns and so\n    wraps under its own text with its continuation"
        in filled
    )
    assert (
        "  term         a definition that is also far too long for a\n               terminal of sixty columns, run on"
        in filled
    )
    assert "\n    phalanx run --nnodes 2 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29400 train.py\n" in filled
    assert filled.endswith("\n  phalanx doctor --nnodes 2 --rdzv-endpoint 10.0.0.1:29400   (on every node)")
    assert isinstance(HelpFormatter("prog"), argparse.HelpFormatter)


@pytest.mark.parametrize("command", [[], ["run"], ["launch"], ["slurm"], ["k8s"], ["env"], ["doctor"], ["plan"], ["bench"],
                                     ["bench", "ddp"], ["bench", "collectives"], ["testbed"]])  # fmt: skip
def test_every_help_fits_80_columns_but_example_lines(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*command, "--help"]) == 0
    wide = [line for line in capsys.readouterr().out.splitlines() if len(line) > 80]
    assert all(re.match(r"\s+phalanx ", line) for line in wide), wide  # example commands only
