"""The Reporter of phalanx.Run on one process: when epoch losses and logged steps are shown.

The all-reduce of a logging point and of the epoch ends riding on it runs in the e2e tests
(tests/e2e/test_runtime.py); here the world is one process, so every sum is this process's.
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

import phalanx
from phalanx.runtime.progress import StepMeter
from phalanx.runtime.reporter import Reporter


@pytest.fixture
def new_reporter(context, tmp_path):
    """Reporters of a run of 9 steps in 3 epochs, from ``step`` on, with the metrics file in ``name``."""
    made = []

    def make(step: int = 0, name: str = "m.jsonl"):
        reporter = Reporter(
            context,
            epochs=3,
            total_steps=9,
            step=step,
            boundary=phalanx.SharedReduction(context),
            metrics_jsonl=tmp_path / name,
        )
        reporter.progress = phalanx.ProgressReporter(9, stream=io.StringIO())  # plain lines, as in a log
        made.append(reporter)
        return reporter

    yield make
    for reporter in made:
        reporter.files.close()


@pytest.fixture
def reporter(new_reporter):
    return new_reporter()


def add_steps(reporter, losses: list[float], samples: int = 4) -> None:
    for loss in losses:
        reporter.totals.add_mean(samples, loss=torch.tensor(loss))


def shown(reporter) -> str:
    """What the console got since the last call."""
    stream = reporter.progress.stream
    text = stream.getvalue()
    stream.seek(0), stream.truncate()
    return text


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_epoch_end_is_shown_with_the_next_logging_point_and_logged_steps_are_not_moved(reporter, tmp_path):
    add_steps(reporter, [1.0, 2.0, 3.0])
    reporter.end_epoch(epoch=0, step=3)
    assert "epoch 1/3" not in shown(reporter)  # no collective of its own: nothing to show yet
    add_steps(reporter, [5.0])
    reporter.start(step=4, epoch=1)
    reporter.finish()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 2.0000" in out  # the epoch's mean, not the window's
    assert "step 4/9" in out and out.index("epoch 1/3") < out.index("step 4/9")  # in the order they happened
    assert [(r["step"], r["epoch"], r["loss"], r["samples"]) for r in records(tmp_path / "m.jsonl")] == [
        (4, 2, 2.75, 16)
    ]


def test_settle_shows_the_epochs_ended_since_the_last_point_without_logging_a_step(reporter, tmp_path):
    """Before a checkpoint or a stop: an epoch that ended after the last logging point would
    otherwise never be shown, because a resumed run starts after it."""
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0)
    add_steps(reporter, [10.0])
    reporter.end_epoch(epoch=0, step=3)
    reporter.settle()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 4.6667\n" in out  # (1 + 3 + 10) / 3 over its 12 samples
    assert [r["step"] for r in records(tmp_path / "m.jsonl")] == [2]  # the metrics file has the logged steps only
    reporter.settle()
    assert shown(reporter) == ""  # nothing waits any more
    add_steps(reporter, [7.0, 9.0])
    reporter.end_epoch(epoch=1, step=5)
    reporter.close()
    assert "epoch 2/3  step 5  loss 8.0000" in shown(reporter)  # the second epoch from the first's end


def train_steps(reporter, first: int, last: int, losses: dict[int, float]) -> None:
    """Steps first..last of a run that logs every 2 steps (and at step 9) with 3-step epochs;
    ``step`` samples at step ``step``, so that the weights matter."""
    for step in range(first, last + 1):
        reporter.finish()
        add_steps(reporter, [losses[step]], samples=step)
        if step % 3 == 0:
            reporter.end_epoch(epoch=step // 3 - 1, step=step)
        if step % 2 == 0 or step == 9:
            reporter.start(step=step, epoch=(step - 1) // 3)


LOSSES = {step: float(step * step % 7) for step in range(1, 10)}


def stop_and_resume(new_reporter, stop: int, clock=None):
    """Trains to ``stop``, takes the checkpoint state there (through torch.save and a
    weights_only load, as CheckpointManager stores it) and resumes from it to step 9."""
    stopped = new_reporter(name="resumed.jsonl")
    train_steps(stopped, 1, stop, LOSSES)
    saved = io.BytesIO()
    torch.save(stopped.checkpoint_state(stop), saved)
    before_the_stop = shown(stopped)
    train_steps(stopped, stop + 1, stop + 1, LOSSES)  # logged again by the resumed run: dropped from the file
    stopped.close()
    resumed = new_reporter(step=stop, name="resumed.jsonl")
    if clock is not None:
        resumed.meter = StepMeter(9, start_step=stop, clock=clock)
    saved.seek(0)
    resumed.load_checkpoint_state(torch.load(saved, weights_only=True))
    train_steps(resumed, stop + 1, 9, LOSSES)
    resumed.close()
    return before_the_stop + shown(resumed)


@pytest.mark.parametrize("stop", [4, 5])  # at a logging step, between two
def test_a_run_resumed_from_a_checkpoint_reports_what_an_uninterrupted_run_reports(new_reporter, tmp_path, stop):
    """The first report and epoch line after the resume cover the steps before the stop too."""
    uninterrupted = new_reporter(name="uninterrupted.jsonl")
    train_steps(uninterrupted, 1, 9, LOSSES)
    uninterrupted.close()
    console = stop_and_resume(new_reporter, stop)

    expected, got = records(tmp_path / "uninterrupted.jsonl"), records(tmp_path / "resumed.jsonl")
    assert [(r["step"], r["samples"]) for r in got] == [(r["step"], r["samples"]) for r in expected]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-12)
    epoch_line = re.compile(r"epoch \d/3  step \d  loss .*")  # the whole line: no "resumed" note either
    assert epoch_line.findall(console) == epoch_line.findall(shown(uninterrupted))


def test_a_heal_after_an_epoch_end_that_a_checkpoint_settled_shows_the_next_epochs_as_an_uninterrupted_run(
    new_reporter, tmp_path
):
    """A survivor's heal (Run._heal) goes on from known_state(), up to the last logging point
    (step 2), while the checkpoint at step 3 settled epoch 1 after it. The next epochs' lines
    are the uninterrupted run's (a heal going on from step 2's sums and step 3's epoch end showed
    the next epoch's loss as nan), and so is every report but the first after the heal, which
    covers the steps since the heal only."""
    uninterrupted = new_reporter(name="uninterrupted.jsonl")
    train_steps(uninterrupted, 1, 9, LOSSES)
    uninterrupted.close()
    healed = new_reporter(name="healed.jsonl")
    train_steps(healed, 1, 3, LOSSES)
    healed.checkpoint_state(3)
    healed.start_over(healed.known_state(), phalanx.SharedReduction(healed.context))
    train_steps(healed, 4, 9, LOSSES)
    healed.close()

    epoch_line = re.compile(r"epoch \d/3  step \d  loss .*")
    assert epoch_line.findall(shown(healed)) == epoch_line.findall(shown(uninterrupted))
    expected, got = records(tmp_path / "uninterrupted.jsonl"), records(tmp_path / "healed.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [2, 4, 6, 8, 9]
    assert (got[1]["samples"], expected[1]["samples"]) == (4, 3 + 4)  # step 4: step 3 went with the failure
    assert [r["samples"] for r in got[2:]] == [r["samples"] for r in expected[2:]]
    assert [r["loss"] for r in got[2:]] == pytest.approx([r["loss"] for r in expected[2:]], rel=1e-12)


def test_the_first_rate_after_a_resume_counts_only_the_samples_trained_since(new_reporter, tmp_path):
    """Stopped at step 5, between the logging points 4 and 6: the report at step 6 covers steps 5
    and 6 (11 samples), but the resumed run trained only step 6 (6 samples) in its first second."""
    ticks = iter(range(100))
    stop_and_resume(new_reporter, stop=5, clock=lambda: float(next(ticks)))  # a second per reading
    first = next(r for r in records(tmp_path / "resumed.jsonl") if r["step"] == 6)
    assert (first["samples"], first["samples_per_second"]) == (11, 6.0)


@pytest.mark.parametrize("diverged", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_shows_in_its_own_report_and_epoch_only(new_reporter, tmp_path, diverged):
    """One batch's loss is NaN or infinite (an fp16 overflow the GradScaler skips): the report
    and the epoch line over it show it, as a sum of the losses would, and the later ones are
    the run's without that batch, also after a resume from a checkpoint that counted it. One
    running sum with the value in it would show NaN at every later point."""
    clean = new_reporter(name="clean.jsonl")
    train_steps(clean, 1, 9, LOSSES)
    clean.close()
    diverged_losses = {**LOSSES, 3: diverged}
    stopped = new_reporter(name="diverged.jsonl")
    train_steps(stopped, 1, 5, diverged_losses)
    saved = io.BytesIO()
    torch.save(stopped.checkpoint_state(5), saved)
    saved.seek(0)
    stopped.files.close()
    resumed = new_reporter(step=5, name="diverged.jsonl")
    resumed.load_checkpoint_state(torch.load(saved, weights_only=True))
    train_steps(resumed, 6, 9, diverged_losses)
    resumed.close()

    expected, got = records(tmp_path / "clean.jsonl"), records(tmp_path / "diverged.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [2, 4, 6, 8, 9]
    assert got[1]["loss"] is None  # steps 3 and 4; JSON has no NaN or infinity
    del got[1], expected[1]
    assert [(r["step"], r["samples"]) for r in got] == [(r["step"], r["samples"]) for r in expected]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-12)
    epochs = re.findall(r"epoch (\d)/3  step \d  loss (\S+)", shown(stopped) + shown(resumed))
    clean_epochs = re.findall(r"epoch (\d)/3  step \d  loss (\S+)", shown(clean))
    assert epochs == [("1", str(diverged)), *clean_epochs[1:]]


def count_collectives(reporter, monkeypatch) -> list[int]:
    """The snapshots of each all-reduce the reporter's sums take of their own (not in the boundary's)."""
    calls = []
    compute_async = reporter.totals.compute_async

    def counted(*snapshots, shared=None):
        if shared is None:
            calls.append(len(snapshots))
        return compute_async(*snapshots, shared=shared)

    monkeypatch.setattr(reporter.totals, "compute_async", counted)
    return calls


def test_a_logging_point_adds_its_sums_to_the_boundary_s_all_reduce(reporter, monkeypatch):
    """No collective of its own: the loop starts the boundary's, which the preemption vote joins."""
    calls = count_collectives(reporter, monkeypatch)
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0)
    assert calls == [] and reporter.boundary.pending
    reporter.boundary.start()
    reporter.finish()
    assert "step 2/9 (22%)  epoch 1/3  loss 2.0000" in shown(reporter)


