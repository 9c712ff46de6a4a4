"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

import phalanx


@pytest.fixture
def context():
    """The runtime of a single process: no torchrun variables, world size 1, no process group."""
    context = phalanx.init()
    yield context
    context.close()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder with an empty train.py, made the current one, and no variable of this shell that
    would change a command's answer (a config file's, a scheduler's)."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for name in ("PHALANX_CONFIG", "SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path
