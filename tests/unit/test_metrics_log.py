"""The JSON Lines metrics file: one object per step, readable after a crash, continued on resume."""

from __future__ import annotations

import json
import sys

import pytest

from phalanx.runtime.metrics_log import JsonlMetrics, MetricsLog


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_flushed_object_per_step(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    log = JsonlMetrics(path)
    log.write({"step": 10, "loss": 0.5, "eta_s": float("nan")})
    assert read(path) == [{"step": 10, "loss": 0.5, "eta_s": None}]  # on disk before close; NaN is not JSON
    log.write({"step": 20, "loss": 0.25})
    log.close()
    assert [record["step"] for record in read(path)] == [10, 20]


def test_a_resume_drops_what_it_repeats_and_a_torn_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    first = JsonlMetrics(path)
    for step in (10, 20, 30):
        first.write({"step": step, "loss": 1.0 / step})
    first.close()
    with path.open("a") as handle:
        handle.write('{"step": 40, "lo')  # killed in the middle of a line
    resumed = JsonlMetrics(path, continue_from_step=20)  # the newest checkpoint was at step 20
    resumed.write({"step": 30, "loss": 0.03})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read(path)] == [(10, 0.1), (20, 0.05), (30, 0.03)]
    assert "dropped 2 record(s) after step 20" in capsys.readouterr().err


def test_a_fresh_run_starts_the_file_over_and_says_so(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5}\n')
    JsonlMetrics(path).close()
    assert path.read_text() == ""
    assert "dropped 1 record(s) after step 0" in capsys.readouterr().err


def test_nothing_to_drop_leaves_the_file_alone(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5}\n')
    JsonlMetrics(path, continue_from_step=5).close()
    assert path.read_text() == '{"step": 5}\n' and capsys.readouterr().err == ""


def test_only_the_enabled_rank_writes(tmp_path):
    log = MetricsLog(jsonl=tmp_path / "metrics.jsonl", enabled=False)
    log.write({"step": 1})
    log.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_missing_is_a_notice_and_the_jsonl_goes_on(tmp_path, monkeypatch, capsys):
    # Stands in for an environment without the tensorboard package (None in sys.modules makes
    # the import fail as it does there), whether or not this one has it.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    log = MetricsLog(jsonl=tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb")
    log.write({"step": 1, "loss": 0.5})
    log.close()
    assert read(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]
    err = capsys.readouterr().err
    assert f"TensorBoard logs to {tmp_path / 'tb'} were asked for, but TensorBoard cannot be loaded" in err
    assert "HINT: pip install tensorboard" in err


def tensorboard_scalars(directory, tag: str) -> list[tuple[int, float]]:
    # the test extra installs tensorboard; a user's environment may not have it
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(event.step, round(event.value, 3)) for event in events.Scalars(tag)]


def test_tensorboard_events_when_installed(tmp_path):
    log = MetricsLog(tensorboard=tmp_path / "tb")
    for step in (10, 20):
        log.write({"step": step, "loss": 1.0 / step, "samples_per_second": 100.0, "world_size": 2})
    log.close()
    assert tensorboard_scalars(tmp_path / "tb", "loss") == [(10, 0.1), (20, 0.05)]


def test_a_fresh_run_hides_an_earlier_runs_tensorboard_events(tmp_path):
    earlier = MetricsLog(tensorboard=tmp_path / "tb")
    earlier.write({"step": 10, "loss": 1.0})
    earlier.close()
    fresh = MetricsLog(tensorboard=tmp_path / "tb")
    fresh.write({"step": 20, "loss": 0.5})
    fresh.close()
    assert tensorboard_scalars(tmp_path / "tb", "loss") == [(20, 0.5)]


def test_a_resume_hides_the_tensorboard_events_it_logs_again(tmp_path):
    first = MetricsLog(tensorboard=tmp_path / "tb")
    for step in (10, 20, 30):
        first.write({"step": step, "loss": 1.0 / step})
    first.close()
    resumed = MetricsLog(tensorboard=tmp_path / "tb", continue_from_step=20)  # the newest checkpoint was at step 20
    resumed.write({"step": 30, "loss": 0.5})
    resumed.close()
    assert tensorboard_scalars(tmp_path / "tb", "loss") == [(10, 0.1), (20, 0.05), (30, 0.5)]
