"""What a JaxTransferConnector producer holds and what a consumer's pulls leave behind
(runner/kv_transfer_offers.py, kv_transfer_pulls.py), through real jax.experimental.transfer
servers on 127.0.0.1: an offer's gathered copy is freed (the process's resident memory drops
by its size) when its lease ends with no step, when the cap releases it for a newer one, and
after its pull; a released offer answers its late consumer with an error at once. A pull that
never ends is abandoned and its connection poisoned, so its thread ends; threads a transport
leaves blocked (or a jax without the poison) are bounded, and pulls past that bound are
refused without a thread; closing the guard ends the pulls under way."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import transfer

from jaxserve.runner.kv_transfer_offers import HeldOffers
from jaxserve.runner.kv_transfer_pulls import PullGuard

ROWS, COLS = 2, 6 << 20  # one copy: 2 "blocks" of 24 MiB (mapped and unmapped on its own)
SIZE_MIB = ROWS * COLS * 4 / (1 << 20)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def _server():
    client = jax.devices()[0].client
    return transfer.start_transfer_server(
        client, address="127.0.0.1:0", transport_addresses=["127.0.0.1:0"]
    )


def _copy(value: float) -> jax.Array:
    return jax.block_until_ready(jnp.full((ROWS, COLS), value, jnp.float32))


def _spec() -> jax.ShapeDtypeStruct:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=sharding)


@pytest.fixture(scope="module")
def servers():
    return _server(), _server()


def _pull(producer, consumer, transfer_id: int) -> jax.Array | None:
    """The pulled copy, or None: the pull failed by itself (never abandoned: no hang)."""
    guard = PullGuard(timeout_s=10.0)
    fetch = lambda conn: jax.block_until_ready(conn.pull(transfer_id, [_spec()])[0])  # noqa: E731
    data = guard.pull(consumer.connect(producer.address()), fetch, f"pull {transfer_id}")
    assert guard.num_abandoned == 0
    return data


class _Blocking:
    """A connection whose pull blocks until released; poisoning releases it unless deaf."""

    def __init__(self, deaf: bool = False) -> None:
        self.release = threading.Event()
        self.deaf = deaf

    def pull(self, transfer_id: int, specs: list) -> list:
        self.release.wait(60)
        raise RuntimeError("connection closed")

    def _poison_connection(self) -> None:
        if not self.deaf:
            self.release.set()


def _fetch(connection: _Blocking) -> list:
    return connection.pull(1, [])


def test_abandoned_pulls_end_and_blocked_threads_stay_bounded():
    before = threading.active_count()
    guard = PullGuard(timeout_s=0.05, max_stuck=3, grace_s=1.0)
    for i in range(10):  # poisoned: each thread ends
        assert guard.pull(_Blocking(), _fetch, f"pull {i}") is None
    assert guard.num_abandoned == 10 and guard.num_stuck == 0
    assert threading.active_count() == before
    deaf = [_Blocking(deaf=True) for _ in range(10)]
    guard.grace_s = 0.01
    for i, conn in enumerate(deaf):  # a transport that ignores the poison
        assert guard.pull(conn, _fetch, f"deaf pull {i}") is None
        assert threading.active_count() <= before + 3
    assert guard.num_stuck == 3 and guard.num_refused == 7 and guard.num_abandoned == 13
    for conn in deaf:
        conn.release.set()
    for _ in range(100):
        if guard.num_stuck == 0:
            break
        time.sleep(0.02)
    assert guard.num_stuck == 0
    assert guard.pull(_Blocking(), lambda c: "data", "a pull once unblocked") == "data"


class _NoPoison:
    """A connection of a jax without ``_poison_connection``: its pull blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def pull(self, transfer_id: int, specs: list) -> list:
        self.release.wait(60)
        raise RuntimeError("connection closed")


