"""What the nodes tell each other about their workers holds for one rendezvous round
(phalanx.launch.rounds): the round's name, agreed on a real TCPStore over loopback, and the
torch agent's hook that hands each round's store to phalanx."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from phalanx.launch.logs import RankLogsSpecs
from phalanx.launch.restarts import restarts_only_when_they_can_help
from phalanx.launch.rounds import agree_on_round


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def round_store(store: TCPStore, number: int) -> PrefixStore:
    """What torch's c10d rendezvous hands the nodes of its round ``number``."""
    return PrefixStore(f"torch.rendezvous.job.{number}", store)


def test_the_nodes_of_a_round_agree_on_its_name_and_the_next_round_gets_another(store):
    first = [agree_on_round(store, "phalanx/job/", round_store(store, 0), "x") for _ in range(3)]
    later = [agree_on_round(store, "phalanx/job/", round_store(store, 1), "x") for _ in range(2)]
    assert len(set(first)) == 1 and len(set(later)) == 1
    assert first[0] != later[0]


def test_without_the_store_a_node_takes_a_name_no_other_node_reads(store):
    class Gone:
        def add(self, *_):
            raise ConnectionError("the store's host is gone")

    assert agree_on_round(Gone(), "phalanx/job/", round_store(store, 0), "node1-2") == "node1-2"


class OneNodeRendezvous(RendezvousHandler):
    """A rendezvous whose every round is one node, on the round's own prefix of ``store``."""

    def __init__(self, store: TCPStore) -> None:
        self.store, self.round = store, 0

    def next_rendezvous(self) -> RendezvousInfo:
        self.round += 1
        return RendezvousInfo(round_store(self.store, self.round), 0, 1, RendezvousStoreInfo("127.0.0.1", 29500))

    def get_backend(self) -> str:
        return "test"

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


def test_torchs_agent_hands_every_rounds_store_to_phalanx(store, tmp_path, monkeypatch):
    """The hook rides on torch's own agent (torch 2.13): each rendezvous, the round's store and
    times. A round after the first ended where torch's last look at its workers began (a look
    that finds one failed also stops the others: here it takes 0.3 s)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.launcher import api

    def a_slow_look(_agent, _group):
        time.sleep(0.3)
        return RunResult(state=WorkerState.HEALTHY)

    monkeypatch.setattr(api.LocalElasticAgent, "_monitor_workers", a_slow_look)  # no workers run here

    seen: list[str] = []
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=OneNodeRendezvous(store), entrypoint="true")
    with restarts_only_when_they_can_help(lambda *_: True, lambda *_: True, new_round=lambda s, times: seen.append(
            (agree_on_round(store, "phalanx/job/", s, "x"), times))):  # fmt: skip
        agent = api.LocalElasticAgent(spec, RankLogsSpecs(log_dir=str(tmp_path)))
    group = WorkerGroup(spec)
    before = time.time()
    agent._rendezvous(group)
    looked = time.time()
    assert agent._monitor_workers(group).state == WorkerState.HEALTHY
    agent._rendezvous(group)
    (first, first_times), (second, second_times) = seen
    assert first != second
    assert group.store.compare_set("phalanx/round", "", "?").decode() == second
    assert first_times.ended is None and before <= first_times.began <= looked, first_times  # the job's first round
    assert looked <= second_times.ended < looked + 0.2 and second_times.ended + 0.3 <= second_times.began, second_times
