"""Kubernetes manifests that run ``phalanx run`` in every pod (``phalanx k8s``): an Indexed Job
with its headless Service, a Kubeflow TrainJob or a PyTorchJob, from one :class:`ManifestSpec`."""

from phalanx.jobs.k8s.kinds import KINDS, kind_named
from phalanx.jobs.k8s.render import to_yaml, write_folder
from phalanx.jobs.k8s.spec import Kind, ManifestSpec

__all__ = ["KINDS", "Kind", "ManifestSpec", "kind_named", "to_yaml", "write_folder"]
