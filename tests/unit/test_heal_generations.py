"""The generations' keys on a real TCPStore: what a launcher that found a node lost opens."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from phalanx.runtime.heal.generations import heal_prefix, live_generation, open_for_a_lost_node


def a_store() -> tuple[dist.Store, dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    return dist.PrefixStore(heal_prefix("job", 0), server), server


def test_no_generation_is_opened_before_the_ranks_formed_the_first():
    store, _server = a_store()
    assert live_generation(store) is None
    assert open_for_a_lost_node(store, "the launcher of node a") is None
    assert not store.check(["opened/1"])


def test_the_generation_after_the_live_one_is_opened_and_a_ranks_opening_is_kept():
    store, _server = a_store()
    store.set("live", "2")
    assert open_for_a_lost_node(store, "the launcher of node a (node b sent no sign of life for 3 s)") == 3
    assert store.get("opened/3") == b"the launcher of node a (node b sent no sign of life for 3 s)"
    store.set("opened/4", "rank 1")
    store.set("live", "3")
    assert open_for_a_lost_node(store, "the launcher of node a") == 4
    assert store.get("opened/4") == b"rank 1"  # the rank that noticed first is named
