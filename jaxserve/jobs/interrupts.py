"""A Ctrl-C that a job never loses.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT's handler runs; when that
is inside a garbage-collector callback (jax registers one) or a ``__del__``, the interpreter
prints "Exception ignored in ..." and goes on, and a job would run to its end as if no Ctrl-C
had come. ``catching_interrupts`` installs a handler that raises KeyboardInterrupt a moment later
when SIGINT arrives inside such a callback, and latches every interrupt; the jobs call
``raise_if_interrupted`` before each result they record (ResultsFile.append), so an interrupt
swallowed all the same (a weakref callback, a C extension) stops the job at its next result.

Imports no jax.
"""

from __future__ import annotations

import _thread
import gc
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_REDELIVERY_SECONDS = 0.05
_received = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _received.set()
    if _swallows_exceptions(frame):
        # Raised here it would be printed as "Exception ignored" and lost: deliver it again in
        # a moment, when the main thread is out of the callback.
        threading.Timer(_REDELIVERY_SECONDS, _thread.interrupt_main, (signum,)).start()
        return
    raise KeyboardInterrupt


def _swallows_exceptions(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a garbage-collector callback or a ``__del__``, where the
    interpreter reports an exception as unraisable and goes on."""
    gc_callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in gc_callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextmanager
def catching_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and latches it while the block runs (main thread only:
    elsewhere signal handlers cannot be set, and the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _received.clear()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a SIGINT came since ``catching_interrupts`` began."""
    if _received.is_set():
        raise KeyboardInterrupt
