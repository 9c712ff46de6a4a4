"""The generations' keys on a real TCPStore: what a launcher that found a node lost opens."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from phalanx.runtime.heal.generations import (
    Leaving,
    heal_prefix,
    live_generation,
    live_members,
    open_for_a_lost_node,
)


def a_store() -> tuple[dist.Store, dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    return dist.PrefixStore(heal_prefix("job", "start-0"), server), server


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


def test_a_lost_nodes_ranks_leave_the_next_generation_and_each_launchers_loss_counts():
    store, _server = a_store()
    store.set("live", "0")
    assert live_members(store, 4) == [0, 1, 2, 3]
    assert open_for_a_lost_node(store, "the launcher of node a", leaving=Leaving(4, [2, 3], bool)) == 1
    assert live_members(store, 4) == [0, 1]  # proposed: a launcher counts them out already
    assert (
        open_for_a_lost_node(store, "the launcher of node b", leaving=Leaving(4, [1], bool)) == 1
    )  # another node, lost too
    assert store.get("g1/members") == b"0"
    assert (
        open_for_a_lost_node(store, "the launcher of node b", leaving=Leaving(4, [0], bool)) is None
    )  # none would be left
    assert store.get("g1/members") == b"0"


def test_a_later_loss_leaves_from_the_members_the_ranks_formed_with():
    store, _server = a_store()
    store.set("live", "1")
    store.set("g1/all", "0,2,3")  # generation 1 formed without rank 1
    assert live_members(store, 4) == [0, 2, 3]
    assert open_for_a_lost_node(store, "the launcher of node a", leaving=Leaving(4, [3], bool)) == 2
    assert store.get("g2/members") == b"0,2"
    store.set("live", "2")
    store.set("g2/all", "0,2")
    assert (
        open_for_a_lost_node(store, "the launcher of node b", leaving=Leaving(4, [3], bool)) == 2
    )  # left already: none opened
    assert not store.check(["opened/3"])


def test_a_generation_being_formed_with_the_lost_ranks_is_left_for_the_next():
    store, _server = a_store()
    store.set("live", "0")
    store.set("g1/all", "0,1,2")  # every rank arrived at generation 1 before the verdict: forming it
    assert open_for_a_lost_node(store, "the launcher of node a", leaving=Leaving(3, [2], bool)) == 2
    assert store.get("g2/members") == b"0,1" and store.check(["opened/2"])


def test_a_loss_that_would_leave_too_few_opens_nothing():
    store, _server = a_store()
    store.set("live", "0")
    at_least_two = lambda kept: len(kept) >= 2  # noqa: E731
    assert open_for_a_lost_node(store, "the launcher of node a", leaving=Leaving(3, [2], at_least_two)) == 1
    assert open_for_a_lost_node(store, "the launcher of node a", leaving=Leaving(3, [1], at_least_two)) is None
    assert store.get("g1/members") == b"0,1"  # the second loss is not proposed
