"""examples/tutorial_phalanx.py, the tutorial's script with phalanx.Run: a stop and a relaunch
end with the same parameters, bit for bit, as an uninterrupted run."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from phalanx.runtime.checkpoint import CheckpointManager
from phalanx.runtime.context import init
from tests.conftest import EXAMPLES, kill_group, phalanx_argv, run_command

pytestmark = pytest.mark.slow
# 16 steps per epoch and rank, 640 in all, a checkpoint every 50: the stop comes mid-epoch.
ARGS = ("--samples", "512", "--image-size", "32", "--epochs", "40", "--batch-size", "16")


def launch(folder: Path) -> list[str]:
    return phalanx_argv("run", "--nproc-per-node", "2", str(EXAMPLES / "tutorial_phalanx.py"), *ARGS,
                        "--checkpoint-dir", str(folder / "ck"))  # fmt: skip


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    latest = CheckpointManager(folder / "ck", init()).load_latest()
    assert latest is not None and latest.step == 640
    return latest.state["model"]


def test_a_stopped_tutorial_run_resumes_to_the_same_parameters(tmp_path):
    (tmp_path / "whole").mkdir()
    whole = run_command(launch(tmp_path / "whole"), timeout=300, cwd=tmp_path / "whole")
    assert whole.returncode == 0, whole.output

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    process = subprocess.Popen(launch(stopped), cwd=stopped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list((stopped / "ck").glob("step-*[0-9]")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        kill_group(process.pid)
    assert process.returncode == 128 + signal.SIGTERM and "preempted by SIGTERM after step" in output, output
    relaunched = run_command(launch(stopped), timeout=300, cwd=stopped)
    assert relaunched.returncode == 0, relaunched.output
    resumed = int(relaunched.output.split("resumed from step ")[1].split()[0])
    assert 50 <= resumed < 640 and resumed % 16, relaunched.output  # mid-epoch
    # The tutorial's own epoch lines: the epoch it resumed in covers the samples since the resume.
    lines = re.findall(r"epoch \d+/\d+  loss \S+  accuracy \S+  \((\d+) samples( since the resume)?", relaunched.output)
    assert lines and lines[0][1] and not any(since for _, since in lines[1:]), relaunched.output
    assert int(lines[0][0]) < int(lines[1][0]), lines
    expected, got = final_model(tmp_path / "whole"), final_model(stopped)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
