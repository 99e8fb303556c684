"""Ctrl-C (SIGINT) during a conversion: it always stops the conversion, and nothing half-written
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

So a conversion runs under a SigintGuard. Its handler counts every Ctrl-C. Inside a `deferred`
section (the imports, writing the staging folder) it only counts, and the conversion checks the
count when the section's step is done; elsewhere it also raises KeyboardInterrupt at once, and
the conversion checks the count between steps, so an interrupt dropped by a gc callback still
stops it. A second Ctrl-C inside a deferred section raises at once.

This module imports only the standard library: the guard must be in place before jax is
imported.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

logger = logging.getLogger("jaxserve")


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

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C was pressed, even if its KeyboardInterrupt was lost on the way."""
        return self.num_interrupts > 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.num_interrupts += 1
        if self._deferring and self.num_interrupts == 1:
            logger.warning(
                "Ctrl-C: stopping when %s (press Ctrl-C again to stop at once)",
                self._deferring[-1],
            )
            return
        raise KeyboardInterrupt

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


# The guard of the conversion running in the main thread, so nested users share one count.
_active: SigintGuard | None = None


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
        guard.installed = True
    _active = guard
    try:
        yield guard
    finally:
        _active = None
        if guard.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
