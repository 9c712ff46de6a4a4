"""The rank table: which node holds which global and local ranks; the node that holds rank 0
prints it."""

from __future__ import annotations

from typing import Any

from phalanx.console import format_table, ranges
from phalanx.worker_env import WorkerEnv


def node_row(envs: dict[int, dict[str, str]], address: str, label: str) -> dict[str, Any]:
    first = envs[min(envs)]
    return {
        "node": int(first["GROUP_RANK"]),
        "nodes": int(first["GROUP_WORLD_SIZE"]),
        "world_size": int(first["WORLD_SIZE"]),
        "attempt": WorkerEnv.from_env(first).attempt or 0,
        "label": label,
        "address": address,
        "ranks": sorted(int(env["RANK"]) for env in envs.values()),
        "local_ranks": sorted(int(env["LOCAL_RANK"]) for env in envs.values()),
    }


def format_rank_table(rows: list[dict[str, Any]]) -> str:
    rows = sorted(rows, key=lambda row: row["node"])
    world = rows[0]["world_size"]
    counts = sorted({len(row["ranks"]) for row in rows})
    per_node = f"{counts[0]} process{'es' if counts[0] != 1 else ''}" if len(counts) == 1 else "uneven processes"
    attempt = f", restart {rows[0]['attempt']}" if rows[0]["attempt"] else ""
    head = f"phalanx: rank table: {len(rows)} node{'s' if len(rows) != 1 else ''} x {per_node} = world size {world}{attempt}"
    table = format_table(
        ["node", "name", "address", "global ranks (RANK)", "local ranks (LOCAL_RANK)"],
        [[row["node"], row["label"], row["address"], ranges(row["ranks"]), ranges(row["local_ranks"])] for row in rows],
    )
    return f"{head}\n{table}"
