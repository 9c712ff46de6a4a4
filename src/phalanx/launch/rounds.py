"""The rendezvous round a node's agent is in, as a name every node of that round agrees on.

torch's elastic agent starts the workers once per rendezvous round: the first, one after each
restart (``--max-restarts``), and one after each change of membership in an elastic job
(``--nnodes MIN:MAX``: a node joins or is lost). What the nodes tell each other about the
workers (their failures, that they finished, that the job ends, the rank table) holds for one
round only: a node whose workers failed in an earlier round, and which has left the job since,
must not be blamed, or waited for, in a later one.

Neither number torch hands out names a round on every node alike: ``TORCHELASTIC_RESTART_COUNT``
counts the restarts of this node's own workers (a membership change is not one, and a node that
joins later starts at 0), and a node's own count of its starts differs for a node that joined
later. The rendezvous's own round number is private (torch 2.13:
``DynamicRendezvousHandler._state_holder.state.round``). What torch does give every node of a
round is the round's store (``RendezvousInfo.store``, kept as ``WorkerGroup.store``): a prefix of
the rendezvous store of its own per round. The first node of a round to get there writes a number
from the job's counter on it, and every node of the round reads the same.
"""

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
    so that nothing of another round is read (the round ends anyway, torch's agent finds the
    store gone)."""
    try:
        proposal = str(job_store.add(f"{job_prefix}rounds", 1))
        return round_store.compare_set(ROUND_KEY, "", proposal).decode()
    except Exception as error:
        raise_if_signal(error)
        return fallback
