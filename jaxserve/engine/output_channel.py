"""OutputChannel: one AsyncLLM request's hand-off from the engine thread to its consumer's event
loop. It holds the latest output only (each is cumulative), so a slow consumer never makes the
engine queue outputs."""

from __future__ import annotations

import asyncio
import threading

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind


class OutputChannel:
    """One request's channel from the engine thread to its consumer's event loop. Holds the
    latest output only; ``put`` and ``fail`` may be called from any thread."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, kind: RequestOutputKind, num_samples: int
    ) -> None:
        self.loop = loop
        self.kind = kind
        self.num_samples = num_samples
        self._ready = asyncio.Event()
        self._lock = threading.Lock()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        with self._lock:
            self._latest = out
        self._wake()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    async def get(self) -> RequestOutput:
        """The latest output not yet taken (waits for one); raises the stream's error."""
        while True:
            # Look before waiting: the wake-up of an error that came right after an output
            # may have been spent on that output.
            with self._lock:
                out, self._latest = self._latest, None
                error = self._error
            if out is not None:
                return out
            if error is not None:
                raise error
            await self._ready.wait()
            self._ready.clear()
