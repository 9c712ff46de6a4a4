"""A Kubeflow PyTorchJob (``kubeflow.org/v1``, the training operator v1.x): one Master and
``nodes - 1`` Workers, container ``pytorch``. The variables the operator gives every pod, which
``phalanx run`` reads, are :mod:`phalanx.clusters.pytorchjob`'s (training-operator v1.9.4,
pkg/controller.v1/pytorch/envvar.go and master.go).
"""

from __future__ import annotations

from phalanx.clusters.pytorchjob import DEFAULT_PORT, OPERATOR_VARIABLES, pod_hostnames
from phalanx.jobs.k8s import pod
from phalanx.jobs.k8s.spec import Kind, Manifest, ManifestSpec

#: The container the operator looks for (PyTorchJobDefaultContainerName).
CONTAINER = "pytorch"
#: The master's port, under the name the operator reads it by (PyTorchJobDefaultPort, ...PortName).
PORT = {"name": "pytorchjob-port", "containerPort": DEFAULT_PORT}


def render(spec: ManifestSpec) -> list[Manifest]:
    """The PyTorchJob: a Master, and Workers for the other nodes.

    Example:
        >>> from phalanx.settings.entrypoint import Entrypoint
        >>> (job,) = render(ManifestSpec(KIND, "train", "me/train:1", Entrypoint("train.py"), 3, 4))
        >>> {role: replicas["replicas"] for role, replicas in job["spec"]["pytorchReplicaSpecs"].items()}
        {'Master': 1, 'Worker': 2}
    """
    counts = {"Master": 1, "Worker": spec.nodes - 1}
    replicas = {
        role: {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": pod.pod_template(spec, pod.container(spec, CONTAINER, spec.run_command(), ports=[PORT])),
        }
        for role, count in counts.items()
        if count
    }
    return [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": pod.metadata(spec),
            "spec": {
                "nprocPerNode": str(spec.nproc_per_node),
                "runPolicy": {"backoffLimit": spec.backoff},
                "pytorchReplicaSpecs": replicas,
            },
        }
    ]


KIND = Kind(
    name="pytorchjob",
    summary="a Kubeflow PyTorchJob v1 (the training operator v1.7+ installed)",
    render=render,
    pod_hostnames=pod_hostnames,
    controller_variables=OPERATOR_VARIABLES,
    controller_options={
        "rdzv_endpoint": "comes from the operator, which gives every pod MASTER_ADDR and MASTER_PORT",
        "headless_service": "is the operator's business: it makes a Service for each pod",
    },
)
