"""`phalanx doctor` as a real gloo job on simulated nodes: every section measured, no problem."""

from __future__ import annotations

import json


def test_doctor_on_two_simulated_nodes_measures_and_finds_no_problem(phalanx) -> None:
    # 16 MiB one way: on a loaded 2-core host a 4 MiB transfer can take less than half a noisy
    # round trip, which the probe rightly reports as not timed (bandwidth None).
    done = phalanx("doctor", "--simulate-nodes", "2", "--nproc-per-node", "2", "--p2p-size", "16M", "--max-bytes", "4M",
                   "--json", timeout=240)  # fmt: skip
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    assert [node["label"] for node in report["nodes"]] == ["node0", "node1"]
    assert [node["ranks"] for node in report["nodes"]] == [[0, 1], [2, 3]]
    assert report["simulated"] is True
    [link] = report["links"]
    assert (link["source"], link["target"]) == (0, 2)  # the lead ranks of the two nodes
    assert link["bandwidth_bytes_per_s"] > 0 and 0 < link["latency_s"] < 1
    assert report["network"] == {"bandwidth_bytes_per_s": link["bandwidth_bytes_per_s"], "latency_s": link["latency_s"]}
    assert [row["size_bytes"] for row in report["allreduce"]["rows"]] == [1024**2, 4 * 1024**2]
    assert report["allreduce"]["wrong"] == 0
    assert sorted(c["rank"] for c in report["compute"]) == [0, 1, 2, 3]
    assert [offset["rank"] for offset in report["clock_offsets"]] == [2]
    assert abs(report["clock_offsets"][0]["offset_s"]) < 0.5  # one clock: only the probe's error
    assert not [f for f in report["findings"] if f["severity"] == "problem"]


def test_doctor_text_on_one_node(phalanx) -> None:
    done = phalanx("doctor", "--p2p-size", "1M", "--max-bytes", "1M", timeout=120)
    assert done.returncode == 0, done.output
    for section in ("nodes (the rows below", "links between nodes\n  none: one node", "all_reduce over all 1 ranks",
                    "compute (512x512", "verdict", "phalanx doctor: 0 problems"):  # fmt: skip
        assert section in done.stdout


def test_doctor_in_heal_mode_leaves_per_process_variables_out(phalanx) -> None:
    # Heal mode gives each rank a supervisor, whose pid (PHALANX_SUPERVISOR_PID) differs between
    # the nodes of every healthy job: compared, it failed every doctor run with --heal.
    done = phalanx("doctor", "--simulate-nodes", "2", "--heal", "1", "--max-restarts", "1", "--p2p-size", "1M",
                   "--max-bytes", "1M", "--json", timeout=180)  # fmt: skip
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    assert [node["facts"]["env PHALANX_HEAL"] for node in report["nodes"]] == ["1", "1"]  # heal mode reached them
    assert not [f for f in report["findings"] if f["severity"] == "problem"]
