"""tp_cases.py's "transfer" case: a JaxTransferConnector producer and consumer each at tp 2,
on disjoint devices of the 8 simulated ones (devices 0-1 and 2-3), runner halves only (the
engines' parity is tp_cases' parity): the producer gathers a prompt's blocks out of pages
sharded on the KV heads and offers them on its transfer server; the consumer pulls them onto
its own mesh and scatters them into its sharded pages. ~1 s: no model, no engine.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob, Offer
from jaxserve.core.kv_connector.transfer import PullSource
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.models import TP_AXIS
from jaxserve.runner.kv_transfer_worker import make_transfer_connector
from jaxserve.runner.sharding import ShardingPlan, make_mesh

L, K, S, P, H = 2, 2, 16, 4, 8  # K = tp: one KV head a device


def _plan(devices: list) -> ShardingPlan:
    return ShardingPlan(make_mesh(2, devices), None, PartitionSpec(TP_AXIS))


def _pages(plan: ShardingPlan, seed: int) -> list[tuple[jax.Array, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [
        tuple(
            jax.device_put(rng.standard_normal((K, S, P, H)).astype(np.float32), plan.kv_sharding)
            for _ in range(2)
        )  # fmt: skip
        for _ in range(L)
    ]


def run_transfer() -> dict[str, Any]:
    devices = jax.devices()
    plans = _plan(devices[0:2]), _plan(devices[2:4])
    config = KVTransferConfig(kv_connector="JaxTransferConnector", pull_timeout_s=60.0)
    producer, consumer = (make_transfer_connector(config, "m", L, (K, S, P, H), jnp.float32, p)
                          for p in plans)  # fmt: skip
    try:
        src, dst = _pages(plans[0], 0), _pages(plans[1], 1)
        offer = Offer("r", 77, (1, 2, 3), time.time() + 60)
        producer.save(src, KVConnectorMeta(offers=[offer]))
        # The consumer had the first block: it takes blocks 2 and 3, into its 6 and 4.
        source = PullSource("127.0.0.1", producer.connector.port, 77, 3, 1, offer.expires_at)
        job = LoadJob("r", (6, 4), (b"x", b"y"), source)
        data = consumer._read(job)
        pulled_on = sorted(d.id for d in data.sharding.device_set) if data is not None else []
        dst, written = consumer._write(dst, job, data)
        moved = [(6, 2), (4, 3)]  # (consumer block, producer block)
        same = all(
            np.array_equal(np.asarray(dst[layer][kv])[:, d], np.asarray(src[layer][kv])[:, s])
            for layer in range(L) for kv in range(2) for d, s in moved
        )  # fmt: skip
        return {
            "written": written,
            "same_bits": same,
            "pulled_on": pulled_on,
            "pages_on": sorted(d.id for d in dst[0][0].sharding.device_set),
            "pages_sharded": dst[0][0].sharding.spec[0] == TP_AXIS,
            "layouts": [w.connector.layout for w in (producer, consumer)],
        }
    finally:
        producer.close()
        consumer.close()
