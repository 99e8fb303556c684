"""BlockPool: every KV block of the device pool, its free queue and the prefix-cache map.

Life of a block:

    free, uncached --get_new_blocks--> held (ref_cnt >= 1) --cache_full_blocks--> held, hashed
    held --free_blocks (last holder)--> free (tail of the queue); a hashed block stays in the map
    free, hashed --touch (prefix hit)--> held again, taken out of the middle of the queue
    free, hashed --get_new_blocks (reaches the head)--> evicted from the map, held by a new owner
        (with a host KV tier, ``on_evict`` first queues a copy of it to host memory)

So the prefix cache evicts lazily, in LRU order, only when a block is actually reused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from jaxserve.core.kv_cache_utils import (
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    extend_block_hashes,
)

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.request import Request


class BlockPool:
    """All blocks of one KV pool.

    Block 0 is the reserved null block: padding tokens write there, so it is never allocated,
    never freed and not counted as usable. Blocks 1..num_blocks-1 are usable.

    Invariants (tests check them): a block is in the free queue iff its ref_cnt is 0; a block in
    ``cached_blocks`` has ``block_hash`` set to its key; at most one block per hash.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[BlockHash, int], None] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks  # including the null block
        self.num_usable_blocks = num_blocks - 1
        self.enable_caching = enable_caching
        # Called with (hash, block_id) when a cached block is evicted to be reused, before the
        # new owner writes it: the host tier keeps a copy (host_block_pool.py).
        self.on_evict = on_evict
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]  # index = block_id
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # hash -> the block holding that content (held or free-but-cached).
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Counters, monotonic; mutated by this class only.
        self.num_allocated = 0  # blocks handed out by get_new_blocks
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them
        self.num_cached_total = 0  # blocks entered into the prefix-cache map

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref_cnt 1.

        A taken block that still carries a hash is evicted from the prefix cache now.
        Raises ValueError when fewer blocks are free (callers check first).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        self.num_allocated += num_blocks
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching ref_cnt 0 join the tail of the free queue in that order, so pass a
        request's blocks reversed: its last (least shareable) block is then evicted first.
        """
        append = self.free_block_queue.append
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit or a fork); free ones leave the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix-cache map.

        ``blocks`` is the request's block table; the caller guarantees that the first
        ``num_full_blocks`` blocks are full and their KV computed. Hashes come from (and are
        added to) ``request.block_hashes``. A block whose hash is already mapped to another block
        (two requests computed the same content at once) is left unhashed: it stays private and
        is recycled as a plain block.
        """
        if num_full_blocks <= num_cached_blocks:
            return
        hashes = extend_block_hashes(request, block_size, num_full_blocks)
        cached = self.cached_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:  # a prefix hit: already mapped
                continue
            block_hash = hashes[i]
            if block_hash in cached:
                continue
            block.block_hash = block_hash
            cached[block_hash] = block
            self.num_cached_total += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Enter one held, unhashed block whose contents are final (restored from the host
        tier) under ``block_hash``; a hash already mapped leaves it private."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            self.num_cached_total += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is held; returns success."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now: free ones, including evictable cached ones."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks held by some request, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block.block_hash, block.block_id)
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
