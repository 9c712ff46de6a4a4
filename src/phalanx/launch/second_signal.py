"""A stop that says what it waits for, and a second Ctrl-C that ends the workers at once
(docs/launch-design.md)."""

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
    from torch.distributed.elastic.multiprocessing import api

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
