"""The turns of benchmarks/loop_overhead.py: two jobs' blocks never overlap, and the waits are not timed."""

from __future__ import annotations

import sys
import threading
import time

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from turns import BlockClock, Referee, Turns  # noqa: E402  (a benchmark's sibling module, not a package)


def test_two_jobs_train_their_blocks_in_turns_and_time_only_their_own(tmp_path):
    blocks, block_s = 3, 0.05
    path = tmp_path / "turns.sock"
    referee = Referee(path, ("first", "second"), ranks_per_job=2)
    trained: list[tuple[str, int, float, float]] = []  # (job, rank, start, end) of every block
    clocks: dict[tuple[str, int], BlockClock] = {}

    def rank(job: str, rank: int) -> None:
        clock = clocks[job, rank] = BlockClock(samples_per_step=8, turns=Turns(str(path), job, rank))
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
    assert [job for job, *_ in order] == ["first"] * 2 + ["second"] * 2 + ["first"] * 2 + ["second"] * 2 + ["first"] * 2 + ["second"] * 2
    for (job, _, _, end), (other, _, start, _) in zip(order, order[1:]):
        assert job == other or end <= start  # a job starts only once the other's ranks are done
    for clock in clocks.values():
        assert [samples for samples, _, _ in clock.blocks] == [8] * blocks
        # each block is timed from its turn to its end: the other job's block (as long) is not in it
        assert all(block_s <= seconds < 1.8 * block_s for _, seconds, _ in clock.blocks), clock.blocks
