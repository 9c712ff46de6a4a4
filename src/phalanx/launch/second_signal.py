"""A stop that says what it waits for, and a second Ctrl-C that ends the workers at once.

torchrun's agent answers SIGINT or SIGTERM by passing it to its workers and waiting up to its
shutdown timeout (30 s) before SIGKILL. A worker that ignores the signal kept the console silent
for that long, and a second signal, raised inside the wait, made the agent's cleanup wait the
whole timeout again. Within :func:`second_signal_kills`, the first signal is said (what happens,
for how long), and the second SIGKILLs every process the agent started, so the waits end at once.

torch installs its handler when it starts the workers, by the module-level name
``_terminate_process_handler`` of ``torch.distributed.elastic.multiprocessing.api``; that name
is wrapped for the block's duration (this module is the only place phalanx touches it; the canary
of phalanx.torch_compat checks it on every release CI tests); where the name is missing, the block
changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

import psutil


@contextlib.contextmanager
def second_signal_kills(on_first: Callable[[signal.Signals], None]) -> Iterator[None]:
    """Within: ``on_first(signal)`` at the first stop signal, SIGKILL to every descendant at the
    next; torch's own handler runs after each (it raises ``SignalException``)."""
    try:
        from torch.distributed.elastic.multiprocessing import api
    except ImportError:  # pragma: no cover - torch is a dependency
        yield
        return
    original = getattr(api, "_terminate_process_handler", None)
    if original is None:
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        try:
            if not received:
                on_first(signal.Signals(signum))
            else:
                for process in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
        finally:  # torch's exception, whatever the message did
            received.append(signum)
            original(signum, frame)

    api._terminate_process_handler = handler
    try:
        yield
    finally:
        api._terminate_process_handler = original
