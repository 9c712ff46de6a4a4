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
