"""HeldOffers: a producer's offers (``kv_connector`` "JaxTransferConnector",
kv_transfer_worker.py) that its jax.experimental.transfer server may still hold, and their release.

The server keeps an offered array until a consumer pulls it; its ``await_pull`` timeout (the
offer's lease end) is only enforced lazily, when the next offer is made, so an idle producer
would keep its last offers' copies past their leases, and a producer whose consumers never
pull would hold one copy per prefill for a whole lease. HeldOffers bounds both:

- a cap: the offers it counts hold at most ``max_blocks`` gathered blocks (padded) at once; an
  offer past it first releases the oldest ones. The oldest, not the new one: an offer is pulled
  (or abandoned) soon after its answer, so the oldest is the likeliest to be pulled already (its
  release frees nothing and costs nothing) or dead (a client gone after its prefill), and
  refusing new offers instead would stop a producer from disaggregating at all until the dead
  offers' leases ended. The server does not say when an offer is pulled, so a pulled offer is
  counted until its lease ends or the cap releases it: the count is an upper bound of what the
  server holds.
- a lease: a thread of its own releases each offer when its lease ends, with or without steps.

An offer is released by offering an error array (``transfer.make_error_array``: no memory)
under its id in its place: the server drops the gathered copy at once, and a consumer that
pulls it later (up to a minute past its lease) gets the error at once (its load fails, and
kv_load_failure_policy applies) instead of waiting for an offer that will never come.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jax
from jax.experimental import transfer

logger = logging.getLogger("jaxserve")

# How long past its lease (or its release, if later) a released offer answers a late pull with
# its error (a consumer whose clock runs behind the producer's): past that, the server forgets
# it, and such a pull waits for the consumer's pull_timeout_s.
_ERROR_GRACE_S = 60.0


@dataclass(frozen=True)
class _Held:
    spec: Any  # jax.ShapeDtypeStruct of the gathered copy (for its error array)
    num_blocks: int  # its padded block count
    expires_at: float  # Unix time its lease ends


class HeldOffers:
    """Args:
    server: the producer's jax.experimental.transfer server.
    max_blocks: the most gathered blocks (padded) the counted offers may hold (>= 1).
    """

    def __init__(self, server: Any, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"HeldOffers max_blocks must be >= 1, got {max_blocks}")
        self.server = server
        self.max_blocks = max_blocks
        self._held: OrderedDict[int, _Held] = OrderedDict()  # transfer id -> offer, oldest first
        self._wake = threading.Condition()
        self._reaper: threading.Thread | None = None  # started with the first offer
        self._closed = False
        self.held_blocks = 0
        # Monotonic counters: offers released by the cap, and at their lease's end.
        self.num_evicted = 0
        self.num_expired = 0

    @property
    def num_held(self) -> int:
        """Offers counted as held (pulled ones included until released)."""
        with self._wake:
            return len(self._held)

    def offer(self, transfer_id: int, data: Any, expires_at: float) -> None:
        """Offer ``data`` (a gathered copy [n, ...]) under ``transfer_id`` until ``expires_at``,
        the oldest offers released first until it fits under the cap."""
        held = _Held(_spec_of(data), int(data.shape[0]), expires_at)
        if held.num_blocks > self.max_blocks:  # the scheduler's half offers none this large
            self._release(transfer_id, held, "its copy alone is larger than the cap")
            return
        evicted = []
        with self._wake:
            while self._held and self.held_blocks + held.num_blocks > self.max_blocks:
                evicted.append(self._pop(next(iter(self._held))))
            self._held[transfer_id] = held
            self.held_blocks += held.num_blocks
            self._start_reaper()
            self._wake.notify()
        for tid, old in evicted:
            self.num_evicted += 1
            self._release(tid, old, "the producer's held offers reached max_held_offers_fraction")
        self.server.await_pull(transfer_id, [data], timeout=_when(expires_at))

    def release_expired(self, now: float | None = None) -> int:
        """Release every offer whose lease has ended by ``now``; returns how many."""
        now = time.time() if now is None else now
        with self._wake:
            due = [self._pop(tid) for tid, h in list(self._held.items()) if h.expires_at <= now]
        for tid, held in due:
            self.num_expired += 1
            self._release(tid, held, "its lease ended")
        return len(due)

    def close(self) -> None:
        """Release every offer and stop the lease thread."""
        with self._wake:
            self._closed = True
            every = [self._pop(tid) for tid in list(self._held)]
            self._wake.notify()
        for tid, held in every:
            self._release(tid, held, "the producer closed")
        if self._reaper is not None:
            self._reaper.join(5.0)

    # ---- inside -----------------------------------------------------------------------------
    def _pop(self, transfer_id: int) -> tuple[int, _Held]:
        held = self._held.pop(transfer_id)
        self.held_blocks -= held.num_blocks
        return transfer_id, held

    def _release(self, transfer_id: int, held: _Held, why: str) -> None:
        """Put an error array in the offer's place: the server drops the copy now."""
        message = f"jaxserve KV offer {transfer_id} released: {why}"
        error = transfer.make_error_array(held.spec, message)
        until = max(held.expires_at, time.time()) + _ERROR_GRACE_S
        self.server.await_pull(transfer_id, [error], timeout=_when(until))
        logger.debug("KV transfer: %s", message)

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap, name="jaxserve-kv-leases", daemon=True
            )
            self._reaper.start()

    def _reap(self) -> None:
        """The lease thread: sleep until the next lease ends, release what has ended."""
        while True:
            with self._wake:
                if self._closed:
                    return
                now = time.time()
                first = min((h.expires_at for h in self._held.values()), default=None)
                if first is None or first > now:
                    self._wake.wait(None if first is None else first - now)
                    continue
            self.release_expired(now)


def _spec_of(data: Any) -> Any:
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)


def _when(unix_time: float) -> datetime.datetime:
    """The server's timeouts are local naive datetimes."""
    return datetime.datetime.fromtimestamp(unix_time)