def test_the_state_at_a_logging_step_needs_no_collective(reporter, monkeypatch):
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0)
    calls = count_collectives(reporter, monkeypatch)
    assert reporter.checkpoint_state(2) == {
        "running": (16.0, 8.0, 0.0, 0.0),
        "logged": (16.0, 8.0, 0.0, 0.0),
        "epoch_logged": (0.0, 0.0, 0.0, 0.0),
        "logged_step": 2,
    }
    assert calls == []  # the sums at a logging point are known: no all-reduce


def test_the_state_between_logging_steps_takes_one_collective_with_the_epoch_ends(reporter, monkeypatch):
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0)
    add_steps(reporter, [5.0])
    reporter.end_epoch(epoch=0, step=3)
    calls = count_collectives(reporter, monkeypatch)
    state = reporter.checkpoint_state(3)
    assert calls == [1]  # the epoch end and the sums now, in one all-reduce
    assert "epoch 1/3  step 3  loss 3.0000" in shown(reporter)
    assert state == {
        "running": (36.0, 12.0, 0.0, 0.0),
        "logged": (16.0, 8.0, 0.0, 0.0),
        "epoch_logged": (36.0, 12.0, 0.0, 0.0),
        "logged_step": 2,
    }


def test_a_world_that_shrank_makes_the_lowest_survivor_the_one_that_reports(tmp_path):
    """Heal mode in an elastic job: rank 0's node was lost, and this process, rank 1 until then,
    is rank 0 of the smaller world: from the step it went on after, it prints and writes the
    metrics file, and the run's steps are the new count."""
    context = phalanx.DistributedContext(rank=1, local_rank=0, node_rank=1, world_size=3, local_world_size=1,
                                         device=torch.device("cpu"), backend="gloo")  # fmt: skip
    reporter = Reporter(context, epochs=1, total_steps=9, step=0, boundary=phalanx.SharedReduction(context),
                        metrics_jsonl=tmp_path / "m.jsonl")  # fmt: skip
    assert not reporter.progress.enabled and not (tmp_path / "m.jsonl").exists()
    context.regroup(0, 2)
    reporter.regroup(12, step=4)
    assert reporter.progress.enabled and reporter.progress.total_steps == 12 and reporter.meter.total_steps == 12
    reporter.files.write({"step": 5})
    reporter.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 5}
