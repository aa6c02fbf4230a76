"""runtime/step/stop_signals.py: a signal while a training loop runs is a request to stop at the next step boundary;
before and after a loop, and the second time, the handler that was there before acts (SIGUSR1 stands in for
SIGTERM here: the earlier handler is a recorder, so nothing ends the test process)."""
from __future__ import annotations

import os
import signal

import pytest

from model_parallel.runtime.step import stop_signals


@pytest.fixture()
def recorder():
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda number, frame: seen.append(number))
    yield seen
    stop_signals.clear()
    signal.signal(signal.SIGUSR1, before)


def test_in_a_loop_the_first_signal_is_a_request_and_the_second_is_the_earlier_handlers(recorder):
    assert stop_signals.install([signal.SIGUSR1])
    with stop_signals.armed():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_signals.requested() == "SIGUSR1" and recorder == []
        os.kill(os.getpid(), signal.SIGUSR1)  # a user who will not wait for the step boundary
        assert recorder == [signal.SIGUSR1] and stop_signals.requested() == "SIGUSR1"


def test_outside_a_loop_a_signal_acts_at_once(recorder):
    """Joining the world or loading weights has no step boundary to wait for: deferring would leave a process
    deaf to SIGTERM until its scheduler kills it."""
    stop_signals.install([signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert recorder == [signal.SIGUSR1] and stop_signals.requested() is None


def test_clear_forgets_the_request_and_restores_the_handler(recorder):
    stop_signals.install([signal.SIGUSR1])
    with stop_signals.armed():
        os.kill(os.getpid(), signal.SIGUSR1)
    stop_signals.clear()
    assert stop_signals.requested() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert recorder == [signal.SIGUSR1]
