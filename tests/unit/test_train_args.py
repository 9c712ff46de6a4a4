"""examples/train.py refuses settings that cannot work at the edge: argparse's usage error (exit
code 2), naming the flag and the value, instead of a traceback from deep inside the run."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--checkpoint-every", "0", "0 is not a positive number"),  # was a ZeroDivisionError at the first step
        ("--epochs", "-1", "-1 is not zero or a positive number"),  # 0: the initial parameters
        ("--batch-size", "0", "0 is not a positive number"),
        ("--samples", "0", "0 is not a positive number"),
        ("--lr", "-0.1", "-0.1 is not zero or a positive number"),
        ("--workers", "-2", "-2 is not zero or a positive number"),
        ("--log-every", "ten", "invalid int value: 'ten'"),
    ],
)
def test_a_value_that_cannot_work_is_refused_naming_the_flag(train_example, monkeypatch, capsys, flag, value, expected):
    monkeypatch.setattr("sys.argv", ["train.py", flag, value])
    with pytest.raises(SystemExit) as stopped:
        train_example.parse_args()
    assert stopped.value.code == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_the_defaults_parse(train_example, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py"])
    args = train_example.parse_args()
    assert (args.epochs, args.batch_size, args.checkpoint_every, args.lr, args.workers) == (5, 32, 50, 0.05, 0)


def test_the_digits_read_from_the_shipped_file_are_scikit_learns(train_example):
    """The example reads the digits' file without importing scikit-learn (a second per process):
    the same images and labels as the public loader's, or the public loader itself."""
    import torch
    from sklearn.datasets import load_digits

    images, labels = train_example.load_digits()
    expected = load_digits()
    assert torch.equal(images, torch.tensor(expected.data, dtype=torch.float32) / 16.0)
    assert torch.equal(labels, torch.tensor(expected.target))
