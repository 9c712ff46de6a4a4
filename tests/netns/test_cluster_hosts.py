"""Cluster environments on test-bed hosts: names that resolve late, as Kubernetes' DNS does.

Each host of the bed (phalanx.testbed) resolves names through a hosts file of its own; the
test writes the endpoint's name into it while phalanx waits, as a pod's DNS name appears once
the pod is scheduled. Kubernetes itself cannot run here; the variables are those Kubeflow's
Trainer sets on a TrainJob's pods (pkg/runtime/framework/plugins/torch/torch.go).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from phalanx.testbed import test_bed
from phalanx.testbed.bed import NETNS_ETC
from tests.conftest import EXAMPLES
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]


def trainjob_pod(rank: int, master: str) -> dict[str, str]:
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": "29400", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # fmt: skip


def dry_run(host, env: dict[str, str], cwd, *extra: str) -> subprocess.Popen[str]:
    argv = host.command([sys.executable, "-m", "phalanx", "run", "--dry-run", *extra, str(EXAMPLES / "train.py")])
    return subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def test_a_name_that_appears_late_is_waited_for_and_said(workdir):
    skip_unless_namespaces_work()
    with test_bed(f"d{os.getpid() % 10000}", ["h1", "h2"]) as bed:
        h1, h2 = bed.hosts
        process = dry_run(h2, trainjob_pod(1, "train-node-0-0.train"), workdir)
        time.sleep(11)  # one "waiting" line is said after 10 s
        with (NETNS_ETC / h2.namespace / "hosts").open("a") as hosts:
            hosts.write(f"{h1.address} train-node-0-0.train\n")
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "phalanx: waiting for the endpoint's name" in stderr and "'train-node-0-0.train' to resolve" in stderr
    assert "--rdzv-endpoint=train-node-0-0.train:29400" in stdout and f"--local-addr={h2.address}" in stdout


def test_a_name_that_never_resolves_ends_with_the_join_timeout(workdir):
    skip_unless_namespaces_work()
    with test_bed(f"e{os.getpid() % 10000}", ["h1", "h2"]) as bed:
        process = dry_run(bed.hosts[1], trainjob_pod(1, "nowhere-0-0.train"), workdir, "--join-timeout", "3")
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 3, stderr
    assert "the host 'nowhere-0-0.train' did not resolve within 3 s" in stderr
    assert "127.0.0.1" not in stderr.split("phalanx: error:")[1]  # never fell back to localhost
