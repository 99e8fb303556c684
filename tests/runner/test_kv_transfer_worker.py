"""The JaxTransferConnector's runner half without an engine (runner/kv_transfer_copies.py,
kv_transfer_worker.py): a gather and a scatter move blocks bit for bit in every page dtype,
rows aimed at the null block write only zeros there; an offer pulled through a real transfer
server on 127.0.0.1 lands in the job's blocks; a pull that never ends is abandoned after
pull_timeout_s and an expired offer is not pulled, each loading nothing."""

from __future__ import annotations

import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob, Offer
from jaxserve.core.kv_connector.transfer import PullSource, TransferConnector
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.runner.kv_transfer_copies import TransferCopies, padded_blocks
from jaxserve.runner.kv_transfer_worker import TransferWorker, make_transfer_connector

L, K, S, P, H = 2, 2, 8, 4, 8


def _pages(dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        tuple(jnp.asarray(rng.standard_normal((K, S, P, H)) * 3, dtype) for _ in range(2))
        for _ in range(L)
    ]


def _bits(pages, block: int) -> list[np.ndarray]:
    return [np.asarray(x).view(np.uint8)[:, block] for layer in pages for x in layer]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_gather_then_scatter_moves_blocks_bit_for_bit(dtype: str) -> None:
    src, dst = _pages(dtype, 0), _pages(dtype, 1)
    copies = TransferCopies(L, (K, S, P, H), jnp.dtype(dtype), None)
    assert copies.copy_sizes == (1, 2, 4, 8) and padded_blocks(3) == 4
    data = copies.gather(src, (3, 5, 6))
    assert data.shape == copies.spec(3).shape == (4, L, 2, K, P, H)
    # Row 0 was a block the consumer had (0: not written), rows 1 and 2 go to 7 and 2.
    dst = copies.scatter(dst, data, np.array([0, 7, 2, 0], np.int32))
    for got, want in zip(_bits(dst, 7) + _bits(dst, 2), _bits(src, 5) + _bits(src, 6), strict=True):
        np.testing.assert_array_equal(got, want)
    assert all(not b.any() for b in _bits(dst, 0))  # the null block holds zeros only


def _config(**extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="JaxTransferConnector", pull_timeout_s=0.3, **extra)


def test_an_offer_is_pulled_into_the_jobs_blocks() -> None:
    producer = make_transfer_connector(_config(), "m", L, (K, S, P, H), jnp.float32, None)
    consumer = make_transfer_connector(_config(), "m", L, (K, S, P, H), jnp.float32, None)
    src, dst = _pages("float32", 0), _pages("float32", 1)
    offer = Offer("r", 1234, (1, 2, 3), time.time() + 60)
    producer.save(src, KVConnectorMeta(offers=[offer]))
    host, port = producer.connector.host, producer.connector.port
    # The consumer had offered block 0 already: its job is blocks 1 and 2, into 6 and 4.
    job = LoadJob("r", (6, 4), (b"x", b"y"), PullSource(host, port, 1234, 3, 1, offer.expires_at))
    data = consumer._read(job)
    dst, num = consumer._write(dst, job, data)
    assert num == 2
    for got, want in zip(_bits(dst, 6) + _bits(dst, 4), _bits(src, 2) + _bits(src, 3), strict=True):
        np.testing.assert_array_equal(got, want)


class _HangingServer:
    """A transfer server whose pulls wait until the test releases them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.connected = 0

    def connect(self, address: str) -> _HangingServer:
        self.connected += 1
        return self

    def pull(self, uuid: int, specs: list) -> list:
        self.release.wait(30)
        raise RuntimeError("released")


def test_a_hung_pull_is_abandoned_and_an_expired_offer_not_pulled() -> None:
    copies = TransferCopies(L, (K, S, P, H), jnp.float32, None)
    server = _HangingServer()
    worker = TransferWorker(TransferConnector(_config(), P, "layout", ("127.0.0.1", 0)), copies,
                            server, pull_timeout_s=0.3, max_held_blocks=8)  # fmt: skip
    with socket.socket() as listener:  # the producer's port answers, its pull never ends
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        try:
            job = LoadJob(
                "r", (3,), (b"x",), PullSource("127.0.0.1", port, 1, 1, 0, time.time() + 60)
            )
            assert worker._read(job) is None and worker.num_abandoned_pulls == 1
            expired = LoadJob(
                "s", (3,), (b"x",), PullSource("127.0.0.1", port, 2, 1, 0, time.time() - 1)
            )
            assert worker._read(expired) is None and server.connected == 1
        finally:
            server.release.set()
    pages = _pages("float32")
    assert worker._write(pages, job, None) == (pages, 0)


def test_a_server_that_cannot_start_is_refused_by_name() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = _config(transfer_port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="JaxTransferConnector"):
            make_transfer_connector(config, "m", L, (K, S, P, H), jnp.float32, None)
