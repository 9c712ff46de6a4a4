"""The pods of `phalanx k8s`'s manifests, on test-bed hosts, as each kind's controller runs them.

No Kubernetes control plane runs here. Instead each kind's manifest is rendered, and the
container command it names runs on two network-namespace hosts (phalanx.testbed) with what the
controller and the kubelet would give two pods: the pod's host name (a UTS namespace of its
own), the kubelet's hosts file, the cluster DNS's answers for the other pods (as hosts-file
lines: the search path ``<namespace>.svc.cluster.local`` turns ``<pod>.<subdomain>`` into those
names), only the variables a pod has (the manifest's, the controller's and the Service
variables every pod gets), and the manifest's node and process counts. The two pods then train
examples/train.py as one world of 4 ranks. Read, for this test, from:

- Kubernetes (kubernetes/kubernetes, pkg/controller/job/job_controller.go and
  indexed_job_utils.go; pkg/kubelet/kubelet_pods.go, managedHostsFileContent): pod i of an
  Indexed Job has the host name ``<job>-<i>`` and ``JOB_COMPLETION_INDEX=i``; with the pod
  template's ``subdomain`` S, its hosts file maps ``<job>-<i>.S.<namespace>.svc.cluster.local``
  and ``<job>-<i>`` to the pod's address.
- Kubeflow Trainer v2.3.0 (kubeflow/trainer, pkg/runtime/framework/plugins/torch/torch.go,
  pkg/constants/constants.go) with JobSet v0.12.0, the version it requires
  (kubernetes-sigs/jobset, pkg/controllers/jobset_controller.go, pkg/util/placement): the
  TrainJob's replicated job ``node`` is one Indexed Job ``<tj>-node-0`` in subdomain ``<tj>``,
  so pod i is ``<tj>-node-0-<i>``; every pod has ``PET_NNODES`` (numNodes),
  ``PET_NPROC_PER_NODE`` (numProcPerNode), ``PET_NODE_RANK`` (its JOB_COMPLETION_INDEX),
  ``PET_MASTER_ADDR=<tj>-node-0-0.<tj>`` and ``PET_MASTER_PORT=29500``.
- Kubeflow training-operator v1.9.4 (kubeflow/trainer's release-1.9 branch,
  pkg/controller.v1/pytorch/envvar.go and master.go, pkg/controller.v1/common/service.go):
  pods ``<job>-master-0`` and ``<job>-worker-<i>``, each with a headless Service of its own name;
  every pod has ``MASTER_ADDR=<job>-master-0``, ``MASTER_PORT`` and ``PET_MASTER_PORT`` (the
  master container's ``pytorchjob-port``), ``PET_MASTER_ADDR``, ``WORLD_SIZE`` (pods x
  nprocPerNode), ``RANK`` and ``PET_NODE_RANK`` (0 for the master, 1 + i for worker i),
  ``PET_NNODES``, ``PET_NPROC_PER_NODE`` and ``PYTHONUNBUFFERED=1``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from phalanx.cli.main import main
from phalanx.testbed import Host, run_together, test_bed
from phalanx.testbed.bed import NETNS_ETC
from tests.conftest import EXAMPLES
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]
NAMESPACE = "ml"
CLUSTER_DOMAIN = "cluster.local"
#: The variables of the API server's Service, which the kubelet puts in every pod.
SERVICE_VARIABLES = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
#: One variable given with --env: phalanx in the pods takes the job's name from it.
JOB_ID = "k8s-e2e"


@dataclass
class Pod:
    """One pod as its controller makes it: host name, subdomain, container, its controller's variables."""

    hostname: str
    container: dict
    variables: dict[str, str] = field(default_factory=dict)
    subdomain: str | None = None

    @property
    def dns_name(self) -> str:
        """The name other pods reach it by (with the search path, as the cluster DNS answers)."""
        return f"{self.hostname}.{self.subdomain}" if self.subdomain else self.hostname


def indexed_job_pods(manifests: list[dict]) -> list[Pod]:
    (job,) = [m for m in manifests if m["kind"] == "Job"]
    (service,) = [m for m in manifests if m["kind"] == "Service"]
    template, name = job["spec"]["template"]["spec"], job["metadata"]["name"]
    assert template["subdomain"] == service["metadata"]["name"] and service["spec"]["selector"] == {"job-name": name}
    (container,) = template["containers"]
    return [Pod(f"{name}-{i}", container, {"JOB_COMPLETION_INDEX": str(i)}, template["subdomain"])
            for i in range(job["spec"]["completions"])]  # fmt: skip


def trainjob_pods(manifests: list[dict]) -> list[Pod]:
    (trainjob,) = manifests
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    container = {"command": trainer["command"], "env": trainer.get("env", [])}
    shape = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
             "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}  # fmt: skip
    return [Pod(f"{name}-node-0-{i}", container, {**shape, "PET_NODE_RANK": str(i), "JOB_COMPLETION_INDEX": str(i)},
                subdomain=name) for i in range(trainer["numNodes"])]  # fmt: skip


