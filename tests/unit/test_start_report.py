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
    START_RECORD_NAME,
    FirstStepWatch,
    StartReporter,
    node_phases,
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


def test_the_line_names_the_slowest_node():
    fast = {"label": "node0", "phases": dict.fromkeys(PHASES, 1.0)}
    slow = {"label": "node1", "phases": {**dict.fromkeys(PHASES, 1.0), "workers' start": 4.25}}
    line = start_line([fast, slow])
    assert line.startswith("phalanx: start: 9.2 s to the first step (slowest node: node1): launcher 1.0 s, "), line
    assert "workers' start 4.2 s" in line or "workers' start 4.3 s" in line, line
    assert "slowest" not in start_line([fast])


def test_the_node_that_holds_rank_0_waits_for_every_node_and_says_it_once(tmp_path):
    """Posts go to a board (a dict here; the store in a job); the line comes once both nodes posted."""
    board: dict[int, dict] = {}
    said: list[str] = []
    folders = []
    for node in range(2):
        folder = tmp_path / f"rank{node}"
        folder.mkdir()
        folders.append(folder)
    reporters = [
        StartReporter(TIMES, f"node{node}", [folders[node]], post=lambda value, node=node: board.__setitem__(node, value),
                      gather=(lambda: [board[0], board[1]] if len(board) == 2 else None) if node == 0 else None,
                      report=said.append, run_dir=tmp_path)
        for node in range(2)
    ]  # fmt: skip
    for reporter in reporters:
        reporter.start()
    record = {"group_began": 104.0, "group_formed": 105.0, "first_step": 106.0}
    (folders[0] / START_RECORD_NAME).write_text(json.dumps(record))
    time.sleep(0.6)
    assert said == [] and list(board) == [0]  # node1's rank has not stepped yet
    (folders[1] / START_RECORD_NAME).write_text(json.dumps({**record, "first_step": 108.0}))
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(said) == 1 and "(slowest node: node1)" in said[0], said
    assert [node["label"] for node in json.loads((tmp_path / START_RECORD_NAME).read_text())["nodes"]] == ["node0",
                                                                                                          "node1"]  # fmt: skip
    for reporter in reporters:
        reporter.stop()
