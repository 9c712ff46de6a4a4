"""Choosing and wording the root cause among the failures torchrun reports."""

import signal

from phalanx.launch.failure import RankFailure, format_root_cause, root_cause, tail_of


def failure(rank, time, exitcode=1, tail=("Traceback (most recent call last):", "ValueError: x")):
    return RankFailure(rank, rank % 2, f"node{rank // 2}", f"127.0.0.{101 + rank // 2}", exitcode, time, f"r{rank}.log", tail)


def test_the_log_that_went_quiet_first_is_the_cause():
    found = [failure(0, 10.5), failure(3, 10.2), failure(1, 10.9)]
    assert root_cause(found).rank == 3


def test_a_rank_its_agent_terminated_is_never_the_cause():
    found = [failure(2, 1.0, exitcode=-signal.SIGTERM), failure(3, 5.0)]
    assert root_cause(found).rank == 3
    text = format_root_cause(found)
    assert text.startswith("phalanx: root cause: rank 3 (local rank 1) on node1 (127.0.0.102) exited with code 1")
    assert "stopped by their agent: rank 2" in text


def test_signals_are_named_and_known_endings_get_a_hint():
    text = format_root_cause([failure(0, 1.0, exitcode=-6, tail=("terminate called without an active exception",))])
    assert "was killed by SIGABRT" in text
    assert "HINT:" in text and "gc.collect()" in text


def test_tail_starts_at_the_last_traceback(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("noise\nTraceback (most recent call last):\n  old\nTraceback (most recent call last):\n  new\nKeyError: 1\n")
    assert tail_of(log) == ("Traceback (most recent call last):", "  new", "KeyError: 1")
    assert tail_of(tmp_path / "missing.log") == ()


def test_preemption_is_told_apart_from_a_failure():
    from phalanx.launch.failure import is_preemption

    assert is_preemption([failure(1, 1.0, exitcode=75), failure(0, 1.1, exitcode=-signal.SIGTERM)])
    assert not is_preemption([failure(0, 1.0, exitcode=-signal.SIGTERM)])
    assert not is_preemption([failure(1, 1.0, exitcode=75), failure(0, 1.1, exitcode=1)])
