"""The doctor's verdict rules, each on a report that triggers it and one that does not."""

from __future__ import annotations

import argparse
import copy
import re

import pytest

from phalanx.cli.main import build_parser
from phalanx.diagnostics.verdict import verdict


def cli_flags(commands: tuple[str, ...]) -> set[str]:
    """Every flag of these phalanx commands."""
    [commands_action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = [commands_action.choices[name] for name in commands]
    return {flag for parser in parsers for action in parser._actions for flag in action.option_strings}


def healthy_report() -> dict:
    facts = {"torch": "2.13.0", "phalanx": "0.1.0", "env NCCL_DEBUG": "WARN"}
    return {
        "world_size": 2, "backend": "gloo", "simulated": False,
        "ranks": [{"rank": 0, "node": "10.0.0.1"}, {"rank": 1, "node": "10.0.0.2"}],
        "nodes": [
            {"label": "10.0.0.1", "address": "10.0.0.1", "host": "a", "ranks": [0], "gpus": 0, "processes": 1,
             "facts": dict(facts), "traps": [], "networks": []},
            {"label": "10.0.0.2", "address": "10.0.0.2", "host": "b", "ranks": [1], "gpus": 0, "processes": 1,
             "facts": dict(facts), "traps": [], "networks": []},
        ],
        "clock_offsets": [{"rank": 1, "offset_s": 0.01, "round_trip_s": 0.0002}],
        "links": [{"source": 0, "target": 1, "latency_s": 5e-5, "bandwidth_bytes_per_s": 1.2e9}],
        "networks": [],
        "allreduce": {"wrong": 0},
        "compute": [{"rank": 0, "gflops": 50.0, "matrix": 512}, {"rank": 1, "gflops": 48.0, "matrix": 512}],
    }  # fmt: skip


def topics(report: dict) -> dict[str, str]:
    return {finding.topic: finding.severity for finding in verdict(report)}


def test_a_healthy_report_has_no_findings() -> None:
    assert verdict(healthy_report()) == []


def test_a_different_version_names_the_odd_node_and_is_a_problem() -> None:
    report = healthy_report()
    report["nodes"].append(
        copy.deepcopy(report["nodes"][1]) | {"label": "10.0.0.3", "address": "10.0.0.3", "host": "c"}
    )
    report["nodes"][2]["facts"]["torch"] = "2.4.1"
    [finding] = verdict(report)
    assert finding.severity == "problem" and finding.topic == "differs:torch"
    assert finding.what == "node 10.0.0.3 has torch = 2.4.1, the others 2.13.0"


def test_a_variable_set_on_one_node_only_is_a_problem() -> None:
    report = healthy_report()
    del report["nodes"][0]["facts"]["env NCCL_DEBUG"]
    finding = verdict(report)[0]
    assert finding.topic == "differs:env NCCL_DEBUG" and "(not set)" in finding.what


@pytest.mark.parametrize(
    "change, topic, severity",
    [
        (lambda r: r["nodes"][1].update(host="a"), "duplicate-hostname", "problem"),
        (lambda r: r.update(backend="nccl") or r["nodes"][0].update(processes=2, gpus=1), "gpus-short", "problem"),
        (lambda r: r["nodes"][0].update(gpus=4), "gpus-idle", "warning"),
        (lambda r: r["clock_offsets"][0].update(offset_s=-3.0), "clock-offset", "warning"),
        (lambda r: r["links"][0].update(bandwidth_bytes_per_s=1.2e8), "slow-link", "warning"),
        (lambda r: r["compute"][1].update(gflops=20.0), "straggler", "warning"),
        (lambda r: r["allreduce"].update(wrong=3), "allreduce-wrong", "problem"),
    ],
)
def test_each_rule_fires_on_its_measurement(change, topic: str, severity: str) -> None:
    report = healthy_report()
    change(report)
    assert topics(report) == {topic: severity}
    # a flag a finding names is one that phalanx has (the slow-link HINT once named
    # `--compression`, which only the example script and `bench ddp` take, not `phalanx run`)
    words = " ".join(f"{finding.what} {finding.hint}" for finding in verdict(report))
    unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", words)) - cli_flags(("run", "doctor", "plan"))
    assert not unknown, words


def test_simulated_nodes_may_share_a_hostname() -> None:
    report = healthy_report()
    report["nodes"][1]["host"] = "a"
    report["simulated"] = True
    assert verdict(report) == []


def test_the_slow_link_hint_is_computed_from_the_two_measurements() -> None:
    report = healthy_report()
    report["links"][0]["bandwidth_bytes_per_s"] = 1.25e8  # 1 Gbit/s
    [finding] = verdict(report)
    # ring over 2 ranks: 2(n-1)/n x 4 B / 125 MB/s = 32 ns per parameter = 32 ms per million
    assert "about 1 Gbit/s" in finding.what and "32 ms per step for every 1 M" in finding.what
    # 32e-9 s x 49e9 FLOP/s (median) / 6 FLOPs per parameter-sample = 261 samples
    assert "under ~261 samples" in finding.what and "powersgd" in finding.hint


def test_the_hostname_trap_counts_only_between_machines() -> None:
    trap = {"topic": "hostname-loopback", "what": "the hostname 'a' resolves to 127.0.1.1", "why": "", "hint": "x",
            "between_machines": True}  # fmt: skip
    report = healthy_report()
    report["nodes"][0]["traps"] = [trap]
    assert topics(report) == {"hostname-loopback": "warning"}
    report["simulated"] = True  # every node on this host: a doctor --strict rehearsal passes
    assert verdict(report) == []
    report = healthy_report()
    report["nodes"], report["nodes"][0]["traps"] = report["nodes"][:1], [trap]
    assert verdict(report) == []


def test_a_trap_on_every_node_is_reported_once() -> None:
    report = healthy_report()
    for node in report["nodes"]:
        node["traps"] = [{"topic": "shm-small", "what": "/dev/shm is 64 MiB", "why": "", "hint": "mount more"}]
    [finding] = verdict(report)
    assert finding.what == "every node: /dev/shm is 64 MiB"


def test_problems_come_before_warnings() -> None:
    report = healthy_report()
    report["compute"][1]["gflops"] = 10.0
    report["allreduce"]["wrong"] = 1
    assert [finding.severity for finding in verdict(report)] == ["problem", "warning"]


def test_a_logging_variable_or_a_python_patch_release_apart_is_only_a_warning() -> None:
    report = healthy_report()
    report["nodes"][1]["facts"]["env NCCL_DEBUG"] = "INFO"
    report["nodes"][0]["facts"]["python"], report["nodes"][1]["facts"]["python"] = "3.11.7", "3.11.9"
    assert topics(report) == {"differs:env NCCL_DEBUG": "warning", "differs:python": "warning"}
    report["nodes"][1]["facts"]["python"] = "3.12.1"
    assert topics(report)["differs:python"] == "problem"


def test_a_link_too_short_to_time_is_said_not_hidden() -> None:
    report = healthy_report()
    report["links"][0]["bandwidth_bytes_per_s"] = None
    assert topics(report) == {"link-unmeasured": "warning"}


def test_the_clock_says_ahead_or_behind() -> None:
    report = healthy_report()
    report["clock_offsets"][0]["offset_s"] = -2.5
    [finding] = verdict(report)
    assert finding.what == "node 10.0.0.2's clock is 2.50 s behind rank 0's"


def test_a_fast_link_still_warns_when_dense_steps_cannot_hide_it() -> None:
    report = healthy_report()
    report["world_size"] = 16
    report["links"][0]["bandwidth_bytes_per_s"] = 1.25e9  # 10 Gbit/s
    for rank in report["compute"]:
        rank["gflops"] = 50_000.0  # a GPU: the all-reduce needs batches of ~50,000 to hide
    assert topics(report) == {"slow-link": "warning"}
