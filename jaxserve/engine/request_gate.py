"""RequestGate: what AsyncLLM lets through to its engine thread, and when it stops letting
anything through.

Clients (any thread) submit commands; the gate refuses, under its lock, a request id still in
use, a request beyond ``max_waiting_requests`` (those in the inbox plus those the scheduler
holds waiting), and anything once the engine is stopping or dead. Only then is the command put
in the engine thread's inbox, so a command is either in the inbox before shutdown's sentinel
(None) or refused. The engine thread reports back: a queued add taken from the inbox
(``taken``), a request that ended (``end``), the scheduler's waiting count after a step
(``num_waiting``), and the error that stopped its loop (``die``).
"""

from __future__ import annotations

import queue
import threading


class QueueFullError(RuntimeError):
    """max_waiting_requests requests already wait: try again later (a server's 503)."""


class EngineError(RuntimeError):
    """The engine could not finish the request: a step failed (every request running then was
    aborted), or the engine is shut down."""


class RequestGate:
    """The admission bookkeeping between AsyncLLM's clients and its engine thread."""

    def __init__(self, max_waiting_requests: int | None) -> None:
        check_max_waiting(max_waiting_requests)
        self.max_waiting_requests = max_waiting_requests
        self.inbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._active: set[str] = set()  # request ids from submit() until they end
        self._num_queued = 0  # adds in the inbox, not yet taken by the engine thread
        self.num_waiting = 0  # the scheduler's waiting count after the latest step
        self.dead: BaseException | None = None  # what stopped the engine loop
        self.stopping = False

    def submit(self, request_id: str, command: tuple) -> None:
        """Queue an add command for ``request_id``, or raise EngineError (stopping or dead),
        ValueError (the id is in use) or QueueFullError (max_waiting_requests wait)."""
        limit = self.max_waiting_requests
        with self._lock:
            if self.dead is not None or self.stopping:
                raise EngineError("the engine is not running" + cause(self.dead))
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
            waiting = self._num_queued + self.num_waiting
            if limit is not None and waiting >= limit:
                raise QueueFullError(
                    f"{waiting} requests are waiting: at max_waiting_requests={limit}; "
                    "try again later"
                )
            self._active.add(request_id)
            self._num_queued += 1
            self.inbox.put(command)

    def stop(self) -> bool:
        """Close the gate and queue the engine thread's sentinel; False if already closed."""
        with self._lock:
            if self.stopping:
                return False
            self.stopping = True
            self.inbox.put(None)
            return True

    def taken(self) -> None:
        """The engine thread took a queued add from the inbox."""
        with self._lock:
            self._num_queued -= 1

    def end(self, request_id: str) -> None:
        """``request_id`` ended (finished, aborted or failed): the id is free again."""
        with self._lock:
            self._active.discard(request_id)

    def die(self, error: BaseException) -> None:
        """The engine loop itself failed: nothing more is admitted."""
        with self._lock:
            self.dead = error


def check_max_waiting(value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_waiting_requests must be an int or None, got {value!r}")
    if value < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {value}")


def cause(error: BaseException | None) -> str:
    """`` (Type: message)`` of the error that stopped the engine, or nothing."""
    return "" if error is None else f" ({type(error).__name__}: {error})"
