"""The batch script of `phalanx slurm`: its directives, and bash that parses (the real cluster
tests run it under sbatch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.cli.main import build_parser
from phalanx.errors import SettingsRefused
from phalanx.jobs.slurm.job import job_from_args
from phalanx.jobs.slurm.sbatch import SlurmJob, check_time_limit, render
from phalanx.settings.values import NodeRange


def job_of(tmp_path, monkeypatch, *argv):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.chdir(tmp_path)
    return job_from_args(build_parser().parse_args(["slurm", *argv, str(script), "--epochs", "3"]))


def test_directives_and_the_command_every_node_runs(tmp_path, monkeypatch):
    job = job_of(tmp_path, monkeypatch, "--nnodes", "2", "--nproc-per-node", "4", "--gpus-per-node", "4", "--time",
                 "4:00:00", "--partition", "gpu", "--max-restarts", "1", "--sbatch=--mem=64G")  # fmt: skip
    text = render(job)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4", "#SBATCH --time=4:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --open-mode=append", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", f"#SBATCH --chdir={tmp_path}", "#SBATCH --output=phalanx-logs/slurm-%j.out",
                 "#SBATCH --mem=64G", "MAX_REQUEUES=3", "requeued=${SLURM_RESTART_COUNT:-0}", "trap pass_on USR1",
                 'scontrol requeue "$SLURM_JOB_ID"'):  # fmt: skip
        assert line in text, line
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 ")
    assert (
        f"{sys.executable} -m phalanx run --nproc-per-node 4 --max-restarts 1 {tmp_path}/train.py --epochs 3 &" in srun
    )
    assert "--nnodes" not in srun  # SLURM's variables give every node the node count
    assert subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True).returncode == 0


def test_an_elastic_node_range_asks_slurm_for_a_range(tmp_path, monkeypatch):
    assert "#SBATCH --nodes=2-4" in render(job_of(tmp_path, monkeypatch, "--nnodes", "2:4"))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--simulate-nodes", "2"], "--simulate-nodes with phalanx slurm (from --simulate-nodes)"),
        (["--standalone"], "--standalone with phalanx slurm"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1, not 0"),
        (["--max-requeues", "-1"], "--max-requeues must be at least 0, not -1"),
        (["--time", "four hours"], "not a SLURM time limit"),
    ],
)
def test_settings_that_cannot_make_a_slurm_job_are_refused(tmp_path, monkeypatch, argv, words):
    with pytest.raises(SettingsRefused) as refused:
        job_of(tmp_path, monkeypatch, *argv)
    assert words in refused.value.what and refused.value.hint


def test_a_simulation_set_by_a_variable_every_node_would_inherit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_SIMULATE_NODES", "2")
    with pytest.raises(SettingsRefused, match=r"--simulate-nodes with phalanx slurm \(from PHALANX_SIMULATE_NODES=2\)"):
        job_of(tmp_path, monkeypatch)


@pytest.mark.parametrize("text", ["30", "30:00", "4:00:00", "2-00", "2-12:00", "1-00:00:00"])
def test_slurm_time_formats(text):
    assert check_time_limit(text) == text


def test_requeue_budget_and_lead_are_written(tmp_path):
    job = SlurmJob(["phalanx", "run", "t.py"], NodeRange(2, 2), "t", str(tmp_path), "o.out", signal_lead_s=300,
                   max_requeues=7)  # fmt: skip
    text = render(job)
    assert "#SBATCH --signal=B:USR1@300" in text and "MAX_REQUEUES=7" in text


def test_an_argument_with_a_line_break_stays_inside_the_script_s_comment_and_quotes(tmp_path, monkeypatch):
    """The script's first comment repeats the command line: a script argument's line break must
    not end the comment (the next line would run as a command)."""
    import subprocess

    from phalanx.jobs.slurm.sbatch import SlurmJob, render
    from phalanx.settings.values import NodeRange

    job = SlurmJob(run_command=["python", "-m", "phalanx", "run", "train.py", "--note", "a\nb"], nodes=NodeRange(1, 1),
                   job_name="train", workdir=str(tmp_path), output="slurm-%j.out",
                   written_by="phalanx slurm train.py --note 'a\nb'")  # fmt: skip
    text = render(job)
    header = text.split("#SBATCH", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines()), header
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # the whole script parses
