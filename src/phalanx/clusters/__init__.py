"""Cluster environments: where ``phalanx run`` runs (SLURM, Kubernetes, SkyPilot, torchrun's
``PET_`` variables), each one small class behind :func:`detect`, and the job scripts phalanx
writes for them."""

from phalanx.clusters.detect import ENVIRONMENTS, detect
from phalanx.clusters.environment import ClusterEnvironment, Found, Placement
from phalanx.clusters.nodelist import expand_nodelist

__all__ = ["ENVIRONMENTS", "ClusterEnvironment", "Found", "Placement", "detect", "expand_nodelist"]
