"""The rendezvous round a node's agent is in, as a name every node of that round agrees on
(docs/launch-design.md)."""

from __future__ import annotations

from typing import Any

from phalanx.launch.restarts import raise_if_signal

#: The key on a round's store (torch prefixes it per round) that names the round.
ROUND_KEY = "phalanx/round"


def agree_on_round(job_store: Any, job_prefix: str, round_store: Any, fallback: str) -> str:
    """The name of the round whose store is ``round_store``, the same on every node of that round:
    a number from the counter ``job_prefix + "rounds"`` on the job's store, proposed by every node
    and decided by the first (a compare-and-set on the round's store).

    Where the store does not answer (gone with its host), ``fallback``: a name no other node uses,
    so that nothing of another round is read."""
    try:
        proposal = str(job_store.add(f"{job_prefix}rounds", 1))
        return round_store.compare_set(ROUND_KEY, "", proposal).decode()
    except Exception as error:
        raise_if_signal(error)
        return fallback
