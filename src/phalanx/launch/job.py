"""Starting a job on this host from a :class:`LaunchSpec`: the one path every command shares.

`phalanx run` starts the user's script this way; `phalanx doctor` and `phalanx bench` start
phalanx's own worker modules the same way (:mod:`.tool`), so they meet the same launch problems
a training job would, and report them the same way.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.console import say
from phalanx.launch.plan import NodePlan, decision_block, plan_nodes
from phalanx.launch.spec import LaunchSpec


def dry_run_text(plans: list[NodePlan]) -> str:
    from phalanx.launch.torchrun import command_line

    parts = [decision_block(plans)]
    for plan in plans:
        role = " (hosts the store)" if plan.is_host else ""
        parts.append(f"\n# {plan.node_label} ({plan.local_addr}){role}:\n{command_line(plan)}")
    return "\n".join(parts)


def start(plans: list[NodePlan]) -> int:
    """Runs this host's node agents (one, or K when simulated) and returns the job's exit code."""
    say(decision_block(plans))
    if plans[0].is_simulated:
        from phalanx.launch.simulate import Simulation

        return Simulation(plans).run()
    from phalanx.launch.agent import NodeAgent

    return NodeAgent(plans[0]).run()


def launch(spec: LaunchSpec, run_dir: Path | None = None) -> int:
    """Plans this host's nodes and starts them; with --dry-run prints the plan and starts nothing."""
    plans = plan_nodes(spec, run_dir)
    if spec.dry_run:
        print(dry_run_text(plans))
        return 0
    return start(plans)
