"""RemoteHit and RemoteBlocks: the KV cache manager's side of the KV connector.

A prefix lookup that misses on the device and on the host tier goes on in the connector's
store (``RemoteBlocks.lookup``); each block found there is a RemoteHit, which allocation turns
into a fresh device block (``RemoteBlocks.take``). A hit read at once (a synchronous
connector) carries its data: the block is queued as a load before the step's forward and
enters the prefix cache at once, as a host hit does. A hit that loads asynchronously carries
none: its block holds no KV until the runner's load finishes, so it enters the prefix cache
only then (``finish``), and a load that stopped early gives its remaining blocks back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_utils import BlockHash, KVCacheBlock

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_connector.base import KVConnector
    from jaxserve.request import Request


@dataclass(frozen=True, eq=False)
class RemoteHit:
    """A prefix-cache hit in the KV connector's store (core/kv_connector/): the block's
    contents ``data`` [L, 2, K, P, H] already read into host memory, or None when the block
    loads asynchronously (the runner reads it)."""

    block_hash: BlockHash
    data: Any = None


class RemoteBlocks:
    """Args:
    connector: the KV connector's scheduler half, or None (no lookups).
    block_pool: the device pool the fresh blocks come from.
    """

    def __init__(self, connector: KVConnector | None, block_pool: BlockPool) -> None:
        self.connector = connector
        self.block_pool = block_pool
        # req_id -> its blocks waiting for an asynchronous load, with their hashes, in table
        # order (the tail of its table). Added by take, dropped by finish or drop.
        self.pending: dict[str, list[tuple[KVCacheBlock, BlockHash]]] = {}

    def lookup(
        self, hashes: list[BlockHash], request: Request | None = None, first_block: int = 0
    ) -> list[RemoteHit]:
        """The leading ``hashes`` (``request``'s blocks from ``first_block`` on) the store
        holds ([] without a connector), up to the first that another request is loading: the
        lookup's request waits for that load instead of loading the block twice
        (PendingPrefixes.defer)."""
        if self.connector is None or not hashes:
            return []
        if self.pending:
            loading = self.loading_hashes()
            hashes = hashes[: next((i for i, h in enumerate(hashes) if h in loading), len(hashes))]
        found = self.connector.lookup(hashes, request, first_block) if hashes else []
        return [RemoteHit(h, data) for h, data in zip(hashes, found, strict=False)]

    def loading_hashes(self) -> set[BlockHash]:
        """Hashes of the blocks asynchronous loads are writing now."""
        return {h for blocks in self.pending.values() for _, h in blocks}

    def take(self, hit: RemoteHit, block: KVCacheBlock, req_id: str) -> None:
        """``block`` (fresh, held by ``req_id``) receives ``hit``'s KV."""
        if hit.data is not None:
            self.connector.queue_load(block.block_id, hit.data)
            self.block_pool.cache_block(block, hit.block_hash)
        else:
            self.pending.setdefault(req_id, []).append((block, hit.block_hash))

    def job(self, req_id: str) -> tuple[tuple[int, ...], tuple[BlockHash, ...]]:
        """(block ids, hashes) of the request's asynchronous load."""
        pending = self.pending.get(req_id, [])
        return tuple(b.block_id for b, _ in pending), tuple(h for _, h in pending)

    def finish(self, req_id: str, table: list[KVCacheBlock], num_loaded: int) -> None:
        """The load of ``req_id`` wrote its first ``num_loaded`` blocks: they enter the prefix
        cache; the others leave ``table`` (its tail) and return to the pool."""
        pending = self.pending.pop(req_id, [])
        for block, block_hash in pending[:num_loaded]:
            self.block_pool.cache_block(block, block_hash)
        failed = len(pending) - min(num_loaded, len(pending))
        if failed:
            self.block_pool.free_blocks(reversed(table[-failed:]))
            del table[-failed:]

    def drop(self, req_id: str) -> None:
        """Forget a request's pending blocks (its table is freed by the caller)."""
        self.pending.pop(req_id, None)

    def clear(self) -> None:
        self.pending.clear()
