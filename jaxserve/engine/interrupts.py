"""Ctrl-C at safe points: a SIGINT that arrives while the engine works is held until the
engine reaches a point where its state is consistent.

A step moves host state (scheduler, runner buffers) and device state (the KV pages, donated to
the jitted step) forward together; a KeyboardInterrupt raised at an arbitrary bytecode inside
it could leave them out of step, and one raised inside the clean-up of an interrupted call
could leave requests behind. So, inside ``defer_sigint()`` blocks (nested as they like):

- the first Ctrl-C is held, and raised as KeyboardInterrupt at the next ``guard.check()`` or
  when a block exits normally;
- a second Ctrl-C while one is held raises at once (the user insists, e.g. during a long
  compilation): the engine's failure path then recovers;
- once a KeyboardInterrupt has been raised, further Ctrl-Cs are ignored until the outermost
  block exits, so the clean-up that the interrupt triggers always runs to its end.

Only the default handler in the main thread is replaced, for the duration of the outermost
block: a handler the application installed itself is left alone, and other threads never
receive SIGINT. Jupyter and IPython kernels run cells under the default handler, so notebooks
get the deferral too.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger("jaxserve")


class InterruptGuard:
    """The state of the held Ctrl-C of the main thread (one instance, ``_GUARD``)."""

    def __init__(self) -> None:
        self.depth = 0  # nested defer_sigint blocks open; the handler is ours while > 0
        self.pending = False  # a Ctrl-C is held
        self.raised = False  # a KeyboardInterrupt was raised in this outermost block

    def check(self) -> None:
        """Raise the held Ctrl-C, if any, as KeyboardInterrupt (call at safe points)."""
        if self.pending and not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        if self.raised:
            return  # already stopping: let the clean-up finish
        if self.pending:
            self.raised = True
            raise KeyboardInterrupt
        self.pending = True
        logger.warning(
            "interrupt received: stopping at the end of the current engine step "
            "(press Ctrl-C again to stop at once)"
        )


class _NoGuard(InterruptGuard):
    """What a block gets where SIGINT is not ours to hold: check() does nothing."""

    def check(self) -> None:
        return None


_GUARD = InterruptGuard()
_NO_GUARD = _NoGuard()


@contextlib.contextmanager
def defer_sigint() -> Iterator[InterruptGuard]:
    """Hold Ctrl-C inside the block (see the module docstring); yields the guard.

    Raises:
        KeyboardInterrupt: at ``guard.check()`` or at the normal end of the block if Ctrl-C
            was pressed during it, or at once on a second Ctrl-C.
    """
    guard = _GUARD
    if threading.current_thread() is not threading.main_thread():
        yield _NO_GUARD
        return
    if guard.depth == 0:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield _NO_GUARD
            return
        guard.pending = guard.raised = False
        signal.signal(signal.SIGINT, guard._handle)
    guard.depth += 1
    try:
        yield guard
    finally:
        guard.depth -= 1
        if guard.depth == 0:
            # signal.signal() first runs the handler of any Ctrl-C not yet handled: ours,
            # which holds it; the check below raises it.
            signal.signal(signal.SIGINT, signal.default_int_handler)
    guard.check()
