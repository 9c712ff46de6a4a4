"""examples/train.py that sends itself a signal right after an optimizer step: SIGTERM as a
scheduler's preemption would, SIGKILL as a worker that dies, at a known step. Usage:

    signal_at_step.py SIGNAL RANK STEPS TRAIN_ARGS...

SIGNAL: TERM or KILL. RANK: the rank that signals itself, or "all". STEPS: one step per attempt
of the job, comma-separated (37,52: after step 37 in the first attempt, after step 52 in the
restarted one; none in later attempts)."""

import importlib.util
import os
import signal
import sys
from pathlib import Path

from phalanx.runtime.context import DistributedContext

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "train.py"
sent = signal.Signals[f"SIG{sys.argv[1]}"]
rank = None if sys.argv[2] == "all" else int(sys.argv[2])
steps = [int(step) for step in sys.argv[3].split(",")]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
spec = importlib.util.spec_from_file_location("train_example", TRAIN)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
mark_step = DistributedContext.mark_step


def mark_step_and_signal(context: DistributedContext, step: int) -> None:
    mark_step(context, step)
    if rank in (None, context.rank) and attempt < len(steps) and step == steps[attempt]:
        os.kill(os.getpid(), sent)


DistributedContext.mark_step = mark_step_and_signal  # train.py calls it after every optimizer step
sys.argv = [str(TRAIN), *sys.argv[4:]]
example.main()