def pytorchjob_pods(manifests: list[dict]) -> list[Pod]:
    (job,) = manifests
    name, spec = job["metadata"]["name"], job["spec"]
    roles = [(role.lower(), i, replicas["template"]["spec"]["containers"][0])
             for role, replicas in spec["pytorchReplicaSpecs"].items() for i in range(replicas["replicas"])]  # fmt: skip
    (master,) = [container for role, _, container in roles if role == "master"]
    (port,) = [p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port"]
    pods, nproc = len(roles), spec["nprocPerNode"]
    shape = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
             "MASTER_ADDR": f"{name}-master-0", "PET_MASTER_ADDR": f"{name}-master-0",
             "WORLD_SIZE": str(pods * int(nproc)), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(pods)}  # fmt: skip
    return [Pod(f"{name}-{role}-{i}", container, {**shape, "RANK": str(rank), "PET_NODE_RANK": str(rank)})
            for rank, (role, i, container) in enumerate(roles)]  # fmt: skip


PODS = {"indexed-job": indexed_job_pods, "trainjob": trainjob_pods, "pytorchjob": pytorchjob_pods}
#: How phalanx run names the environment it found in each kind's pods.
ENVIRONMENTS = {
    "indexed-job": "Kubernetes Indexed Job mnist: node",
    "trainjob": "Kubernetes pod with torchrun's PET_ variables (a Kubeflow TrainJob or elastic PyTorchJob): node",
    "pytorchjob": "Kubeflow PyTorchJob mnist: node",
}
#: Where the pods meet: pod 0's DNS name, never an address.
ENDPOINTS = {
    "indexed-job": "mnist-0.mnist:29400",
    "trainjob": "mnist-node-0-0.mnist:29500",
    "pytorchjob": "mnist-master-0:23456",
}


def hosts_file(pod: Pod, address: str, everyone: list[tuple[Pod, str]]) -> str:
    """The kubelet's hosts file of ``pod``, then the cluster DNS's answers for every pod."""
    domain = f"{pod.subdomain}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}" if pod.subdomain else None
    own = f"{address}\t{pod.hostname}.{domain}\t{pod.hostname}" if domain else f"{address}\t{pod.hostname}"
    lines = ["# Kubernetes-managed hosts file.", "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             own, "# the cluster DNS, with the search path"]  # fmt: skip
    lines += [f"{other_address}\t{other.dns_name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}\t{other.dns_name}"
              for other, other_address in everyone]  # fmt: skip
    return "\n".join(lines) + "\n"


def pod_command(host: Host, pod: Pod, home: Path) -> list[str]:
    """The container's command on ``host``: the pod's host name, and only the pod's variables."""
    variables = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home),
                 "HOSTNAME": pod.hostname, **SERVICE_VARIABLES,
                 **{item["name"]: item["value"] for item in pod.container.get("env", [])}, **pod.variables}  # fmt: skip
    named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', pod.hostname, *pod.container["command"]]
    return host.command(["env", "-i", *(f"{name}={value}" for name, value in variables.items()), *named])


def render(capsys, kind: str, metrics: Path) -> list[dict]:
    assert main(["k8s", "--kind", kind, "--image", "me/train:1", "--nnodes", "2", "--nproc-per-node", "2",
                 "--namespace", NAMESPACE, "--name", "mnist", "--env", f"PHALANX_RDZV_ID={JOB_ID}",
                 "--env", "OMP_NUM_THREADS=1", "--join-timeout", "60", str(EXAMPLES / "train.py"),
                 "--epochs", "2", "--samples", "256", "--log-every", "1", "--metrics-json", str(metrics)]) == 0  # fmt: skip
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("kind", list(PODS))
def test_two_pods_train_as_one_job(workdir, capsys, kind):
    skip_unless_namespaces_work()
    metrics = workdir / "metrics.json"
    pods = PODS[kind](render(capsys, kind, metrics))
    assert len(pods) == 2
    with test_bed(f"k{kind[0]}{os.getpid() % 100000}", ["p0", "p1"]) as bed:
        placed = list(zip(pods, [host.address for host in bed.hosts]))
        for host, (pod, address) in zip(bed.hosts, placed):
            (NETNS_ETC / host.namespace / "hosts").write_text(hosts_file(pod, address, placed))
        outcomes = run_together([pod_command(host, pod, workdir) for host, pod in zip(bed.hosts, pods)], timeout=180,
                               cwd=str(workdir))  # fmt: skip
    main_pod, other = (host.address for host in bed.hosts)
    for pod, outcome in zip(pods, outcomes):
        assert outcome.returncode == 0, f"{pod.hostname}:\n{outcome.output[-4000:]}"
        assert f"joins job '{JOB_ID}' of 2 nodes" in outcome.output, outcome.output[-3000:]  # --env reached it
        assert f"  cluster    {ENVIRONMENTS[kind]}" in outcome.output, outcome.output[-3000:]
    first, second = outcomes
    assert f"  store      {ENDPOINTS[kind]} (this host hosts it: node 0" in first.output, first.output[-3000:]
    assert f"  store      {ENDPOINTS[kind]} (hosted by {main_pod}:" in second.output, second.output[-3000:]
    assert "2 nodes x 2 processes = world size 4" in first.output, first.output[-3000:]
    other = re.escape(other)
    assert re.search(rf"^\s*1\s+{other}\s+{other}\s+2-3\s+0-1$", first.output, re.M), first.output[-3000:]
    result = json.loads(metrics.read_text())  # rank 0's
    assert result["world_size"] == 4 and result["steps"] == 4, result
