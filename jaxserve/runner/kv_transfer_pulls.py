"""PullGuard: a consumer's pulls (``kv_connector`` "JaxTransferConnector", kv_transfer_worker.py)
with a deadline, and the threads of the pulls that miss it accounted for.

A jax.experimental.transfer pull has no deadline of its own that works: one from an address
nobody answers on, or of an id its producer no longer offers (its lease ended and was swept),
waits forever, whatever ``timeout`` it is given. So each pull runs in a thread of its own that
the caller (a reader thread of the worker) waits for up to ``timeout_s``; past it the pull is
abandoned (the load fails, and the request's kv_load_failure_policy applies) and its connection
poisoned (the blocked pull then raises and its thread ends). A thread that still does not end
(a transport that ignores the poison, or one without it) is kept in a bounded set: while
``max_stuck`` are blocked, new pulls are refused at once, so repeated failures never grow the
threads without bound, and the engine, which never waits for a pull, keeps stepping.
``close`` (the engine shuts down) poisons every pull still running and refuses new ones.

The poison is ``TransferConnection._poison_connection``, a private method: jax 0.10 (and
jax's main branch as of this writing: jax/experimental/transfer.py) has no public way to
abandon a pull, and its ``timeout`` does not end one that waits. So it is looked up, not
assumed (``_poison``): a jax without it degrades to pulls that are abandoned but not woken
(their threads counted in ``num_stuck``, bounded by ``max_stuck``), logged once, never an
error.
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
        self._running: dict[threading.Thread, Any] = {}  # pull thread -> its connection
        self._closed = False
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
        ``timeout_s`` (abandoned: ``connection`` poisoned), too many pulls are blocked, or the
        guard is closed."""
        if self._closed or self.num_stuck >= self.max_stuck:
            with self._lock:
                self.num_refused += 1
            why = "the guard is closed" if self._closed else f"{self.max_stuck} pulls blocked"
            logger.warning("KV transfer: %s not started: %s", what, why)
            return None
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(fetch(connection))
            except Exception as e:  # the producer died mid-pull, or the pull was poisoned
                logger.warning("KV transfer: %s failed (%s)", what, e)
            finally:
                with self._lock:
                    self._running.pop(threading.current_thread(), None)

        thread = threading.Thread(target=run, name="jaxserve-kv-pull", daemon=True)
        with self._lock:  # registered as it starts: run's finally unregisters it after
            thread.start()
            self._running[thread] = connection
        thread.join(self.timeout_s)
        if not thread.is_alive():
            return result[0] if result else None
        with self._lock:
            self.num_abandoned += 1
        logger.warning("KV transfer: %s still running after %.3g s; abandoned", what,
                       self.timeout_s)  # fmt: skip
        self._abandon(thread, connection, what)
        return None

    def close(self) -> None:
        """Refuse new pulls and abandon the running ones (their connections poisoned, their
        threads waited for ``grace_s`` each); idempotent."""
        with self._lock:
            self._closed = True
            running = list(self._running.items())
        for thread, connection in running:
            self._abandon(thread, connection, "a pull running at shutdown")

    def _abandon(self, thread: threading.Thread, connection: Any, what: str) -> None:
        """Poison ``connection`` so its blocked pull raises, wait ``grace_s`` for ``thread``;
        a thread still blocked is counted as stuck."""
        _poison(connection, what)
        thread.join(self.grace_s)
        if thread.is_alive():
            with self._lock:
                self._stuck.add(thread)


_warned_no_poison = False


def _poison(connection: Any, what: str) -> None:
    """Make ``connection``'s blocked pull raise, where this jax can (module docstring)."""
    global _warned_no_poison
    poison = getattr(connection, "_poison_connection", None)
    if poison is None:
        if not _warned_no_poison:
            _warned_no_poison = True
            logger.warning(
                "KV transfer: this jax cannot abandon a pull (no "
                "TransferConnection._poison_connection): %s stays blocked",
                what,
            )
        return
    try:
        poison()
    except Exception as e:
        logger.warning("KV transfer: could not close the connection of %s (%s)", what, e)
