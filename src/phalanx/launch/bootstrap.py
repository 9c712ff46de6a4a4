"""The entry point of every worker ``phalanx run`` starts: the user's script, run as python runs it.

``python -m phalanx.launch.bootstrap SCRIPT ARGS`` (or ``-m MODULE ARGS``), in a process that dies
with its launcher, keeps an early SIGUSR1, records its process group and first step, and writes
the exception that ended the script where the launcher reads it (docs/launch-design.md).
"""

from __future__ import annotations

import atexit
import builtins
import importlib.machinery
import importlib.util
import io
import os
import runpy
import signal
import sys
import types
import zipfile
from pathlib import Path
from types import CodeType, TracebackType
from typing import Any

from phalanx.launch.group_guard import guard_the_group
from phalanx.launch.group_record import GroupWatch
from phalanx.launch.signals import die_with_parent
from phalanx.launch.start_report import START_RECORD_NAME, FirstStepWatch
from phalanx.worker_env import WorkerEnv


def _note_early_signal(signum: int, _frame: object) -> None:
    os.environ.update(WorkerEnv(early_signal=signal.Signals(signum).name).to_env())


def _say_if_the_early_signal_was_never_taken() -> None:
    early = WorkerEnv.from_env(os.environ).early_signal
    if early:
        print(f"phalanx: this worker got {early}, but the script never created a PreemptionGuard to act on it: "
              "nothing was saved for it", file=sys.stderr, flush=True)  # fmt: skip


def _tear_down_group() -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not c10d.is_initialized():
        return
    from phalanx.runtime.context import destroy_process_group

    destroy_process_group()


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's own first frame on, as ``python SCRIPT`` would print it."""
    ours = (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _record(error: BaseException) -> None:
    """Writes the error to the worker's error file (TORCHELASTIC_ERROR_FILE), as torch's ``@record``
    does: the launcher reads which exception ended the worker there, not among its log's lines."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(error)


def _run_script(path: str) -> None:
    """Runs the script as ``python SCRIPT`` does; a folder or zip file with a __main__.py as runpy does."""
    if os.path.isdir(path) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    _as_main(code, __file__=path, __loader__=loader, __spec__=None, __package__=None, __cached__=None)


def _run_module(name: str) -> None:
    """Runs the module (a package: its __main__) as ``python -m MODULE`` does."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{name}.__main__")
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
        raise ImportError(f"No module named {name!r} that python -m could run", name=name)
    code = spec.loader.get_code(spec.name)
    if code is None:
        raise ImportError(f"No code object available for {name!r}", name=name)
    sys.argv[0] = spec.origin or name  # as python -m does
    _as_main(code, __file__=spec.origin, __loader__=spec.loader, __spec__=spec, __package__=spec.parent,
             __cached__=spec.cached)  # fmt: skip


def _as_main(code: CodeType, **attributes: Any) -> None:
    """Runs ``code`` in a new module that is ``__main__`` and stays so after the code returns, as in
    a plain python process. runpy swaps its module back when the code returns, so an exit
    handler or a thread that outlives the script body and pickles a class of the script (a
    checkpoint with a dataclass config) found no such class in ``__main__``."""
    module = types.ModuleType("__main__")
    module.__dict__.update(attributes, __builtins__=builtins)
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def run(argv: list[str]) -> int | str | None:
    """Runs ``SCRIPT ARGS`` or ``-m MODULE ARGS``; returns what it exited with."""
    is_module = bool(argv) and argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if is_module else (argv[0], argv[1:])
    worker = WorkerEnv.from_env(os.environ)
    die_with_parent(worker.supervisor_pid or worker.launcher_pid)
    signal.signal(signal.SIGUSR1, _note_early_signal)  # until the script installs its own handler
    guard_the_group()
    # Registered first, so they run last: after the script's own exit handlers.
    atexit.register(_tear_down_group)
    atexit.register(_say_if_the_early_signal_was_never_taken)
    if worker.group_record:
        record = Path(worker.group_record)
        watch = GroupWatch(record, int(os.environ.get("WORLD_SIZE", "1")))
        watch.install()
        atexit.register(watch.write)
        FirstStepWatch(record.parent / START_RECORD_NAME, watch).install()
    sys.argv = [target, *args]
    try:
        if is_module:
            _run_module(target)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            _run_script(target)
    except SystemExit as stop:
        return stop.code
    except KeyboardInterrupt:  # python's own end of it (exit handlers, then death by SIGINT), minus our frames
        shown = sys.excepthook
        sys.excepthook = lambda kind, error, tb: shown(
            kind, error.with_traceback(_user_traceback(tb)), error.__traceback__
        )
        raise
    except BaseException as error:
        trimmed = _user_traceback(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        _record(error)
        return 1
    return 0


def main() -> None:
    """``python -m phalanx.launch.bootstrap [-m] TARGET ARGS``: exits with what the script exited with."""
    worker = WorkerEnv.from_env(os.environ)
    if worker.heal and worker.supervisor_pid is None:  # heal mode: this process supervises the script
        from phalanx.launch.supervisor import supervise

        raise SystemExit(supervise(sys.argv[1:]))
    code = run(sys.argv[1:])
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
