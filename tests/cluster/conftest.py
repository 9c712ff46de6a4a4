"""A real two-node SLURM cluster for the tests in this folder: Debian's slurmctld on this
machine and a slurmd in each of two test-bed hosts (phalanx.testbed), started once per module.

Needs root (network namespaces) and SLURM's packages, which `make cluster-deps` installs (CI
runs it); the tests skip, saying which, where either is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx.testbed import slurm, tear_down, test_bed

REPO = Path(__file__).resolve().parents[2]


def _skip_unless_possible() -> None:
    if os.geteuid() != 0:
        pytest.skip("a SLURM test cluster needs root (network namespaces); CI runs as root")
    missing = slurm.missing_commands()
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing): run `make cluster-deps`")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _skip_unless_possible()
    name = f"s{os.getpid() % 10000}"
    with test_bed(name, ["n1", "n2"]) as bed:
        with slurm.slurm_cluster(bed, tmp_path_factory.mktemp("slurm")) as running:
            yield running
    tear_down(name)


@dataclass
class Job:
    id: str
    log: Path


class Slurm:
    """SLURM's commands against the test cluster, run in one test's folder with hard timeouts."""

    def __init__(self, cluster: slurm.SlurmCluster, folder: Path) -> None:
        self.cluster = cluster
        self.folder = folder
        self.env = {**os.environ, **cluster.env, "PYTHONPATH": str(REPO / "src")}

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            self.cluster.cancel_jobs()
            pytest.fail(f"{argv} did not end within {timeout} s:\n{expired.stdout}\n{expired.stderr}")

    def phalanx_slurm(self, *args: str) -> Job:
        done = self.run([sys.executable, "-m", "phalanx", "slurm", "--submit", *args], timeout=60)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip()
        return Job(job_id, self.folder / "phalanx-logs" / f"slurm-{job_id}.out")

    def state(self, job: Job) -> str:
        done = self.run(["scontrol", "show", "job", job.id], timeout=10)
        match = re.search(r"JobState=(\w+)", done.stdout)
        return match.group(1) if match else "GONE"

    def wait_for(self, job: Job, pattern: str, timeout: float) -> float:
        """Waits until the job's log has a line matching ``pattern``; returns when (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if job.log.exists() and re.search(pattern, job.log.read_text(errors="replace"), re.M):
                return time.monotonic()
            time.sleep(0.2)
        self.run(["scancel", job.id], timeout=10)
        pytest.fail(f"job {job.id}'s log shows no {pattern!r} within {timeout} s:\n{self.text(job)}")

    def wait_until_done(self, job: Job, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"):
                return state
            time.sleep(0.5)
        self.run(["scancel", job.id], timeout=10)
        pytest.fail(f"job {job.id} still {state} after {timeout} s:\n{self.text(job)}")

    def text(self, job: Job) -> str:
        return job.log.read_text(errors="replace") if job.log.exists() else "(no log)"


@pytest.fixture
def slurm_in(cluster, tmp_path):
    yield Slurm(cluster, tmp_path)
    cluster.cancel_jobs()
