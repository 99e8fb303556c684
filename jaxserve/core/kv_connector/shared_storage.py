"""SharedStorageConnector: the scheduler's half of the KV connector over a BlockStore (one
host's engines sharing a folder, by default in shared memory), vLLM's SharedStorageConnector
in jaxserve's shape.

Consumer (kv_consumer, kv_both): the KV cache manager's prefix lookup, past its device and
host hits, asks ``lookup`` for the request's next blocks; each block found becomes a RemoteHit,
which allocation turns into a fresh device block. With ``load_async`` (the default) the lookup
only sees which blocks the store holds; the request then waits in WAITING_FOR_REMOTE_KVS
(sched/remote_kv.py) while the runner reads them in a thread (a LoadJob queued here) and writes
them in a later step. Without it, each block is read at once (queued here as a load written
before the step's forward) and the request is admitted at once. A block that is missing,
expired or unreadable ends the hits: the request computes it and what follows, or fails when
its kv_transfer_params promised it and kv_load_failure_policy is "fail"; so a producer killed
mid-transfer costs time, never tokens.

Producer (kv_producer, kv_both): ``build_meta`` lists, for every request the step schedules,
the prompt blocks that this step completes (its drafts excluded; a block already stored is not
written again; a new request's prefix hits are stored again if their lease ended), and the
runner stores them after the forward; a prefill's answer says how many tokens a consumer may
load (``producer_params``). The producer's device blocks are
never held for a consumer: what a consumer reads is the stored copy, leased for ``lease_s``;
aborts and disconnects free device blocks as without a connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from jaxserve.core.kv_connector.base import KVConnectorMeta, LoadJob
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
        self.load_async = config.load_async
        self._loads: list[tuple[int, np.ndarray]] = []  # queued by allocation, this step
        self._jobs: list[LoadJob] = []  # asynchronous loads queued this step
        # Counters (monotonic): blocks loaded into and saved from this engine, lookups that
        # stopped at a block the store did not have.
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    # ---- consumer -------------------------------------------------------------------------
    def lookup(
        self, hashes: list[BlockHash], request: Request | None = None, first_block: int = 0
    ) -> list[np.ndarray | None]:
        """One entry per block of the longest run of ``hashes`` (from the first) in the store:
        its data, read now, or None when loads are asynchronous (the runner reads it); [] for
        a producer. (Blocks are found by hash alone: ``request`` and ``first_block``, which of
        its blocks ``hashes`` start at, are for connectors that pull from a named producer.)"""
        if not self.config.loads:
            return []
        if self.load_async:
            return [None] * self.store.count_prefix(hashes)
        return self.store.read_prefix(hashes)

    def queue_load(self, block_id: int, data: np.ndarray) -> None:
        """Write ``data`` into device block ``block_id`` before this step's forward."""
        self._loads.append((block_id, data))

    def queue_job(self, job: LoadJob) -> None:
        """Start an asynchronous load in the runner with this step."""
        self._jobs.append(job)

    def count_loaded(self, num_blocks: int) -> None:
        """An asynchronous load wrote ``num_blocks`` blocks."""
        self.num_loaded_blocks += num_blocks

    def producer_params(self, req: Request) -> dict[str, object]:
        """The kv_transfer_params a finished prefill (``do_remote_decode``) answers with, for
        its decode request: the prompt's full blocks are in the store (saved in the steps that
        computed them, before the answer)."""
        num_tokens = req.num_prompt_tokens // self.block_size * self.block_size
        return {"do_remote_prefill": True, "remote_num_tokens": num_tokens}

    # ---- producer -------------------------------------------------------------------------
    def build_meta(
        self,
        so: SchedulerOutput,
        requests: Mapping[str, Request],
        kv: KVCacheManager,
    ) -> KVConnectorMeta | None:
        """The step's loads (queued since the last step) and saves; None when there are none."""
        meta = KVConnectorMeta(loads=self._loads, load_jobs=self._jobs)
        self._loads, self._jobs = [], []
        if self.config.saves:
            meta.saves = self._saves(so, requests, kv)
        self.num_loaded_blocks += len(meta.loads)
        return meta if meta else None

    def _saves(
        self, so: SchedulerOutput, requests: Mapping[str, Request], kv: KVCacheManager
    ) -> list[tuple[int, BlockHash]]:
        # A new request's prefix hits are checked too: its blocks may have left the store
        # while they stayed in this engine's cache.
        new_ids = {r.req_id for r in so.scheduled_new_reqs}
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
            hashes = extend_block_hashes(req, bs, max(first, last))
            if rid in new_ids and first:  # its hits' blocks the store still has, in one call
                first = self.store.count_prefix(hashes[:first])
            if last <= first:
                continue
            block_ids = kv.get_block_ids(rid)
            for j in range(first, last):
                if not self.store.contains(hashes[j]):
                    saves.append((block_ids[j], hashes[j]))
        return saves

    def save_block(self, block_hash: BlockHash, data: np.ndarray) -> None:
        """Store one block (the runner's call, after the forward that wrote it)."""
        self.store.write(block_hash, data)
        self.num_saved_blocks += 1

    def describe(self) -> str:
        """Where the blocks are (the start-up log)."""
        return f"blocks in {self.store.folder}"

    def stats(self) -> dict[str, int]:
        return {
            "kv_connector_loaded_blocks": self.num_loaded_blocks,
            "kv_connector_saved_blocks": self.num_saved_blocks,
        }
