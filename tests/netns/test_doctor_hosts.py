"""`phalanx doctor` on two namespace hosts: a planted difference and a shaped 1 Gbit link.

Skipped where network namespaces cannot be made (not root); CI runs as root.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from phalanx.testbed import phalanx_argv, run_together
from tests.netns.hosts import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PORT = "29400"


def doctor_line(host, endpoint: str, folder, *env: str) -> list[str]:
    doctor = [sys.executable, "-m", "phalanx", "doctor", "--nnodes", "2", "--rdzv-endpoint", f"{endpoint}:{PORT}",
              "--join-timeout", "60", "--p2p-size", "8M", "--max-bytes", "8M", "--json"]  # fmt: skip
    # in a folder of its own, as on a machine of its own; the JSON goes to a file: stdout and
    # stderr arrive merged here
    folder.mkdir()
    script = f"cd {shlex.quote(str(folder))} && {shlex.join(doctor)} > report.json"
    return host.command(["env", *env, "sh", "-c", script])


def test_doctor_names_the_planted_difference_and_the_slow_link(workdir):
    with two_hosts("d", rate="1gbit") as (a, b):
        outcomes = run_together(
            [doctor_line(a, a.address, workdir / "a"), doctor_line(b, a.address, workdir / "b", "NCCL_IB_DISABLE=1")],
            timeout=180, cwd=str(workdir),
        )  # fmt: skip
        # Host a ran rank 0: it prints the report and the verdict's exit code; host b says where
        # the report is. (Nodes in one folder share the report only when they start within the
        # same second: each names its run folder by the second it started.)
        assert [o.returncode for o in outcomes] == [1, 0], [o.output[-3000:] for o in outcomes]
        assert (workdir / "b" / "report.json").read_text() == ""
        assert "the doctor's report is printed by the node that ran global rank 0" in outcomes[1].output
        report = json.loads((workdir / "a" / "report.json").read_text())
        findings = {f["topic"]: f for f in report["findings"]}
        planted = findings["differs:env NCCL_IB_DISABLE"]
        assert planted["severity"] == "problem"
        assert planted["what"] == f"node {b.address} has env NCCL_IB_DISABLE = 1, the others (not set)"
        [link] = report["links"]
        gbit = link["bandwidth_bytes_per_s"] * 8 / 1e9
        # tbf rate 1gbit, measured: at most the rate; the lower bound leaves room for the other
        # pytest-xdist worker's training on the same 2 cores (an unshaped veth measures far above)
        assert 0.25 < gbit < 1.1, link
        slow = findings["slow-link"]
        assert slow["severity"] == "warning" and f"about {gbit:.2g} Gbit/s" in slow["what"]
        assert [node["interface"] for node in report["nodes"]] == [a.device, b.device]


def test_doctor_alone_reports_the_missing_node_and_stops(workdir):
    with two_hosts("n") as (a, b):
        line = a.command([sys.executable, "-m", "phalanx", "doctor", "--nnodes", "2", "--rdzv-endpoint",
                          f"{a.address}:{PORT}", "--join-timeout", "4"])  # fmt: skip
        [alone] = run_together([line], timeout=60, cwd=str(workdir))
        assert alone.returncode == 3, alone.output[-3000:]
        assert "only 1 of 2 nodes joined" in alone.output and f"joined: {a.address}" in alone.output, alone.output[
            -3000:
        ]


def test_nodes_started_with_different_doctor_settings_stop_with_a_table(workdir):
    with two_hosts("s") as (a, b):
        doctor = ["doctor", "--nnodes", "2", "--rdzv-endpoint", f"{a.address}:{PORT}", "--join-timeout", "60"]
        lines = [host.command(phalanx_argv(*doctor, "--p2p-size", size)) for host, size in ((a, "4M"), (b, "8M"))]
        outcomes = run_together(lines, timeout=90, cwd=str(workdir))
        for outcome in outcomes:  # refused in the lobby, before any measurement could hang
            assert outcome.returncode == 2, outcome.output[-3000:]
            assert "p2p_bytes" in outcome.output and "4194304" in outcome.output and "8388608" in outcome.output
