"""Every benchmark runs end to end in its smoke mode (tiny sizes, one repeat) and writes its
report with each target's figure. Nothing here judges speed: the figures of a smoke run are noise.

A new file in benchmarks/ that is a benchmark (not a helper another one runs) is listed in
benchmarks/summary.py's BENCHMARKS; the first test fails until it is.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_command

sys.path.insert(0, str(REPO / "benchmarks"))
import summary

#: Scripts that other benchmarks run or import, and this runner itself.
HELPERS = {"auto_compression_worker", "detection_worker", "fabric_script", "plain_collective_loop", "recovery_worker",
           "turns", "targets", "summary"}  # fmt: skip
#: A smoke run takes seconds to three minutes here; the bound leaves room for a loaded machine.
SMOKE_TIMEOUT_S = 420
CHECKPOINT_METHODS = ("phalanx", "phalanx-async", "rank0-old", "torch-save", "dcp")


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def check_checkpoint_report(written: dict, output: str) -> None:
    """benchmarks/checkpoint.py: every method measured, with finite figures, in one run."""
    results = written["results"]
    assert list(results["sizes"]) == ["10M"] and results["skipped_sizes"] == {}, results["skipped_sizes"]
    size = results["sizes"]["10M"]
    assert size["rounds"] == 2 and list(size["methods"]) == list(CHECKPOINT_METHODS)
    for method, row in size["methods"].items():
        assert row["skipped"] == {}, (method, row["skipped"])
        assert len(row["runs"]) == 2, method
        figures = ["save_stall_s", "save_wall_s"] + (["load_s"] if method != "phalanx-async" else [])
        for name in figures:
            assert finite(row[name]) and row[name] > 0, (method, name, row[name])
        assert row["save_stall_s"] <= row["save_wall_s"] + 1e-9, method
        peaks = row["save_peak_extra_bytes"] + (row["load_peak_extra_bytes"] if method != "phalanx-async" else [])
        assert len(peaks) >= 2 and all(finite(p) for p in peaks), (method, peaks)
    # the async copy holds the whole share: its peak is at least the state
    assert min(size["methods"]["phalanx-async"]["save_peak_extra_bytes"]) >= size["state_bytes_per_rank"] * 0.9
    assert len(size["targets"]) == 6 and {t["verdict"] for t in size["targets"]} <= {"met", "not met"}, size["targets"]
    for line in ("phalanx load / dcp load", "stall/torch.save", "target phalanx-async stall / torch-save save"):
        assert line in output, output


def check_control_plane_report(written: dict, _stdout: str) -> None:
    """The smoke run's two sizes (8 and 16 nodes): a node's store operations per phase are the same."""
    rows = written["results"]["rows"]
    assert [row["nodes"] for row in rows] == [8, 16], rows
    assert rows[0]["ops_max"]["lobby"] == rows[1]["ops_max"]["lobby"] <= 11, rows
    assert rows[0]["ops_max"]["reach"] == rows[1]["ops_max"]["reach"] <= 7, rows
    for row in rows:  # torch's rendezvous beside it: every node joined, its figures measured
        assert finite(row["torch_rendezvous_s"]) and finite(row["torch_cpu_s"]), row
        assert row["torch_ops_max"] >= 3, row  # at least a read, a write and the read of the completed round
    assert written["results"]["beat_ops"] <= 4.5, written["results"]


def check_recovery_report(written: dict, _stdout: str) -> None:
    """The smoke trial's kill: phalanx resumed after the step the survivor kept; torchrun, with a
    fresh worker store per restart, at a checkpoint (the first, unless a loaded machine let the
    kill land after the second); phalanx-heal healed the replacement from rank 0's process."""
    (trial,) = written["results"]["trials"]
    every = written["results"]["setup"]["checkpoint_every"]
    assert trial["phalanx"]["steps_again"] <= 1, trial
    resumed = trial["torchrun"].get("resumed_from")
    assert resumed is not None and resumed >= every and resumed % every == 0, trial
    heal = trial["phalanx-heal"]  # rank 0, which survived, went on from the step it completed before the kill
    assert heal["resumed_from"] >= trial["kill_after_step"], trial
    assert heal["heal_mib"] > 0 and 0 < heal["replacement_start_s"] < heal["seconds_to_train"], trial


def check_launch_overhead_report(written: dict, _stdout: str) -> None:
    """Both judged scenarios ran, each with phalanx's breakdown of its start into every phase."""
    from phalanx.launch.start_report import PHASES

    results = written["results"]
    assert [result["scenario"] for result in results] == ["single", "nodes2"], results
    for result in results:
        assert list(result["start_phases_s"]) == list(PHASES), result
        assert all(finite(seconds) for seconds in result["start_phases_s"].values()), result


