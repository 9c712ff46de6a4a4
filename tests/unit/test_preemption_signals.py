"""Ctrl-C in a phalanx.Run loop: the first SIGINT is a stop request, as SIGTERM is (the ranks stop
after an agreed step and save); a second raises KeyboardInterrupt at once; once the loop is over,
SIGINT is Python's again. Real signals, sent to this process."""

from __future__ import annotations

import os
import signal

import pytest

from phalanx.runtime.preemption import PreemptionGuard


@pytest.fixture
def sigint_restored():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_first_ctrl_c_is_a_stop_request_and_a_second_interrupts(context, sigint_restored):
    guard = PreemptionGuard(context)
    os.kill(os.getpid(), signal.SIGINT)
    assert guard.received == signal.SIGINT
    assert guard.should_stop()  # one process: its own flag decides
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where Python runs the pending handler


def test_after_the_loop_ctrl_c_interrupts_as_without_the_guard(context, sigint_restored):
    guard = PreemptionGuard(context)
    guard.release_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert guard.received is None
