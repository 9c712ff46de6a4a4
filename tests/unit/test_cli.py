"""The command line as a user meets it: help, refusals and their exit codes, import cost."""

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
