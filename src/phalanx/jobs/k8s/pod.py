"""The parts every kind's pods share: metadata and labels, the container, its resources and
variables, and a memory-backed /dev/shm: a container's own 64 MiB is too small for DataLoader
workers and NCCL's shared-memory transport ("Bus error", "No space left on device").
"""

from __future__ import annotations

from typing import Any

from phalanx.jobs.k8s.spec import Manifest, ManifestSpec

#: The volume that replaces the container runtime's 64 MiB /dev/shm.
SHM_VOLUME: Manifest = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
SHM_MOUNT: Manifest = {"name": "dshm", "mountPath": "/dev/shm"}
GPU_RESOURCE = "nvidia.com/gpu"


def labels(spec: ManifestSpec) -> dict[str, str]:
    """The labels of every object and pod: which job, and who wrote it."""
    return {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "phalanx"}


def metadata(spec: ManifestSpec, name: str | None = None) -> Manifest:
    """An object's metadata: its name (the job's by default), namespace and labels."""
    namespace = {"namespace": spec.namespace} if spec.namespace else {}
    return {"name": name or spec.name, **namespace, "labels": labels(spec)}


def resources(spec: ManifestSpec) -> Manifest:
    """Each pod's resources: GPUs as limits (the device plugin's way), CPU and memory as requests.

    Example:
        >>> from phalanx.jobs.k8s.kinds import kind_named
        >>> from phalanx.settings.entrypoint import Entrypoint
        >>> spec = ManifestSpec(kind_named("indexed-job"), "t", "me/t:1", Entrypoint("t.py"), 2, 4, gpus_per_node=4, memory="64Gi")
        >>> resources(spec)
        {'limits': {'nvidia.com/gpu': 4}, 'requests': {'memory': '64Gi'}}
    """
    limits = {GPU_RESOURCE: spec.gpus_per_node} if spec.gpus_per_node else {}
    requests = {key: value for key, value in (("cpu", spec.cpu), ("memory", spec.memory)) if value}
    return {key: value for key, value in (("limits", limits), ("requests", requests)) if value}


def claim_volumes(spec: ManifestSpec) -> list[Manifest]:
    """The pods' volumes of ``--volume CLAIM:PATH``, each a PersistentVolumeClaim."""
    return [
        {"name": f"volume-{k}", "persistentVolumeClaim": {"claimName": claim}}
        for k, (claim, _) in enumerate(spec.volumes)
    ]


def mounts(spec: ManifestSpec) -> list[Manifest]:
    """The training container's mounts: /dev/shm, then each ``--volume`` at its path."""
    return [SHM_MOUNT, *({"name": f"volume-{k}", "mountPath": path} for k, (_, path) in enumerate(spec.volumes))]


def container(spec: ManifestSpec, name: str, command: list[str], **more: Any) -> Manifest:
    """The training container ``name`` (a PyTorchJob's must be ``pytorch``) running ``command``:
    the image, its variables, resources, /dev/shm, and ``more`` fields (``ports``)."""
    env = [{"name": key, "value": value} for key, value in spec.pod_env]
    optional = {"env": env, "resources": resources(spec)}
    return {"name": name, "image": spec.image, "command": command, **{k: v for k, v in optional.items() if v},
            **more, "volumeMounts": mounts(spec)}  # fmt: skip


def pod_template(spec: ManifestSpec, training: Manifest, **more: Any) -> Manifest:
    """A labelled pod template around the ``training`` container, with the /dev/shm volume,
    ``--volume``'s, and ``more`` fields of the pod spec (``subdomain``, ``restartPolicy``)."""
    volumes = [SHM_VOLUME, *claim_volumes(spec)]
    return {"metadata": {"labels": labels(spec)}, "spec": {**more, "containers": [training], "volumes": volumes}}
