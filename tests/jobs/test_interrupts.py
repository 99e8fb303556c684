"""A Ctrl-C that lands inside a garbage-collector callback still stops the job
(jaxserve/jobs/interrupts.py): CI saw one swallowed there, and the job ran to its end."""

from __future__ import annotations

import gc
import signal
import time

import pytest

from jaxserve.jobs.interrupts import catching_interrupts, raise_if_interrupted


def _sigint_inside_a_gc_callback() -> None:
    def callback(phase: str, info: dict) -> None:
        if phase == "start" and callback in gc.callbacks:
            signal.raise_signal(signal.SIGINT)
            for _ in range(3):  # the handler runs between these bytecodes, inside the callback
                pass
            gc.callbacks.remove(callback)

    gc.callbacks.append(callback)
    gc.collect()


def test_a_sigint_inside_a_gc_callback_is_raised_once_out_of_it() -> None:
    with catching_interrupts():
        with pytest.raises(KeyboardInterrupt):
            _sigint_inside_a_gc_callback()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the redelivered interrupt lands here
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()  # latched too
    raise_if_interrupted()  # cleared on the way out


def test_the_previous_handler_is_restored_and_a_plain_sigint_raises_at_once() -> None:
    before = signal.getsignal(signal.SIGINT)
    with catching_interrupts():
        assert signal.getsignal(signal.SIGINT) is not before
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGINT) is before
