"""The job writers: a SLURM batch script (:mod:`.slurm`), Kubernetes manifests (:mod:`.k8s`) and
the ssh fan-out of ``phalanx launch`` (:mod:`.ssh`). Each writes what every node runs, over the
one resolver of :mod:`phalanx.settings`; the scheduler's facts that the node then reads back
(ports, pod and host names, variables) come from its reader in :mod:`phalanx.clusters`."""
