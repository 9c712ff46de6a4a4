"""Kubernetes manifests that run ``phalanx run`` in every pod (``phalanx k8s``): an Indexed Job
with its headless Service, a Kubeflow TrainJob or a PyTorchJob, from one :class:`ManifestSpec`."""
