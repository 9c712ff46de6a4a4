"""Starting a job on this host from a :class:`LaunchSpec`: the one path `phalanx run`, doctor and
bench share."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path

from phalanx.console import say
from phalanx.errors import SettingsRefused
from phalanx.launch.node_setup import NodeSetup, decision_block, new_run_dir, set_up_nodes
from phalanx.launch.spec import LaunchSpec
from phalanx.torch_compat import check_installed


def check_log_dir(
    log_dir: Path, why: str = "every rank writes its logs under it, on every node.", keep: bool = True
) -> None:
    """Makes --log-dir, or refuses one that cannot hold logs (a file, /proc, a read-only mount)
    before anything starts, instead of a traceback (from torchrun once the nodes have met).
    With ``keep`` False (a dry run) the folders it made are removed again: the check, no trace."""
    made: list[Path] = []
    try:
        made = [folder for folder in (log_dir, *log_dir.parents) if not folder.exists()]  # a parent may deny a look
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as error:
        what = "is a file, not a folder" if _is_file(log_dir) else f"cannot be written ({error.strerror or error})"
        raise SettingsRefused(
            f"--log-dir {log_dir} {what}",
            why,
            "give a folder this user can write, e.g. --log-dir ./phalanx-logs",
        ) from None
    finally:
        for folder in made if not keep else ():
            with contextlib.suppress(OSError):
                folder.rmdir()  # the deepest first; one that holds something else stays


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a parent folder this user may not enter
        return False


def launch(spec: LaunchSpec, run_dir: Path | None = None) -> int:
    """`phalanx run`: :func:`run_nodes` once torch is known to be installed."""
    check_installed()
    return run_nodes(spec, run_dir)


def run_nodes(
    spec: LaunchSpec, run_dir: Path | None = None, check_setups: Callable[[list[NodeSetup]], None] | None = None
) -> int:
    """Sets up this host's node agents (one, or K when simulated) and runs them; returns the job's
    exit code. With --dry-run prints their setup and starts nothing.

    ``check_setups`` sees the setups before anything starts (the backend is chosen by then), so
    that a command can refuse settings the chosen backend cannot run.
    """
    unmade = [] if spec.dry_run else [f for f in (spec.log_dir, *spec.log_dir.parents) if not f.exists()]
    run_dir = run_dir or new_run_dir(spec)
    try:
        setups = set_up_nodes(spec, run_dir)
        if check_setups is not None:
            check_setups(setups)
        with spec.blamed("log_dir"):  # made (for a dry run: tried, and left as it was)
            check_log_dir(Path(setups[0].run_dir).parent, keep=not spec.dry_run)
    except BaseException:  # refused before anything started: the run's folder, if empty, goes too
        for folder in [run_dir, *unmade]:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if spec.dry_run:
        from phalanx.launch.torchrun import command_line

        print(decision_block(setups))
        for setup in setups:
            address = "" if setup.local_addr == setup.node_label else f" ({setup.local_addr})"
            role = " (hosts the store)" if setup.is_host else ""
            print(f"\n# {setup.node_label}{address}{role}:\n{command_line(setup)}")
        return 0
    say(decision_block(setups))
    if setups[0].is_simulated:
        from phalanx.launch.simulate import Simulation

        return Simulation(setups).run()
    from phalanx.launch.agent import NodeAgent

    return NodeAgent(setups[0]).run()
