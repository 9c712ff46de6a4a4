"""The training-loop runtime: an explicit context, resumable data, global metrics, checkpoints.

One code path for 1 process (plain ``python train.py``) and N processes (``phalanx run`` or
torchrun): the presence of torchrun's variables is the switch.
"""

from phalanx.runtime.checkpoint import CheckpointManager
from phalanx.runtime.context import DistributedContext, init
from phalanx.runtime.data import ResumableLoader, ResumableSampler
from phalanx.runtime.gradients import accumulate, clip_gradients, no_backward_sync
from phalanx.runtime.metrics import GlobalMean
from phalanx.runtime.metrics_log import MetricsLog
from phalanx.runtime.precision import MixedPrecision
from phalanx.runtime.progress import ProgressReporter, StepMeter, StepReport
from phalanx.runtime.run import Run, Stateful
from phalanx.runtime.shared_reduction import SharedReduction

__all__ = [
    "CheckpointManager", "DistributedContext", "GlobalMean", "MetricsLog", "MixedPrecision", "ProgressReporter",
    "ResumableLoader", "ResumableSampler", "Run", "SharedReduction", "Stateful", "StepMeter", "StepReport", "accumulate",
    "clip_gradients", "init", "no_backward_sync",
]  # fmt: skip
