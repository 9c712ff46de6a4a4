"""examples/train.py's Reporter on one process: when epoch losses and logged steps are shown.

The all-reduce of a logging point and of the epoch ends riding on it runs in the e2e tests
(tests/e2e/test_runtime.py); here the world is one process, so every sum is this process's.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import re

import pytest
import torch

import phalanx
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def context():
    context = phalanx.init()  # no torchrun variables: world size 1
    yield context
    context.close()


@pytest.fixture
def new_reporter(train, context, tmp_path):
    """Reporters of a run of 9 steps in 3 epochs, from ``step`` on, with the metrics file in ``name``."""
    made = []

    def make(step: int = 0, name: str = "m.jsonl"):
        args = argparse.Namespace(epochs=3, metrics_jsonl=tmp_path / name, tensorboard=None)
        reporter = train.Reporter(args, context, total_steps=9, step=step)
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
    reporter.end_epoch(epoch=0, step=3, first_sample=0)
    assert "epoch 1/3" not in shown(reporter)  # no collective of its own: nothing to show yet
    add_steps(reporter, [5.0])
    reporter.start(step=4, epoch=1, grad_norm=None)
    reporter.finish()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 2.0000" in out  # the epoch's mean, not the window's
    assert "step 4/9" in out and out.index("epoch 1/3") < out.index("step 4/9")  # in the order they happened
    assert [(r["step"], r["epoch"], r["loss"], r["samples"]) for r in records(tmp_path / "m.jsonl")] == [(4, 2, 2.75, 16)]


def test_settle_shows_the_epochs_ended_since_the_last_point_without_logging_a_step(reporter, tmp_path):
    """Before a checkpoint or a stop: an epoch that ended after the last logging point would
    otherwise never be shown, because a resumed run starts after it."""
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0, grad_norm=None)
    add_steps(reporter, [10.0])
    reporter.end_epoch(epoch=0, step=3, first_sample=8)
    reporter.settle()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 4.6667 (resumed at sample 8)" in out  # (1 + 3 + 10) / 3 over its 12 samples
    assert [r["step"] for r in records(tmp_path / "m.jsonl")] == [2]  # the metrics file has the logged steps only
    reporter.settle()
    assert shown(reporter) == ""  # nothing waits any more
    add_steps(reporter, [7.0, 9.0])
    reporter.end_epoch(epoch=1, step=5, first_sample=0)
    reporter.close()
    assert "epoch 2/3  step 5  loss 8.0000" in shown(reporter)  # the second epoch from the first's end


def train_steps(reporter, first: int, last: int, losses: dict[int, float]) -> None:
    """Steps first..last of a run that logs every 2 steps (and at step 9) with 3-step epochs."""
    for step in range(first, last + 1):
        reporter.finish()
        add_steps(reporter, [losses[step]], samples=step)  # samples vary, so the weights matter
        if step % 3 == 0:
            reporter.end_epoch(epoch=step // 3 - 1, step=step, first_sample=0)
        if step % 2 == 0 or step == 9:
            reporter.start(step=step, epoch=(step - 1) // 3, grad_norm=None)


@pytest.mark.parametrize("stop", [4, 5])  # at a logging step, between two
def test_a_run_resumed_from_a_checkpoint_reports_what_an_uninterrupted_run_reports(new_reporter, tmp_path, stop):
    """The first report and epoch line after the resume cover the steps before the stop too."""
    losses = {step: float(step * step % 7) for step in range(1, 10)}
    uninterrupted = new_reporter(name="uninterrupted.jsonl")
    train_steps(uninterrupted, 1, 9, losses)
    uninterrupted.close()

    stopped = new_reporter(name="resumed.jsonl")
    train_steps(stopped, 1, stop, losses)
    state = stopped.state_dict(stop)
    before_the_stop = shown(stopped)
    train_steps(stopped, stop + 1, stop + 1, losses)  # logged again by the resumed run: dropped from the file
    stopped.close()
    resumed = new_reporter(step=stop, name="resumed.jsonl")
    resumed.load_state_dict(state)
    train_steps(resumed, stop + 1, 9, losses)
    resumed.close()

    expected, got = records(tmp_path / "uninterrupted.jsonl"), records(tmp_path / "resumed.jsonl")
    assert [(r["step"], r["samples"]) for r in got] == [(r["step"], r["samples"]) for r in expected]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-12)
    epoch_line = re.compile(r"epoch \d/3  step \d  loss \S+")
    assert epoch_line.findall(before_the_stop + shown(resumed)) == epoch_line.findall(shown(uninterrupted))


def test_the_state_at_a_logging_step_needs_no_collective(reporter, monkeypatch):
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0, grad_norm=None)

    def no_collective():
        raise AssertionError("the sums at a logging point are known: no all-reduce is needed")

    monkeypatch.setattr(reporter.totals, "compute", no_collective)
    assert reporter.state_dict(2) == {"running": (16.0, 8.0), "logged": (16.0, 8.0), "epoch_logged": (0.0, 0.0)}
