"""Cluster environments: where ``phalanx run`` runs (SLURM, Kubernetes, SkyPilot, torchrun's
``PET_`` variables), each one small class behind :func:`detect`."""

from phalanx.clusters.detect import detect
from phalanx.clusters.environment import Placement

__all__ = ["Placement", "detect"]
