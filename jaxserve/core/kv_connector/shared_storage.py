"""SharedStorageConnector: the scheduler's half of the KV connector over a BlockStore (one
host's engines sharing a folder, by default in shared memory), vLLM's SharedStorageConnector
in jaxserve's shape.

Consumer (kv_consumer, kv_both): the KV cache manager's prefix lookup, past its device and
host hits, asks ``lookup`` for the request's next blocks; each block found is read at once and
becomes a RemoteHit, which allocation turns into a fresh device block (queued here as a load)
that enters the prefix cache. A block that is missing, expired or unreadable ends the hits:
the request computes it and what follows (kv_load_failure_policy "recompute"), so a producer
killed mid-transfer costs time, never tokens. Loads are synchronous: they run in the step that
admits the request, before its forward; no request waits in a state of its own.

Producer (kv_producer, kv_both): ``build_meta`` lists, for every request the step schedules,
the prompt blocks that this step completes (its drafts excluded; a block already stored is not
written again), and the runner stores them after the forward. The producer's device blocks are
never held for a consumer: what a consumer reads is the stored copy, leased for ``lease_s``;
aborts and disconnects free device blocks as without a connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from jaxserve.core.kv_connector.base import KVConnectorMeta
from jaxserve.core.kv_connector.store import BlockStore
from jaxserve.kv_transfer_config import KVTransferConfig

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.kv_connector.ray_store import RayBlockStore
    from jaxserve.core.sched.output import SchedulerOutput
    from jaxserve.request import Request


class SharedStorageConnector:
    """Args:
    config: the role and the failure policy.
    store: the shared blocks: files on this host (store.py) or a Ray actor (ray_store.py).
    block_size: tokens per block (P).
    """

    def __init__(
        self, config: KVTransferConfig, store: BlockStore | RayBlockStore, block_size: int
    ) -> None:
        self.config = config
        self.store = store
        self.block_size = block_size
        self._loads: list[tuple[int, np.ndarray]] = []  # queued by allocation, this step
        # Counters (monotonic): blocks loaded into and saved from this engine, lookups that
        # stopped at a block the store did not have.
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    # ---- consumer -------------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash]) -> list[np.ndarray]:
        """The data of the longest run of ``hashes`` (from the first) in the store, read now;
        [] for a producer."""
        if not self.config.loads:
            return []
        return self.store.read_prefix(hashes)

    def queue_load(self, block_id: int, data: np.ndarray) -> None:
        """Write ``data`` into device block ``block_id`` before this step's forward."""
        self._loads.append((block_id, data))

    # ---- producer -------------------------------------------------------------------------
    def build_meta(
        self,
        so: SchedulerOutput,
        requests: Mapping[str, Request],
        kv: KVCacheManager,
    ) -> KVConnectorMeta | None:
        """The step's loads (queued since the last step) and saves; None when there are none."""
        meta = KVConnectorMeta(loads=self._loads)
        self._loads = []
        if self.config.saves:
            meta.saves = self._saves(so, requests, kv)
        self.num_loaded_blocks += len(meta.loads)
        return meta if meta else None

    def _saves(
        self, so: SchedulerOutput, requests: Mapping[str, Request], kv: KVCacheManager
    ) -> list[tuple[int, BlockHash]]:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        bs = self.block_size
        saves = []
        for rid, num_scheduled in so.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None or rid not in computed:
                continue
            num_drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            end = min(computed[rid] + num_scheduled - num_drafts, req.num_prompt_tokens)
            first, last = computed[rid] // bs, end // bs
            if last <= first:
                continue
            hashes = extend_block_hashes(req, bs, last)
            block_ids = kv.get_block_ids(rid)
            for j in range(first, last):
                if not self.store.contains(hashes[j]):
                    saves.append((block_ids[j], hashes[j]))
        return saves

    def save_block(self, block_hash: BlockHash, data: np.ndarray) -> None:
        """Store one block (the runner's call, after the forward that wrote it)."""
        self.store.write(block_hash, data)
        self.num_saved_blocks += 1

    def stats(self) -> dict[str, int]:
        return {
            "kv_connector_loaded_blocks": self.num_loaded_blocks,
            "kv_connector_saved_blocks": self.num_saved_blocks,
        }
