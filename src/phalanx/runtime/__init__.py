"""The training-loop runtime: an explicit context, resumable data, global metrics, checkpoints.

One code path for 1 process (plain ``python train.py``) and N processes (``phalanx run`` or
torchrun): the presence of torchrun's variables is the switch.
"""

from phalanx.runtime.checkpoint import CheckpointManager
from phalanx.runtime.context import DistributedContext, init
from phalanx.runtime.data import ResumableSampler
from phalanx.runtime.metrics import GlobalMean

__all__ = ["CheckpointManager", "DistributedContext", "GlobalMean", "ResumableSampler", "init"]
