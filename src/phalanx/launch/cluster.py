"""The launch settings a cluster environment gives, merged with the user's own: the node count
is the scheduler's (a contradiction is refused); the endpoint, rendezvous ID and processes per
node are defaults the user may override."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.clusters import Placement, detect
from phalanx.console import format_table
from phalanx.errors import SettingsRefused
from phalanx.settings.values import NodeRange, Resolved

#: The settings a cluster environment may give that the user may override: (setting, Placement attribute).
_DEFAULTS = (("rdzv_endpoint", "endpoint"), ("rdzv_id", "rdzv_id"), ("nproc_per_node", "nproc_per_node"))
#: Every setting a cluster environment may give: the node count, which the user may not override, first.
PLACEMENT_SETTINGS = (("nnodes", "nnodes"), *_DEFAULTS)


#: torch's env:// variables, which a user may carry over from launching by hand: outside a
#: scheduler nothing of phalanx reads them, and torchrun sets its own for every worker.
_ENV_INIT_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "NODE_RANK")


def _ignored_variables(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The decision block's line naming the env:// variables set outside any scheduler."""
    found = [f"{name}={environ[name]}" for name in _ENV_INIT_VARIABLES if environ.get(name)]
    if not found:
        return ()
    return (f"none detected; {', '.join(found)} ignored: phalanx run sets them for each worker. Several nodes meet "
            "at --rdzv-endpoint HOST:PORT with --nnodes N, the same command on each",)  # fmt: skip


def with_cluster_environment(resolved: Mapping[str, Resolved], environ: Mapping[str, str]) -> dict[str, Any]:
    """LaunchSpec's keyword arguments: the user's settings, completed by the cluster environment.

    Raises:
        SettingsRefused: the environment's variables do not parse or contradict each other, or the
            user's node count contradicts the environment's (a table of both).
    """
    settings = {name: item.value for name, item in resolved.items()}
    environment = detect(environ, headless_service=settings.get("headless_service"))
    if environment is None:
        return {**settings, "cluster_notes": _ignored_variables(environ)}
    if settings.get("simulate_nodes"):
        note = f"{environment.name} detected and ignored: --simulate-nodes runs every node on this host"
        return {**settings, "cluster_notes": (note,)}
    placement = environment.placement()
    notes = [_summary(placement, resolved)]
    _check_node_count(placement, resolved)
    if placement.nnodes is not None:
        settings["nnodes"] = placement.nnodes.value
    single_node = settings.get("nnodes", NodeRange(1, 1)).max == 1
    endpoint_is_theirs = "rdzv_endpoint" not in resolved and placement.endpoint is not None and not single_node
    for name, attribute in _DEFAULTS:
        found = getattr(placement, attribute)
        if found is None or (name == "rdzv_endpoint" and single_node):
            continue  # a single node meets nobody: a free port on this host, as without the environment
        if name in resolved:
            if resolved[name].value != found.value:
                flag = name.replace("_", "-")
                given = resolved[name]
                notes.append(f"{flag} {given.value} from {given.origin}, not {found.value} ({found.source})")
            continue
        settings[name] = found.value
    _check_node_rank(placement, settings, resolved)
    _check_endpoint(placement, settings)
    return {
        **settings,
        "placement": placement,
        "node_rank": placement.node_rank.value if endpoint_is_theirs and placement.node_rank else None,
        "endpoint_origin": placement.endpoint.source if endpoint_is_theirs and placement.endpoint else None,
        "cluster_notes": tuple(notes + list(placement.notes)),
    }


def _summary(placement: Placement, resolved: Mapping[str, Resolved]) -> str:
    """The decision block's cluster line: which job, which node of how many, what was read."""
    where = placement.environment
    if placement.node_rank is not None:
        count = (
            placement.nnodes.value if placement.nnodes is not None else getattr(resolved.get("nnodes"), "value", None)
        )
        where += f": node {placement.node_rank.value}" + (f" of {count}" if count is not None else "")
    read = ", ".join(placement.sources())
    return f"{where}\n             read: {read}" if read else where


def _check_node_count(placement: Placement, resolved: Mapping[str, Resolved]) -> None:
    if placement.nnodes is None:
        return
    theirs = placement.nnodes
    rows = []
    if "nnodes" in resolved and resolved["nnodes"].value != theirs.value and resolved["nnodes"].origin != theirs.source:
        rows.append(
            ["nnodes", f"{resolved['nnodes'].value} ({resolved['nnodes'].origin})", f"{theirs.value} ({theirs.source})"]
        )
    standalone = resolved.get("standalone")
    if standalone is not None and standalone.value and theirs.value.max > 1:
        rows.append(["standalone", f"1 node ({standalone.origin})", f"{theirs.value} ({theirs.source})"])
    if not rows:
        return
    raise SettingsRefused(
        f"the launch settings contradict the {placement.environment}",
        format_table(["setting", "you set", "the environment says"], rows, indent="")
        + "\nThe scheduler starts phalanx run on exactly its nodes; a job whose nodes count differently never forms.",
        "drop the setting (phalanx reads the node count from the environment), or ask the scheduler for the nodes "
        "you want (sbatch --nodes=N, the job's replicas)",
    )


def _check_node_rank(placement: Placement, settings: Mapping[str, Any], resolved: Mapping[str, Resolved]) -> None:
    rank, nnodes = placement.node_rank, settings.get("nnodes", NodeRange(1, 1))
    if rank is None or rank.value < nnodes.max:
        return
    origin = resolved["nnodes"].origin if "nnodes" in resolved else "the default"
    raise SettingsRefused(
        f"{placement.environment}: {rank.source}, but the job has {nnodes} node(s) ({origin})",
        f"{placement.name} does not say how many nodes the job has, so phalanx takes --nnodes.",
        "set --nnodes (or PHALANX_NNODES in the pod spec) to the number of pods: the Job's completions",
    )


def _check_endpoint(placement: Placement, settings: Mapping[str, Any]) -> None:
    if settings.get("rdzv_endpoint") is not None or settings.get("nnodes", NodeRange(1, 1)).max == 1:
        return
    why, hint = placement.no_endpoint or (
        f"{placement.name} gave no endpoint.",
        "give the first node's address: --rdzv-endpoint HOST[:PORT] (or PET_MASTER_ADDR and PET_MASTER_PORT)",
    )
    raise SettingsRefused(
        f"{placement.environment}: the job has {settings['nnodes']} nodes, but nothing says where they meet", why, hint
    )
