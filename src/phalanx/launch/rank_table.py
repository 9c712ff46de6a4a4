"""The rank table: which node holds which global and local ranks, as the tutorial's table shows.

torchrun assigns ranks inside each agent after its rendezvous; phalanx reads them where the
agent hands them to its workers (:class:`~phalanx.launch.logs.RankLogsSpecs`), every node posts
its row on the store, and the node that holds rank 0 prints the whole table.
"""

from __future__ import annotations

import json
import time
from typing import Any

from phalanx.console import format_table, ranges
from phalanx.worker_env import WorkerEnv

GATHER_TIMEOUT_S = 30.0


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


class RankTableBoard:
    """Rows of the rank table posted on the rendezvous store, one per node, under a rendezvous
    round's prefix (a node that joined later counts its attempts from 0: the round names the
    table on every node alike)."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, node: int) -> str:
        return f"{self.prefix}rank_table/{node}"

    def post(self, row: dict[str, Any]) -> None:
        self.store.set(self._key(row["node"]), json.dumps(row))

    def gather(self, nodes: int, timeout: float = GATHER_TIMEOUT_S) -> list[dict[str, Any]] | None:
        keys = [self._key(node) for node in range(nodes)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return [json.loads(value) for value in self.store.multi_get(keys)]

    def labels(self, nodes: int) -> list[str]:
        """The labels of the nodes (of ``nodes``) that posted their row: the nodes of the round."""
        keys = [key for key in (self._key(node) for node in range(nodes)) if self.store.check([key])]
        return [json.loads(value)["label"] for value in self.store.multi_get(keys)] if keys else []
