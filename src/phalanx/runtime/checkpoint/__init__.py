"""Sharded checkpoints on torch.distributed.checkpoint (:class:`CheckpointManager`)."""

from phalanx.runtime.checkpoint.manager import Checkpoint, CheckpointManager
from phalanx.runtime.checkpoint.rng import restore_rng_state, rng_state

__all__ = ["Checkpoint", "CheckpointManager", "restore_rng_state", "rng_state"]
