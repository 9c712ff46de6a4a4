"""``phalanx slurm``: the batch script that runs ``phalanx run`` on every node of a SLURM job."""
