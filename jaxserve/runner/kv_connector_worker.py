"""KVConnectorWorker: the runner's half of the KV connector (the scheduler's half is
core/kv_connector/): it writes the blocks a consumer loads into the device pages before the
forward, and reads the blocks a producer saves out of them after it.

Both go through a small staging host tier (kv_offload.KVOffloader: its jitted gather and
scatter at padded power-of-two counts), ``staging_blocks`` blocks at a time, so the copies reuse
the host tier's compiled shapes and its float / FP8 handling: a block's raw bytes in the pages'
own dtype. An FP8 cache's per-layer scales come from the checkpoint, the same in every engine
of one model, so they are not transferred.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from jaxserve.core.kv_connector.base import KVConnectorMeta
from jaxserve.core.kv_connector.ray_store import RayBlockStore
from jaxserve.core.kv_connector.shared_storage import SharedStorageConnector
from jaxserve.core.kv_connector.store import BlockStore
from jaxserve.kv_transfer_config import KVTransferConfig
from jaxserve.runner.kv_offload import KVOffloader
from jaxserve.runner.sharding import ShardingPlan

KVCaches = list[tuple[jax.Array, jax.Array]]


class KVConnectorWorker:
    """Args:
    connector: the scheduler's half (the store the saves go to).
    staging: the staging host tier the copies go through.
    """

    def __init__(self, connector: SharedStorageConnector, staging: KVOffloader) -> None:
        self.connector = connector
        self.staging = staging

    def load(self, kv_caches: KVCaches, meta: KVConnectorMeta) -> KVCaches:
        """Write the step's loaded blocks into their device blocks; returns the new pages."""
        n = self.staging.num_host_blocks
        for start in range(0, len(meta.loads), n):
            chunk = meta.loads[start : start + n]
            for slot, (_, data) in enumerate(chunk):
                self.staging.host[slot] = data
            pairs = [(slot, block_id) for slot, (block_id, _) in enumerate(chunk)]
            kv_caches = self.staging.apply(kv_caches, [], pairs)
        return kv_caches

    def save(self, kv_caches: KVCaches, meta: KVConnectorMeta) -> KVCaches:
        """Store the step's saved blocks (after the forward wrote them); returns the pages."""
        n = self.staging.num_host_blocks
        for start in range(0, len(meta.saves), n):
            chunk = meta.saves[start : start + n]
            pairs = [(block_id, slot) for slot, (block_id, _) in enumerate(chunk)]
            kv_caches = self.staging.apply(kv_caches, pairs, [])
            for slot, (_, block_hash) in enumerate(chunk):
                self.connector.save_block(block_hash, self.staging.host[slot])
        return kv_caches


def make_kv_connector(
    config: KVTransferConfig,
    model_name: str,
    num_layers: int,
    page_shape: tuple[int, int, int, int],
    dtype: Any,
    sharding: ShardingPlan | None,
    staging_blocks: int = 16,
) -> KVConnectorWorker:
    """The connector of ``config`` for pages ``page_shape`` (K, S, P, H) x ``num_layers`` of
    ``dtype``: its store's subfolder is named by the model and this layout, so engines of other
    models or layouts never share blocks with it."""
    staging = KVOffloader(num_layers, page_shape, dtype, staging_blocks, sharding,
                          max_copy_bucket=staging_blocks)  # fmt: skip
    layout = f"{model_name}|{staging.block_shape}|{np.dtype(dtype).name}"
    fingerprint = hashlib.sha256(layout.encode()).hexdigest()[:16]
    if config.transport == "ray":
        store = RayBlockStore(fingerprint, staging.block_shape, staging.dtype, config.lease_s,
                              config.ray_address, config.ray_namespace)  # fmt: skip
    else:
        store = BlockStore(config.path, fingerprint, staging.block_shape, staging.dtype,
                           config.lease_s)  # fmt: skip
    block_size = page_shape[2]
    return KVConnectorWorker(SharedStorageConnector(config, store, block_size), staging)
