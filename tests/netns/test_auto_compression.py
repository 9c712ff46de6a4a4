"""--compression auto across two real hosts on a 1 Gbit link: both decide alike, and it trains.

Which candidate wins on which link is measured by benchmarks/auto_compression.py, not asserted
here: on this shared 2-core machine, step times swing by 2x with the load, which would make such
an assertion a coin toss. What must hold on any load is asserted: the two hosts' ranks choose
the same candidate from the same numbers and the run completes and learns.
"""

from __future__ import annotations

import json

import pytest

from phalanx.testbed import phalanx_argv, run_together
from tests.conftest import EXAMPLES
from tests.e2e.test_compression import decisions
from tests.netns.hosts import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def test_auto_over_a_shaped_link_makes_one_decision_on_both_hosts(workdir):
    out = workdir / "metrics.json"
    train = [str(EXAMPLES / "train.py"), "--epochs", "4", "--compression", "auto", "--metrics-json", str(out)]
    with two_hosts("z", rate="1gbit") as (a, b):
        line = phalanx_argv("run", "--nnodes", "2", "--rdzv-endpoint", f"{a.address}:29400", *train)
        outcomes = run_together([a.command(line), b.command(line)], timeout=180, cwd=str(workdir))
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.output[-4000:]
    shown = decisions(outcomes[0].output)
    assert len(shown) == 1 and set(shown[0][1]) == {"none", "fp16", "powersgd"}, outcomes[0].output[-3000:]
    rank1 = next(workdir.glob("phalanx-logs/*/attempt_0/rank1/stdout.log"))  # written on host b
    assert decisions(rank1.read_text()) == shown
    metrics = json.loads(out.read_text())
    assert metrics["world_size"] == 2 and metrics["accuracy"] > 0.7, metrics
