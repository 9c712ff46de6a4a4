"""A Kubeflow Trainer v2 TrainJob (``trainer.kubeflow.org/v1alpha1``) on a torch runtime
(``torch-distributed`` by default), whose JobSet runs ``numNodes`` pods of replicated job and
container ``node``; the Trainer gives each pod the ``PET_`` variables that
:mod:`phalanx.clusters.torchrun_variables` reads. The /dev/shm volume goes in through
``runtimePatches``: Trainer v2.2 or newer (read from v2.3.0).
"""

from __future__ import annotations

from phalanx.clusters.indexed_job import INDEX_VARIABLE
from phalanx.clusters.torchrun_variables import TRAINER_VARIABLES
from phalanx.jobs.k8s import pod
from phalanx.jobs.k8s.spec import Kind, Manifest, ManifestSpec

#: The torch runtimes' replicated job and container (manifests/base/runtimes/torch_distributed.yaml).
NODE = "node"
#: Who wrote a runtime patch: the Trainer's webhook wants a domain-prefixed path.
PATCH_MANAGER = "phalanx.dev/k8s"


def render(spec: ManifestSpec) -> list[Manifest]:
    """The TrainJob, on the ClusterTrainingRuntime ``spec.runtime``.

    Example:
        >>> from phalanx.settings.entrypoint import Entrypoint
        >>> (job,) = render(ManifestSpec(KIND, "train", "me/train:1", Entrypoint("train.py"), 2, 4))
        >>> job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["command"]
        (2, ['phalanx', 'run', 'train.py'])
    """
    training = pod.container(spec, NODE, spec.run_command())
    trainer = {
        "image": training["image"],
        "command": training["command"],
        "numNodes": spec.nodes,
        "numProcPerNode": spec.nproc_per_node,
        **({"resourcesPerNode": training["resources"]} if "resources" in training else {}),
        **({"env": training["env"]} if "env" in training else {}),
    }
    # The runtime's pods get the /dev/shm volume through a patch: a TrainJob has no pod template.
    shm = {"spec": {"template": {"spec": {
        "volumes": [pod.SHM_VOLUME, *pod.claim_volumes(spec)], "containers": [{"name": NODE, "volumeMounts": pod.mounts(spec)}],
    }}}}  # fmt: skip
    return [
        {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "metadata": pod.metadata(spec),
            "spec": {
                "runtimeRef": {"name": spec.runtime},
                "trainer": trainer,
                "runtimePatches": [
                    {
                        "manager": PATCH_MANAGER,
                        "trainingRuntimeSpec": {
                            "template": {"spec": {"replicatedJobs": [{"name": NODE, "template": shm}]}}
                        },
                    }
                ],
            },
        }
    ]


def pod_hostnames(name: str, nodes: int) -> list[str]:
    """JobSet's host name for pod ``i`` of replicated job ``node``'s only Job: ``<name>-node-0-<i>``."""
    return [f"{name}-{NODE}-0-{index}" for index in range(nodes)]


KIND = Kind(
    name="trainjob",
    summary="a Kubeflow Trainer v2 TrainJob (Trainer v2.2+ and its torch runtime installed)",
    render=render,
    pod_hostnames=pod_hostnames,
    controller_variables=(*TRAINER_VARIABLES, INDEX_VARIABLE),
    controller_options={
        "rdzv_endpoint": "comes from the Trainer, which gives every pod PET_MASTER_ADDR and PET_MASTER_PORT",
        "headless_service": "names an Indexed Job's Service; a TrainJob's pods are named by JobSet's own",
    },
    base_env=(("PYTHONUNBUFFERED", "1"),),
)
