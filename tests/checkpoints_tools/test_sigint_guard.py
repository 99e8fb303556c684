"""A Ctrl-C that lands inside a garbage-collector or weakref callback is neither printed as
"Exception ignored" nor lost (checkpoints_tools/interrupt.py): a CI run saw one dropped in
jax's gc callback during a run-batch job (and one in a WeakSet's callback), and the job ran to
its end with exit status 0."""

from __future__ import annotations

import gc
import signal
import time
import weakref

import pytest

from jaxserve.checkpoints_tools.interrupt import check_interrupted, sigint_guard


class _Referent:
    pass


def _sigint_inside_a_weakref_callback() -> None:
    def callback(ref: object) -> None:
        signal.raise_signal(signal.SIGINT)
        for _ in range(3):
            pass

    referent = _Referent()
    ref = weakref.ref(referent, callback)  # noqa: F841 (alive until the referent dies)
    del referent


def _sigint_inside_a_gc_callback() -> None:
    def callback(phase: str, info: dict) -> None:
        if phase == "start" and callback in gc.callbacks:
            gc.callbacks.remove(callback)  # once
            signal.raise_signal(signal.SIGINT)
            for _ in range(3):  # the handler runs between these bytecodes, inside the callback
                pass

    gc.callbacks.append(callback)
    gc.collect()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", [_sigint_inside_a_gc_callback, _sigint_inside_a_weakref_callback])
def test_a_ctrl_c_inside_a_callback_is_raised_once_out_of_it(where) -> None:
    with sigint_guard() as guard:
        assert guard.installed
        with pytest.raises(KeyboardInterrupt):
            where()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the redelivered interrupt lands here
        assert guard.num_interrupts == 1  # one Ctrl-C, though delivered twice
        with pytest.raises(KeyboardInterrupt):
            check_interrupted()  # what the jobs call before each result
    check_interrupted()  # no guard active: nothing to raise


def test_the_default_handler_is_restored_and_a_plain_ctrl_c_raises_at_once() -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with sigint_guard() as guard:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):
                pass
        assert guard.num_interrupts == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
