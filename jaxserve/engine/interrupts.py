"""Ctrl-C between consistent states: a SIGINT that arrives inside an engine step is held until
the step ends.

A step moves host state (scheduler, runner buffers) and device state (the KV pages, donated to
the jitted step) forward together; a KeyboardInterrupt raised at an arbitrary bytecode inside
it could leave them out of step. ``defer_sigint`` holds the first Ctrl-C and raises it when the
block exits, at a point where everything agrees. A second Ctrl-C while one is held raises at
once (the user insists, e.g. during a long compilation); the engine's failure path then
recovers (see ``LLMEngine.step``).

Only the default handler in the main thread is replaced, for the duration of the block: a
handler the application installed itself is left alone, and other threads never receive
SIGINT. Jupyter and IPython kernels run cells under the default handler, so notebooks get the
deferral too.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger("jaxserve")


@contextlib.contextmanager
def defer_sigint() -> Iterator[None]:
    """Hold a SIGINT received inside the block; raise KeyboardInterrupt when it exits.

    Raises:
        KeyboardInterrupt: at the end of the block if Ctrl-C was pressed during it, or at once
            on a second Ctrl-C.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received = False

    def hold(signum, frame):
        nonlocal received
        if received:
            raise KeyboardInterrupt
        received = True
        logger.warning(
            "interrupt received: stopping when the current engine step ends "
            "(press Ctrl-C again to stop at once)"
        )

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
