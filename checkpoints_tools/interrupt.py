"""Ctrl-C (SIGINT) during a conversion or a job: it always stops it, and nothing half-written
stays behind.

Python's own KeyboardInterrupt is not enough, for three reasons found by sending SIGINT to
`jaxserve convert` at different moments:

1. jax registers a garbage-collector callback (jax._src.lib._xla_gc_callback). A
   KeyboardInterrupt that Python delivers while a gc callback runs is reported as "Exception
   ignored in ..." and dropped, so a Ctrl-C during the allocation-heavy imports of the first
   second was swallowed and the conversion ran to the end (exit status 0).
2. Delivered while a C extension initialises (jaxlib's), it becomes an ImportError ("Encountered
   an error while initializing the extension", exit status 1); once, a SIGINT early in the jax
   import even ended the process with SIGSEGV.
3. Delivered inside orbax's save, it stops only the main thread: orbax's writer threads go on
   writing into the staging folder after the cleanup removed it, creating it again, and Python
   waits for those threads before exiting. That left the staging folder behind.

So a conversion (and every `jaxserve` command: cli.main) runs under a SigintGuard. Its handler
counts every Ctrl-C. Inside a `deferred` section (the imports, writing the staging folder) it
only counts, and the conversion checks the count when the section's step is done; elsewhere it
raises KeyboardInterrupt at once. One that Python cannot raise where it lands (reason 1: a gc
or weakref callback, a `__del__`) reaches the guard's sys.unraisablehook instead of being printed
and dropped, and a timer sends it again a moment later, until it is raised. The conversion also
checks the count between steps and the jobs before each result they record (check_interrupted),
so an interrupt lost some other way still stops them. A second Ctrl-C inside a deferred section
raises at once.

Under the guard, the library's own safe-point deferral (engine/interrupts.py, which applies only
while Python's default handler is installed) steps aside: a command's Ctrl-C raises at once, and
the engine's recovery from an interrupted step (docs/architecture.md, section 7) cleans up.

This module imports only the standard library: the guard must be in place before jax is
imported.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

logger = logging.getLogger("jaxserve")

_REDELIVERY_S = 0.05  # how soon a Ctrl-C that Python could not raise is sent again


class SigintGuard:
    """Counts Ctrl-C; raises KeyboardInterrupt at once or at the next check (module docstring).

    `installed` is False off the main thread (only it receives signals) and when SIGINT already
    has a handler other than Python's default (an application's own, or SIG_IGN): that handler
    is left alone, `deferred` does nothing and `check` never raises.
    """

    def __init__(self) -> None:
        self.num_interrupts = 0  # Ctrl-Cs received while installed; only the handler adds
        self.installed = False  # whether _handle is SIGINT's handler
        self._deferring: list[str] = []  # what each open deferred section is doing (nested)
        # The timer that sends again a Ctrl-C that Python could not raise (None: none).
        self._redelivery: threading.Timer | None = None
        self._previous_unraisablehook = sys.unraisablehook

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C was pressed, even if its KeyboardInterrupt was lost on the way."""
        return self.num_interrupts > 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._redelivery is None:  # else: the same Ctrl-C again, sent by the timer
            self.num_interrupts += 1
            if self._deferring and self.num_interrupts == 1:
                logger.warning(
                    "Ctrl-C: stopping when %s (press Ctrl-C again to stop at once)",
                    self._deferring[-1],
                )
                return
        self._redelivery = None
        raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        """sys.unraisablehook: a KeyboardInterrupt raised where Python cannot raise it (a gc
        or weakref callback, a ``__del__``) is not printed; the timer sends it again in a
        moment, when the main thread may have left that callback. Anything else goes to the
        hook there was before."""
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            self._previous_unraisablehook(unraisable)
            return
        self._redelivery = threading.Timer(_REDELIVERY_S, _thread.interrupt_main)
        self._redelivery.start()

    def _cancel_redelivery(self) -> None:
        if self._redelivery is not None:
            self._redelivery.cancel()
            self._redelivery = None

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed.

        Raises:
            KeyboardInterrupt: interrupted is True.
        """
        if self.interrupted:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self, what: str) -> Iterator[None]:
        """Within: a first Ctrl-C is only counted (call check() when the work is done); a
        second raises KeyboardInterrupt at once.

        Args:
            what: when the section's work is done, for the message: "Ctrl-C: stopping when
                {what}", e.g. "the imports finish".
        """
        self._deferring.append(what)
        try:
            yield
        finally:
            self._deferring.pop()


# The guard of the command running in the main thread, so nested users share one count.
_active: SigintGuard | None = None


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if the active guard (if any) saw a Ctrl-C: for loops that must
    stop even when the KeyboardInterrupt itself was lost (a C extension, a weakref callback).

    Raises:
        KeyboardInterrupt: a guard is active and was interrupted.
    """
    if _active is not None:
        _active.check()


@contextlib.contextmanager
def sigint_guard() -> Iterator[SigintGuard]:
    """The guard of the conversion in progress; installs one (and restores Python's default
    handler at the end) when none is.

    Returns:
        (as a context manager) the guard; see SigintGuard for when it is not installed.
    """
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield SigintGuard()  # Ctrl-C reaches the main thread only: nothing to guard here
        return
    if _active is not None:
        yield _active
        return
    guard = SigintGuard()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, guard._handle)
        sys.unraisablehook = guard._unraisable
        guard.installed = True
    _active = guard
    try:
        yield guard
    finally:
        _active = None
        if guard.installed:
            guard._cancel_redelivery()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = guard._previous_unraisablehook


@contextlib.contextmanager
def sigint_to_asyncio() -> Iterator[None]:
    """Python's default SIGINT handler inside the block, so that an ``asyncio.run`` in it
    installs its own (Python 3.11+): a Ctrl-C then cancels the main task, whose ``finally``
    blocks run (in-flight requests aborted, results flushed), and asyncio.run raises
    KeyboardInterrupt once it has unwound. Raised by the guard's handler instead, the
    KeyboardInterrupt ends whichever task runs, and no one retrieves it. The guard's handler
    is back after the block."""
    if _active is None or not _active.installed:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _active._handle)
