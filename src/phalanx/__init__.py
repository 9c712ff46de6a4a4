"""phalanx: multi-node synchronous data-parallel training with PyTorch that starts the first time.

Importing this package is cheap: it loads neither torch nor torch.distributed.run. The runtime
(``phalanx.init()`` and friends, :mod:`phalanx.runtime`) is imported on first use; the launcher
(`phalanx run`) lives in :mod:`phalanx.launch`, the command line in :mod:`phalanx.cli`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_RUNTIME = (
    "Run", "Stateful", "init", "DistributedContext", "ResumableSampler", "ResumableLoader", "GlobalMean", "SharedReduction",
    "CheckpointManager", "accumulate", "no_backward_sync", "clip_gradients", "MixedPrecision",
    "StepMeter", "StepReport", "ProgressReporter", "MetricsLog",
)  # fmt: skip

__all__ = ["__version__", *_RUNTIME]


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from phalanx import runtime

        # Kept as a module attribute: found directly from then on (a loop reads phalanx.accumulate every step).
        value = globals()[name] = getattr(runtime, name)
        return value
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
