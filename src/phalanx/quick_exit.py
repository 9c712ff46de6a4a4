"""The exit of a process that has finished its work: the launcher, a node's agent, a worker."""

import gc
from typing import NoReturn


def exit_quickly(code: int) -> NoReturn:
    """Ends a process that has finished its work (files closed, results written) with ``code``.

    At exit the interpreter searches every object still alive for reference cycles: with torch
    imported, about a second of CPU per process (benchmarks/launch_overhead.py measures a launch's
    end). Freezing the objects skips that search. Everything else still happens: atexit handlers
    run, objects are released as their modules go, standard output is flushed. Only an object that
    nothing but a cycle keeps alive is never finalized (the memory goes back with the process): so
    nothing may be left open when this is called.

    Args:
        code: the process's exit code.
    """
    gc.freeze()
    raise SystemExit(code)
