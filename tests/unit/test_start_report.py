"""Where a start's seconds went (phalanx.launch.start_report): a worker's record of its first
optimizer step, a node's phases, the one line. The whole path, from `phalanx run` to the line
and the run's record, is tested in tests/e2e/test_simulated.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import torch

from phalanx.launch.start_report import (
    PHASES,
    RESTART_PHASES,
    START_RECORD_NAME,
    FirstStepWatch,
    StartReporter,
    node_phases,
    restart,
    start_line,
)

TIMES = {"launched": 100.0, "agent": 101.5, "met": 102.0, "started": 103.0}


def test_the_first_optimizer_step_is_recorded_once(tmp_path):
    path = tmp_path / START_RECORD_NAME
    FirstStepWatch(path, SimpleNamespace(began=1.0, formed=2.0)).install()
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    before = time.time()
    weight.sum().backward()
    optimizer.step()
    record = json.loads(path.read_text())
    assert record["group_began"] == 1.0 and record["group_formed"] == 2.0, record
    assert before <= record["first_step"] <= time.time(), record
    path.unlink()
    optimizer.step()  # the hook removed itself: torch's global hooks hold nothing of it
    assert not path.exists()


def test_a_nodes_phases_are_its_last_ranks():
    ranks = [{"group_began": 106.0, "group_formed": 107.0, "first_step": 110.0},
             {"group_began": 105.0, "group_formed": 107.2, "first_step": 109.0}]  # fmt: skip
    phases = node_phases(TIMES, ranks)
    assert list(phases) == list(PHASES)
    assert [round(seconds, 3) for seconds in phases.values()] == [1.5, 0.5, 1.0, 3.0, 1.2, 2.8]
    assert round(sum(phases.values()), 3) == 10.0  # from `phalanx run` to the last rank's first step


def test_a_rank_that_formed_no_group_gives_no_breakdown():
    ranks = [{"group_began": None, "group_formed": None, "first_step": 104.0}]
    assert node_phases(TIMES, ranks) is None
    assert node_phases(TIMES, []) is None


def test_the_line_gives_the_longest_start_and_names_the_node_waited_for():
    """node0 started first and waited for node1 in the lobby: its start took longest; node1 is the
    one the nodes waited for (it waited least)."""
    first = {"label": "node0", "phases": {**dict.fromkeys(PHASES, 1.0), "lobby": 4.25}}
    last = {"label": "node1", "phases": {**dict.fromkeys(PHASES, 1.0), "lobby": 0.1}}
    line = start_line([first, last])
    assert line.startswith("phalanx: start: 9.2 s to the first step on node0 (the nodes waited for node1): "
                           "launcher 1.0 s, lobby 4.2 s, "), line  # fmt: skip
    assert start_line([first]).startswith("phalanx: start: 9.2 s to the first step: launcher 1.0 s, ")


def test_a_later_rounds_start_counts_from_the_end_of_the_round_before():
    """A restart: the look that found the workers failed at 200, the rendezvous from 200.5 to 201.
    node2 joined the job in this round: it counts from its rendezvous (stopping 0), waited in it
    longest and took longest; the nodes waited for node1, which waited least in its rendezvous."""
    ranks = [{"group_began": 203.0, "group_formed": 203.5, "first_step": 205.0}]
    phases = node_phases({"ended": 200.0, "began": 200.5, "started": 201.0}, ranks, RESTART_PHASES)
    assert list(phases.items()) == [("stopping", 0.5), ("rendezvous", 0.5), ("workers' start", 2.0),
                                    ("process group", 0.5), ("first step", 1.5)]  # fmt: skip
    kind = restart(2)
    assert start_line([{"label": "node0", "phases": phases}], kind) == (
        "phalanx: restart 2: 5.0 s from the end of the round before to the first step: stopping 0.5 s, "
        "rendezvous 0.5 s, workers' start 2.0 s, process group 0.5 s, first step 1.5 s"
    )
    joined = {"label": "node2", "phases": node_phases({"ended": 196.0, "began": 196.0, "started": 201.0}, ranks,
                                                      RESTART_PHASES)}  # fmt: skip
    waited = {"label": "node1", "phases": {**phases, "rendezvous": 0.25}}
    line = start_line([{"label": "node0", "phases": phases}, joined, waited], kind)
    assert line.startswith("phalanx: restart 2: 9.0 s from the end of the round before to the first step on node2 "
                           "(the nodes waited for node1): stopping 0.0 s, rendezvous 5.0 s, "), line  # fmt: skip
    assert kind.record_name == "attempt_2/start.json"
    assert restart(0).title == "restart"  # a node's own first round, not the job's: no number of its own


def reporters(tmp_path, said: list[str], board: dict[int, dict]) -> tuple[list[StartReporter], list]:
    """Two nodes' reporters of one rank each; posts go to ``board`` (the store in a job)."""
    folders = []
    for node in range(2):
        folders.append(tmp_path / f"rank{node}")
        folders[-1].mkdir()
    made = [
        StartReporter(TIMES, f"node{node}", [folders[node]], post=lambda value, node=node: board.__setitem__(node, value),
                      gather=(lambda: [board[0], board[1]] if len(board) == 2 else None) if node == 0 else None,
                      report=said.append, run_dir=tmp_path)
        for node in range(2)
    ]  # fmt: skip
    return made, folders


RECORD = {"group_began": 104.0, "group_formed": 105.0, "first_step": 106.0}


def test_the_node_that_holds_rank_0_waits_for_every_node_and_says_it_once(tmp_path):
    board: dict[int, dict] = {}
    said: list[str] = []
    made, folders = reporters(tmp_path, said, board)
    for reporter in made:
        reporter.start()
    (folders[0] / START_RECORD_NAME).write_text(json.dumps(RECORD))
    time.sleep(0.6)
    assert said == [] and list(board) == [0]  # node1's rank has not stepped yet
    (folders[1] / START_RECORD_NAME).write_text(json.dumps({**RECORD, "first_step": 108.0}))
    made[1].finish(timeout=0.0)  # node1's workers finished: it posted before it said so
    made[0].finish(timeout=10.0)
    assert len(said) == 1 and "first step on node1" in said[0], said
    written = json.loads((tmp_path / START_RECORD_NAME).read_text())["nodes"]
    assert [node["label"] for node in written] == ["node0", "node1"], written


def test_a_node_without_records_ends_the_wait_at_once_and_nothing_is_said(tmp_path):
    """A script that never stepped an optimizer: each node posts that it has no phases as its
    workers finish, and the gathering node stops looking without a line, not after a bound."""
    board: dict[int, dict] = {}
    said: list[str] = []
    made, folders = reporters(tmp_path, said, board)
    (folders[0] / START_RECORD_NAME).write_text(json.dumps(RECORD))
    made[1].finish(timeout=0.0)
    started = time.monotonic()
    made[0].finish(timeout=30.0)
    assert time.monotonic() - started < 5 and said == [] and board[1]["phases"] is None, board
    assert not (tmp_path / START_RECORD_NAME).exists()


def test_a_record_older_than_the_start_is_not_this_starts(tmp_path):
    said: list[str] = []
    (tmp_path / START_RECORD_NAME).write_text(json.dumps({**RECORD, "first_step": TIMES["started"] - 60}))
    reporter = StartReporter(TIMES, "node0", [tmp_path], post=None, gather=None, report=said.append,
                             run_dir=tmp_path / "run")  # fmt: skip
    reporter.finish(timeout=0.0)
    assert said == []
