"""Starting a job on this host from a :class:`LaunchSpec`: the one path every command shares.

`phalanx run` starts the user's script this way; `phalanx doctor` and `phalanx bench` start
phalanx's own worker modules the same way (:mod:`.tool`), so they meet the same launch problems
a training job would, and report them the same way.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from phalanx.console import say
from phalanx.errors import SettingsRefused
from phalanx.launch.node_setup import NodeSetup, decision_block, set_up_nodes
from phalanx.launch.spec import LaunchSpec
from phalanx.torch_compat import check_installed


def dry_run_text(setups: list[NodeSetup]) -> str:
    from phalanx.launch.torchrun import command_line

    parts = [decision_block(setups)]
    for setup in setups:
        role = " (hosts the store)" if setup.is_host else ""
        parts.append(f"\n# {setup.node_label} ({setup.local_addr}){role}:\n{command_line(setup)}")
    return "\n".join(parts)


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


def check_run_log_dir(spec: LaunchSpec, setups: list[NodeSetup]) -> None:
    """The log folder the setups' run writes under, made (or, for a dry run, tried and left as it
    was), or refused naming where --log-dir came from."""
    with spec.blamed("log_dir"):
        check_log_dir(Path(setups[0].run_dir).parent, keep=not spec.dry_run)


def start(setups: list[NodeSetup]) -> int:
    """Runs this host's node agents (one, or K when simulated) and returns the job's exit code."""
    say(decision_block(setups))
    if setups[0].is_simulated:
        from phalanx.launch.simulate import Simulation

        return Simulation(setups).run()
    from phalanx.launch.agent import NodeAgent

    return NodeAgent(setups[0]).run()


def launch(spec: LaunchSpec, run_dir: Path | None = None) -> int:
    """Sets up this host's nodes and starts them; with --dry-run prints their setup and starts nothing."""
    check_installed()
    setups = set_up_nodes(spec, run_dir)
    check_run_log_dir(spec, setups)
    if spec.dry_run:
        print(dry_run_text(setups))
        return 0
    return start(setups)
