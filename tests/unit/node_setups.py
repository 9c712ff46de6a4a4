"""Node setups for tests that run the launcher's node-to-node parts (the lobby, the exit wait) on a
real TCPStore over loopback: the nodes are threads or plain calls there, the sockets are real."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

from phalanx.launch.node_setup import NodeSetup


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node(index: int, port: int, **changes) -> NodeSetup:
    """Node ``index`` of a two-node job whose store is at 127.0.0.1:``port`` (node 0 hosts it)."""
    setup = NodeSetup(
        script="train.py", script_args=(), is_module=False, nnodes_min=2, nnodes_max=2,
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="lobbytest", max_restarts=0, heal=0, join_timeout=5.0, last_call=30.0, heartbeat_timeout=30.0,
        nproc_per_node=1, backend="gloo", is_host=index == 0, local_addr=f"127.0.0.{101 + index}",
        interface="lo", node_label=f"node{index}", run_dir="unused", all_ranks=False,
    )  # fmt: skip
    return dataclasses.replace(setup, **changes)


class CountingStore:
    """A store client that counts the operations of one node."""

    def __init__(self, store: Any, counts: dict[str, int], node: str) -> None:
        self.store, self.counts, self.node = store, counts, node

    def __getattr__(self, name: str) -> object:
        operation = getattr(self.store, name)

        def counted(*args: object) -> object:
            self.counts[self.node] += 1
            return operation(*args)

        return counted
