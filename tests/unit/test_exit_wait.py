"""The wait of a node whose workers finished (CrossNode.workers_finished), on a real TCPStore over
loopback. The other node is played by this test: it posts on the store what its agent would.

The end-to-end runs (tests/e2e/test_simulated.py, tests/netns/test_two_hosts.py) show the common
endings; these cover the ones a launch cannot stage on time: the other node's workers still
running at the wait's timeout, and a node found waiting in the rendezvous to restart.

The agent's clock is the test's (:class:`Clock`): its waits take no time, and the other node's
posts happen at the moments the test names, in between two of the agent's looks at the store. The
waits' lengths are then exact, whatever the machine's load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore

from phalanx.launch import crossnode as crossnode_module
from phalanx.launch.agent import NodeAgent
from phalanx.launch.crossnode import CrossNode
from phalanx.launch.failure import RankFailure
from phalanx.launch.restarts import RoundTimes
from tests.unit.node_setups import node

NOBODY_WAITS = lambda: 0  # noqa: E731 - nodes waiting in the rendezvous to restart


class Clock:
    """Stands in for the agent module's ``time``: ``monotonic()`` reads a clock that only
    ``sleep()`` moves, and each action scheduled with :meth:`at` runs in the sleep that reaches
    its time, in the agent's own thread."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, int, Callable[[], object]]] = []

    def at(self, when: float, action: Callable[[], object]) -> None:
        self._due.append((when, len(self._due), action))
        self._due.sort()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        while self._due and self._due[0][0] <= self.now + 1e-9:
            self._due.pop(0)[2]()

    def __getattr__(self, name: str) -> object:  # anything else the module reads of time
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(crossnode_module, "time", clock)
    return clock


def waited(clock: Clock, at_least: float) -> bool:
    """Whether the agent's wait ended at its first look at the store (every 0.1 s) from ``at_least`` on."""
    return at_least - 1e-9 <= clock.now <= at_least + 0.1 + 1e-9


@pytest.fixture
def store():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return store  # its socket closes when the test lets go of it


def agent_of(index: int, store: TCPStore, round_number: int = 0) -> NodeAgent:
    """Node ``index``'s agent, after rendezvous round ``round_number`` of a job of two nodes."""
    agent = NodeAgent(node(index, store.port))
    agent.store, agent.nodes_in_job = store, 2
    agent.crossnode = CrossNode(store, agent.prefix, agent.setup.node_label)  # as once the nodes met in the lobby
    agent._new_round(PrefixStore(f"torch.rendezvous.lobbytest.{round_number}", store), RoundTimes(None, time.time()))
    return agent


def finished(agent: NodeAgent, timeout: float, nodes_waiting: Callable[[], int]) -> bool:
    """What the agent's exit barrier asks: whether every node's workers finished within ``timeout``."""
    return agent.crossnode.workers_finished(timeout, nodes_waiting, agent.nodes_in_job, agent.setup.is_host)


def crash(node_label: str) -> RankFailure:
    return RankFailure(rank=1, local_rank=0, node=node_label, address="127.0.0.102", exitcode=-6, time=0.0,
                       log="logs/rank1.log", tail=("terminate called without an active exception",))  # fmt: skip


def test_it_passes_as_soon_as_the_other_node_finishes(store, clock):
    clock.at(0.5, agent_of(0, store).crossnode.post_finished)
    assert finished(agent_of(1, store), 10.0, NOBODY_WAITS) is True
    assert waited(clock, 0.5)


def test_it_gives_up_on_nodes_still_running_at_its_timeout(store, clock, capsys):
    assert finished(agent_of(1, store), 1.0, NOBODY_WAITS) is False
    assert waited(clock, 1.0)
    assert "node1: its workers finished; the other nodes' workers did not finish within 1 s" in capsys.readouterr().err


def test_it_stops_waiting_for_a_node_that_waits_to_restart(store, clock, capsys):
    waiting = iter([0, 0, 1])  # the other node's agent enters the rendezvous during the wait
    assert finished(agent_of(1, store), 10.0, lambda: next(waiting, 1)) is False
    assert waited(clock, 0.2)  # at its third look
    assert "since another node waits to restart the workers, and these cannot join it" in capsys.readouterr().err


def test_it_stops_waiting_for_a_failed_node_and_names_its_root_cause(store, clock, capsys):
    clock.at(0.5, lambda: agent_of(0, store).crossnode.post_failures([crash("node0")]))
    assert finished(agent_of(1, store), 10.0, NOBODY_WAITS) is False
    assert waited(clock, 0.5)
    said = capsys.readouterr().err
    assert "since node0's workers failed: rank 1 was killed by SIGABRT: terminate called" in said


def test_the_store_host_stays_until_the_failed_node_could_read_the_reports(store, clock):
    # The store goes down with the host's agent: it waits until every node posted how it ended,
    # then as long as a failed node takes to gather the reports.
    clock.at(0.5, lambda: agent_of(1, store).crossnode.post_failures([crash("node1")]))
    assert finished(agent_of(0, store), 10.0, NOBODY_WAITS) is False
    assert waited(clock, 0.5 + crossnode_module.FAILURE_GATHER_S)


def test_a_node_that_failed_in_an_earlier_round_is_neither_blamed_nor_counted_in_a_later_one(store, clock, capsys):
    # An elastic job: node1's workers failed in round 0 and it left the job; node0 went on in
    # round 1 with node2, which joined later. node0's workers finish: it waits for node2's.
    agent_of(1, store, round_number=0).crossnode.post_failures([crash("node1")])
    node0 = agent_of(0, store, round_number=1)
    node2 = agent_of(2, store, round_number=1)
    assert node0.crossnode.round_prefix == node2.crossnode.round_prefix
    node2_finished: list[bool] = []
    clock.at(0.5, lambda: node2_finished.append(finished(node2, 10.0, NOBODY_WAITS)))
    assert finished(node0, 10.0, NOBODY_WAITS) is True
    assert waited(clock, 0.5) and node2_finished == [True]
    assert "node1" not in capsys.readouterr().err
    assert node0.crossnode.failures_of_other_nodes([], 2) == []  # its root cause would not name node1 either


def test_a_later_round_does_not_restart_for_an_end_of_job_said_in_an_earlier_one(store):
    agent_of(1, store, round_number=0).crossnode.post_end_of_job("node1 ends the job: rank 1 refused its settings")
    assert (
        agent_of(1, store, round_number=0).crossnode.end_of_job_posted()
        == "node1 ends the job: rank 1 refused its settings"
    )
    assert agent_of(0, store, round_number=1).crossnode.end_of_job_posted() is None
