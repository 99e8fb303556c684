"""PendingPrefixes: the blocks this step's running requests are computing (and those the KV
connector's asynchronous loads are writing), so that a waiting request whose next uncached
block is one of them waits a step and then hits it in the prefix cache, instead of the same
block being computed (or loaded) twice (offline batches of shared prefixes).

Built lazily, on the first waiting request that could use it; only with prefix caching.
"""

from __future__ import annotations

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import BlockHash
from jaxserve.request import Request


class PendingPrefixes:
    """One step's pending block hashes over ``running`` (the scheduler's sorted list)."""

    def __init__(self, kv: KVCacheManager, running: list[Request], block_size: int) -> None:
        self._kv, self._running, self._block_size = kv, running, block_size
        self._hashes: set[BlockHash] | None = None

    def defer(self, req: Request, num_hit_tokens: int) -> bool:
        """Whether ``req``, whose prefix lookup found ``num_hit_tokens``, should wait: its next
        block is being computed."""
        if self._hashes is None:
            self._hashes = pending_block_hashes(self._kv, self._running)
            self._hashes |= self._kv.remote.loading_hashes()  # KV connector loads under way
        next_block = num_hit_tokens // self._block_size
        return next_block < len(req.block_hashes) and req.block_hashes[next_block] in self._hashes

    def admitted(self, req: Request, num_computed: int) -> None:
        """``req`` was admitted: its blocks past ``num_computed`` tokens are pending too."""
        if self._hashes is not None:
            self._hashes.update(req.block_hashes[num_computed // self._block_size :])


def pending_block_hashes(kv: KVCacheManager, requests: list[Request]) -> set[BlockHash]:
    """Hashes of the full blocks that these (running) requests have scheduled or will
    schedule but that are not in the prefix cache yet: a waiting request whose next block
    is among them gets a hit by waiting until they are computed."""
    pending: set[BlockHash] = set()
    if not kv.enable_caching:
        return pending
    num_cached_blocks = kv.num_cached_blocks
    for request in requests:
        hashes = request.block_hashes
        num_cached = num_cached_blocks.get(request.request_id, len(hashes))
        if num_cached < len(hashes):
            pending.update(hashes[num_cached:])
    return pending