def test_close_ends_running_pulls_and_a_jax_without_the_poison_degrades():
    """close() (the engine shuts down) poisons the pulls under way, which end, and refuses new
    ones; where the connection cannot be poisoned, an abandoned pull's thread is counted as
    stuck (bounded by max_stuck), never an error."""
    guard = PullGuard(timeout_s=30.0, grace_s=1.0)
    results = []
    caller = threading.Thread(target=lambda: results.append(guard.pull(_Blocking(), _fetch, "p")))
    caller.start()
    for _ in range(100):  # until the pull runs
        if guard._running:
            break
        time.sleep(0.01)
    guard.close()
    caller.join(5.0)
    assert not caller.is_alive() and results == [None] and not guard._running
    assert guard.pull(_Blocking(), lambda c: "data", "after close") is None
    assert guard.num_refused == 1
    guard.close()  # idempotent
    old = PullGuard(timeout_s=0.05, max_stuck=1, grace_s=0.01)
    conn = _NoPoison()
    assert old.pull(conn, _fetch, "unpoisonable") is None
    assert old.num_abandoned == 1 and old.num_stuck == 1
    assert old.pull(_NoPoison(), _fetch, "refused") is None and old.num_refused == 1
    conn.release.set()


def test_a_real_pull_of_an_id_never_offered_is_poisoned_and_ends(servers):
    producer, consumer = servers
    guard = PullGuard(timeout_s=0.2)
    fetch = lambda conn: jax.block_until_ready(conn.pull(999, [_spec()])[0])  # noqa: E731
    assert guard.pull(consumer.connect(producer.address()), fetch, "pull 999") is None
    assert guard.num_abandoned == 1 and guard.num_stuck == 0


def test_an_offers_copy_is_freed_at_lease_end_by_the_cap_and_after_its_pull():
    """In a process of its own: the resident memory measures what this process's allocations
    alone did (after other tests, freed pages may stay resident and hide a copy)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("released")


def _measure_releases() -> None:
    producer, consumer = _server(), _server()
    offers = HeldOffers(producer, max_blocks=ROWS)  # room for one copy
    _copy(0.0)  # compiled and freed before the measures
    gc.collect()
    base = _rss_mib()
    # A lease that ends with nothing else happening: the lease thread releases it.
    offers.offer(1, _copy(1.0), time.time() + 0.2)
    gc.collect()
    assert _rss_mib() - base > 0.75 * SIZE_MIB  # the server holds the copy
    for _ in range(200):
        if offers.num_held == 0:
            break
        time.sleep(0.05)
    assert offers.num_held == 0 and offers.held_blocks == 0 and offers.num_expired == 1
    assert _rss_mib() - base < 0.25 * SIZE_MIB
    assert _pull(producer, consumer, 1) is None  # an error at once, not a hang
    # The cap: a second offer releases the first (the oldest), one copy is held at a time.
    offers.offer(2, _copy(2.0), time.time() + 60)
    gc.collect()
    one = _rss_mib()
    offers.offer(3, _copy(3.0), time.time() + 60)
    gc.collect()
    assert offers.num_evicted == 1 and offers.num_held == 1 and offers.held_blocks == ROWS
    assert abs(_rss_mib() - one) < 0.25 * SIZE_MIB
    assert _pull(producer, consumer, 2) is None  # released: its consumer's load fails
    pulled = _pull(producer, consumer, 3)
    assert pulled is not None and float(pulled[0, 0]) == 3.0
    del pulled
    # After its pull the server holds no copy (measured once the transport is warm).
    offers.offer(4, _copy(4.0), time.time() + 60)
    gc.collect()
    held = _rss_mib()
    pulled = _pull(producer, consumer, 4)
    assert pulled is not None and float(pulled[-1, -1]) == 4.0
    del pulled
    gc.collect()
    assert held - _rss_mib() > 0.75 * SIZE_MIB
    offers.close()  # what it still counted (3 and 4, pulled) is released; nothing is held
    assert offers.num_held == 0 and offers.held_blocks == 0


if __name__ == "__main__":  # the measure of test_an_offers_copy_is_freed_at_lease_end_...
    _measure_releases()
    print("released")
