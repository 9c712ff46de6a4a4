"""examples/train.py, in one process, that sends itself SIGTERM right after optimizer step
SIGNAL_STEP (as a scheduler's preemption would, at a known step). Usage:
signal_at_step.py SIGNAL_STEP TRAIN_ARGS..."""

import importlib.util
import os
import signal
import sys
from pathlib import Path

from phalanx.runtime.context import DistributedContext

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "train.py"
signal_step = int(sys.argv[1])
spec = importlib.util.spec_from_file_location("train_example", TRAIN)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
mark_step = DistributedContext.mark_step


def mark_step_and_signal(context: DistributedContext, step: int) -> None:
    mark_step(context, step)
    if step == signal_step:
        os.kill(os.getpid(), signal.SIGTERM)


DistributedContext.mark_step = mark_step_and_signal  # train.py calls it after every optimizer step
sys.argv = [str(TRAIN), *sys.argv[2:]]
example.main()
