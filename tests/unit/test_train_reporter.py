"""examples/train.py's Reporter on one process: when epoch losses and logged steps are shown.

The all-reduce of a logging point and of the epoch ends riding on it runs in the e2e tests
(tests/e2e/test_runtime.py); here the world is one process, so every sum is this process's.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json

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
def reporter(train, tmp_path):
    context = phalanx.init()  # no torchrun variables: world size 1
    args = argparse.Namespace(epochs=3, metrics_jsonl=tmp_path / "m.jsonl", tensorboard=None)
    reporter = train.Reporter(args, context, total_steps=9, step=0)
    reporter.progress = phalanx.ProgressReporter(9, stream=io.StringIO())  # plain lines, as in a log
    yield reporter
    reporter.files.close()
    context.close()


def add_steps(reporter, losses: list[float], samples: int = 4) -> None:
    for loss in losses:
        reporter.totals.add_mean(samples, loss=torch.tensor(loss))


def shown(reporter) -> str:
    """What the console got since the last call."""
    stream = reporter.progress.stream
    text = stream.getvalue()
    stream.seek(0), stream.truncate()
    return text


def records(reporter) -> list[dict]:
    return [json.loads(line) for line in reporter.files._sinks[0].path.read_text().splitlines()]


def test_an_epoch_end_is_shown_with_the_next_logging_point_and_logged_steps_are_not_moved(reporter):
    add_steps(reporter, [1.0, 2.0, 3.0])
    reporter.end_epoch(epoch=0, step=3, first_sample=0)
    assert "epoch 1/3" not in shown(reporter)  # no collective of its own: nothing to show yet
    add_steps(reporter, [5.0])
    reporter.start(step=4, epoch=1, grad_norm=None)
    reporter.finish()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 2.0000" in out  # the epoch's mean, not the window's
    assert "step 4/9" in out and out.index("epoch 1/3") < out.index("step 4/9")  # in the order they happened
    assert [(r["step"], r["epoch"], r["loss"], r["samples"]) for r in records(reporter)] == [(4, 2, 2.75, 16)]


def test_settle_shows_the_epochs_ended_since_the_last_point_without_logging_a_step(reporter):
    """Before a checkpoint or a stop: an epoch that ended after the last logging point would
    otherwise never be shown, because a resumed run starts after it."""
    add_steps(reporter, [1.0, 3.0])
    reporter.start(step=2, epoch=0, grad_norm=None)
    add_steps(reporter, [10.0])
    reporter.end_epoch(epoch=0, step=3, first_sample=8)
    reporter.settle()
    out = shown(reporter)
    assert "epoch 1/3  step 3  loss 4.6667 (resumed at sample 8)" in out  # (1 + 3 + 10) / 3 over its 12 samples
    assert [r["step"] for r in records(reporter)] == [2]  # the metrics file has the logged steps only
    reporter.settle()
    assert shown(reporter) == ""  # nothing waits any more
    add_steps(reporter, [7.0, 9.0])
    reporter.end_epoch(epoch=1, step=5, first_sample=0)
    reporter.close()
    assert "epoch 2/3  step 5  loss 8.0000" in shown(reporter)  # the second epoch from the first's end
