"""PullGuard: a consumer's pulls (``kv_connector`` "JaxTransferConnector", kv_transfer_worker.py)
with a deadline, and the threads of the pulls that miss it accounted for.

A jax.experimental.transfer pull has no deadline of its own that works: one from an address
nobody answers on, or of an id its producer no longer offers (its lease ended and was swept),
waits forever, whatever ``timeout`` it is given. So each pull runs in a thread of its own that
the caller (a reader thread of the worker) waits for up to ``timeout_s``; past it the pull is
abandoned (the load fails, and the request's kv_load_failure_policy applies) and its connection
poisoned (``_poison_connection``: the blocked pull then raises and its thread ends). A thread
that still does not end (a transport that ignores the poison) is kept in a bounded set: while
``max_stuck`` are blocked, new pulls are refused at once, so repeated failures never grow the
threads without bound, and the engine, which never waits for a pull, keeps stepping.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("jaxserve")


class PullGuard:
    """Args:
    timeout_s: the longest one pull is waited for.
    max_stuck: abandoned pulls whose threads may stay blocked at once; past it, pulls are
        refused.
    grace_s: how long a poisoned pull's thread is waited for to end.
    """

    def __init__(self, timeout_s: float, max_stuck: int = 8, grace_s: float = 1.0) -> None:
        self.timeout_s = float(timeout_s)
        self.max_stuck = max_stuck
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._stuck: set[threading.Thread] = set()
        self.num_abandoned = 0  # pulls past timeout_s; monotonic
        self.num_refused = 0  # pulls not started: max_stuck threads blocked; monotonic

    @property
    def num_stuck(self) -> int:
        """Abandoned pulls' threads still blocked."""
        with self._lock:
            self._stuck = {t for t in self._stuck if t.is_alive()}
            return len(self._stuck)

    def pull(self, connection: Any, fetch: Callable[[Any], Any], what: str) -> Any | None:
        """``fetch(connection)``'s result, or None: it failed (logged), it did not end in
        ``timeout_s`` (abandoned: ``connection`` poisoned), or too many pulls are blocked."""
        if self.num_stuck >= self.max_stuck:
            with self._lock:
                self.num_refused += 1
            logger.warning("KV transfer: %s not started: %d abandoned pulls still blocked",
                           what, self.max_stuck)  # fmt: skip
            return None
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(fetch(connection))
            except Exception as e:  # the producer died mid-pull, or the pull was poisoned
                logger.warning("KV transfer: %s failed (%s)", what, e)

        thread = threading.Thread(target=run, name="jaxserve-kv-pull", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not thread.is_alive():
            return result[0] if result else None
        with self._lock:
            self.num_abandoned += 1
        logger.warning("KV transfer: %s still running after %.3g s; abandoned", what,
                       self.timeout_s)  # fmt: skip
        poison = getattr(connection, "_poison_connection", None)
        if poison is not None:
            try:
                poison()
            except Exception as e:
                logger.warning("KV transfer: could not close the connection of %s (%s)", what, e)
        thread.join(self.grace_s)
        if thread.is_alive():
            with self._lock:
                self._stuck.add(thread)
        return None
