"""--heal across test-bed hosts: every worker of one host dies, its launcher replaces them, and the
other host's workers keep their processes; the training ends with the parameters of a run that
nothing interrupted (tests/e2e/test_heal.py has the faults of one node).

Two hosts of 2 processes each train tests/e2e/workers/dies_in_a_step.py; the launchers meet at
h1's rendezvous endpoint, whose store the heal's generations form on too.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from phalanx.testbed import run_together, test_bed
from tests.e2e.test_heal import DIES_IN_A_STEP, references  # noqa: F401  (a module fixture of its own here)
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]


def test_a_hosts_workers_killed_are_replaced_and_the_other_hosts_keep_theirs(workdir, references):  # noqa: F811
    skip_unless_namespaces_work()
    pids = workdir / "pids"
    pids.mkdir()
    with test_bed(f"hh{os.getpid() % 10000}", ["h1", "h2"]) as bed:
        h1 = bed.hosts[0]
        line = [sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint",
                f"{h1.address}:29400", "--heal", "1", "--max-restarts", "1", DIES_IN_A_STEP, "--checkpoint-dir",
                "healed", "--out", "healed.json", "--pids", str(pids), "--fail-rank", "2,3", "--kill-step", "9"]  # fmt: skip
        outcomes = run_together([host.command(line) for host in bed.hosts], timeout=240, cwd=str(workdir))
    output = "".join(outcome.output for outcome in outcomes)
    assert [outcome.returncode for outcome in outcomes] == [0, 0], output[-6000:]
    assert "rank(s) 2, 3 replaced" in output and "going on after step 9" in output, output[-6000:]
    seen = [(pids / f"rank{rank}-first").read_text() == (pids / f"rank{rank}-last").read_text() for rank in range(4)]
    assert seen == [True, True, False, False], "only h2's ranks (2, 3) have new processes"
    healed = json.loads((workdir / "healed.json").read_text())
    assert healed["params_sha256"] == references(4)["params_sha256"]
    assert "restarting the workers" not in output, output[-6000:]
