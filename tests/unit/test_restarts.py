"""phalanx.launch.restarts: what the agent's best-effort waits let through."""

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from phalanx.launch.restarts import raise_if_signal


def test_a_signal_torch_raised_goes_through_a_best_effort_wait():
    with pytest.raises(SignalException):
        raise_if_signal(SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM))


def test_any_other_error_is_left_to_the_wait():
    assert raise_if_signal(ConnectionError("the store is gone")) is None