def check_detection_report(written: dict, _stdout: str) -> None:
    """The smoke trial: the cut host was named by a survivor's line that says so (not before the
    cut: a watcher dates a silence from its last read that saw a beat, up to a beat before it);
    the saturated seconds passed without a false alarm."""
    (trial,) = written["results"]["trials"]
    assert trial["saturated"]["false_alarm"] is None and trial["saturated"]["steps_reported"] > 0, trial
    assert trial["named_s"] > 0 and "sent no sign of life" in trial["line"], trial


#: What a benchmark's smoke report must show beyond the targets every one has.
MORE_CHECKS = {"checkpoint": check_checkpoint_report, "control_plane": check_control_plane_report,
               "recovery": check_recovery_report, "detection": check_detection_report,
               "launch_overhead": check_launch_overhead_report}  # fmt: skip


def marks_of(benchmark: summary.Benchmark) -> list[pytest.MarkDecorator]:
    """netns where it builds a test bed; cluster where its smoke belongs to the second stage."""
    return [
        *([pytest.mark.netns] if benchmark.needs_root else []),
        *([pytest.mark.cluster] if benchmark.second_stage_smoke else []),
    ]


def test_every_benchmark_is_listed() -> None:
    scripts = {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    assert scripts - HELPERS == {b.name for b in summary.BENCHMARKS}


@pytest.mark.parametrize(
    "benchmark",
    [pytest.param(b, id=b.name, marks=marks_of(b)) for b in summary.BENCHMARKS],
)
def test_smoke_run_writes_every_target(benchmark: summary.Benchmark, workdir: Path) -> None:
    if benchmark.missing() is not None:
        pytest.skip(f"{benchmark.name} {benchmark.missing()}")
    report = workdir / f"{benchmark.name}.json"
    done = run_command(benchmark.argv(report, smoke=True), timeout=SMOKE_TIMEOUT_S, cwd=workdir)
    assert done.returncode == 0, done.output
    written = json.loads(report.read_text())
    assert written["smoke"] is True and written["targets"], written
    for target in written["targets"]:  # a target without a figure: the run's own lines say why
        assert target["name"] and math.isfinite(target["limit"]), f"{target}\n{done.output[-6000:]}"
        assert isinstance(target["value"], (int, float)) and math.isfinite(target["value"]), (
            f"{target}\n{done.output[-6000:]}"
        )
        assert target["verdict"] == "smoke run: not judged", target
    if benchmark.name in MORE_CHECKS:
        MORE_CHECKS[benchmark.name](written, done.stdout)
    assert not [p for p in workdir.iterdir() if p.name.startswith("phalanx-ckpt-bench-")], (
        "a checkpoint folder was left"
    )


def test_a_failed_benchmark_is_named_in_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark that fails shows in the table with its exit code, not as a missing row."""
    broken = summary.Benchmark("launch_overhead")
    monkeypatch.setattr(
        summary.Benchmark, "argv", lambda self, report, smoke: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    found = summary.run(broken, tmp_path, smoke=True)
    assert found["failed"].startswith("exit code 3"), found
    shown = summary.table({"launch_overhead": found})
    assert "FAILED" in shown and "exit code 3" in shown, shown


def test_the_table_of_reports_measured_on_several_days_names_each_ones_day(tmp_path: Path) -> None:
    """--table runs nothing: it reads the reports in --results, names each row's day, and lists a
    benchmark without a report as not run."""
    from targets import Target, write_report

    write_report(tmp_path / "launch_overhead.json", {}, [Target("wall time ratio", 1.01, 1.05, at_least=False)])
    shown = run_command([sys.executable, str(REPO / "benchmarks" / "summary.py"), "--table", "--results",
                         str(tmp_path), "--only", "launch_overhead", "checkpoint"], timeout=60, cwd=tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.output
    [measured] = [line.split() for line in shown.stdout.splitlines() if line.startswith("launch_overhead")]
    assert measured[-4:] == ["<=", "1.050x", "met", json.loads((tmp_path / "launch_overhead.json").read_text())[
        "measured"]["date"]], measured  # fmt: skip
    assert any(line.startswith("checkpoint") and "not run" in line for line in shown.stdout.splitlines()), shown.stdout


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--nodes", "8", "1"], "--nodes 1: a job of simulated nodes has at least 2"),
        (["--torch-limit", "0"], "--torch-limit 0: a number of seconds, above 0"),
        (["--heartbeat-timeout", "nan"], "--heartbeat-timeout nan: a number of seconds, above 0"),
    ],
)
def test_the_control_plane_harness_refuses_what_it_cannot_run(argv: list[str], said: str, workdir: Path) -> None:
    """Exit 2 and the value named, before a store or a node starts: nothing is left running."""
    report = workdir / "control_plane.json"
    done = run_command([sys.executable, str(REPO / "benchmarks" / "control_plane.py"), *argv, "--json", str(report)],
                       timeout=120, cwd=workdir)  # fmt: skip
    assert done.returncode == 2, done.output
    assert said in done.stderr, done.output
    assert not report.exists()
