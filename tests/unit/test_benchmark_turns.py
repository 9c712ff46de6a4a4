"""benchmarks/loop_overhead.py's method: two jobs' turns never overlap, the waits are not timed,
turns add up to intervals, the median's confidence interval takes the right order statistics,
and the target is decided by the pairs and the launches together; --pin binds each rank to its CPU."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import loop_overhead
from turns import BlockClock, Referee, Turns


def test_two_jobs_train_their_blocks_in_turns_and_time_only_their_own(tmp_path):
    blocks, block_s = 3, 0.05
    path = tmp_path / "turns.sock"
    referee = Referee(path, ("first", "second"), ranks_per_job=2)
    trained: list[tuple[str, int, float, float]] = []  # (job, rank, start, end) of every block
    clocks: dict[tuple[str, int], BlockClock] = {}
    readings: dict[tuple[str, int], list[float]] = {}  # when each rank's clock was read, in order

    def rank(job: str, rank: int) -> None:
        read = readings[job, rank] = []
        wall = lambda: read.append(time.monotonic()) or read[-1]  # noqa: E731 - the test's clock, recorded
        clock = clocks[job, rank] = BlockClock(samples_per_step=8, turns=Turns(str(path), job, rank), wall=wall)
        for step in range(1, blocks + 1):
            clock.boundary(step)
            start = time.monotonic()
            time.sleep(block_s)
            trained.append((job, rank, start, time.monotonic()))
        clock.boundary(blocks + 1)

    threads = [threading.Thread(target=rank, args=(job, r), daemon=True) for job in ("second", "first") for r in (0, 1)]
    for thread in threads:
        thread.start()
    referee.run(blocks)
    for thread in threads:
        thread.join(timeout=30)
    referee.close()

    assert not any(thread.is_alive() for thread in threads)
    order = sorted(trained, key=lambda block: block[2])
    assert [job for job, *_ in order] == ["first"] * 2 + ["second"] * 2 + ["first"] * 2 + ["second"] * 2 + [
        "first"
    ] * 2 + ["second"] * 2
    for (job, _, _, end), (other, _, start, _) in zip(order, order[1:]):
        assert job == other or end <= start  # a job starts only once the other's ranks are done
    for (job, rank), clock in clocks.items():
        assert [samples for samples, _, _ in clock.blocks] == [8] * blocks
        # Each block is timed from its turn to its end, by order rather than by a bound on the
        # seconds (which a loaded machine stretches): the clock is read twice at each boundary,
        # before and after the wait for the turn, and block k is what lies between the reading
        # after boundary k's wait and the reading before boundary k+1's. That interval holds
        # this rank's own block k and none of the other job's blocks, which it would if the
        # wait were timed.
        read = readings[job, rank]
        assert len(read) == 2 * (blocks + 1)
        own = [(start, end) for j, r, start, end in trained if (j, r) == (job, rank)]
        others = [(start, end) for j, _, start, end in trained if j != job]
        for k, (_, seconds, _) in enumerate(clock.blocks):
            started, ended = read[2 * k + 1], read[2 * k + 2]
            assert seconds == ended - started
            assert started <= own[k][0] and own[k][1] <= ended
            assert all(end <= started or ended <= start for start, end in others), (k, started, ended, others)


def test_turns_add_up_to_intervals_of_log_every_steps(tmp_path):
    # digits: boundaries after step 1 and every 7 steps; an interval is 56 steps, the first 55
    workload = loop_overhead.Workload("digits", loop_overhead.WORKLOADS["digits"], 7)
    steps = loop_overhead.steps_of(workload)
    boundaries = [step for step in range(1, steps + 1) if loop_overhead.is_boundary(step, 7)]
    blocks = [((stop - start) * 64, 0.1 * (stop - start), 0.05) for start, stop in zip(boundaries, boundaries[1:])]
    (tmp_path / "plain.json").write_text(json.dumps(blocks))
    intervals = loop_overhead.read_intervals("plain", workload, tmp_path)
    assert [i.samples / 64 for i in intervals] == [55] + [56] * (steps // 56 - 1)
    assert intervals[1].seconds == pytest.approx(5.6) and intervals[1].cpu_seconds == pytest.approx(0.4)


@pytest.mark.parametrize(("count", "expected"), [(5, None), (6, (0, 5)), (10, (1, 8)), (50, (17, 32))])
def test_the_median_interval_takes_the_binomial_order_statistics(count, expected):
    # the textbook table: n = 6 -> (x1, x6) at 96.9%, n = 10 -> (x2, x9), n = 50 -> (x18, x33)
    assert loop_overhead.median_interval([float(v) for v in reversed(range(count))]) == (
        None if expected is None else tuple(float(v) for v in expected)
    )


@pytest.mark.parametrize(("intervals", "expected"), [
    (((0.975, 0.99), (0.971, 1.01)), "met"),
    (((0.975, 0.99), (0.95, 1.01)), "not decided"),  # the pairs' interval alone would say met
    (((0.90, 0.96), (0.93, 0.965)), "not met"),
    (((0.90, 0.96), (0.93, 0.99)), "not decided"),
    (((0.975, 0.99), None), "too few runs"),
])  # fmt: skip
def test_the_target_is_decided_only_when_the_pairs_and_the_launches_agree(intervals, expected):
    assert loop_overhead.verdict(*intervals) == expected


def test_a_rank_that_leaves_mid_run_is_reported_not_waited_for(tmp_path):
    import socket

    path = tmp_path / "turns.sock"
    referee = Referee(path, ("only",), ranks_per_job=1)

    def leave_after_hello() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(path))
            connection.sendall(b"only 0\n")
            connection.recv(1)  # its first turn: it leaves instead of training it

    thread = threading.Thread(target=leave_after_hello, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a rank of the only job left before the end of its block"):
        referee.run(blocks=2)
    referee.close()
    thread.join(timeout=10)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("local_rank", [0, 1])
def test_pin_binds_a_rank_and_the_threads_it_starts_to_the_cpu_of_its_local_rank(monkeypatch, local_rank):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs this process may use")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    seen: dict[str, set[int]] = {}

    def worker() -> None:  # a thread: sched_setaffinity(0) binds the calling thread, so the test's stays free
        loop_overhead.pin_to_own_cpu()
        seen["rank"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.__setitem__("started later", os.sched_getaffinity(0)))
        child.start()
        child.join()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=10)
    assert seen == {"rank": {allowed[local_rank]}, "started later": {allowed[local_rank]}}
    assert sorted(os.sched_getaffinity(0)) == allowed
