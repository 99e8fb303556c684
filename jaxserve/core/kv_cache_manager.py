"""KVCacheManager: per-request block tables on top of the BlockPool.

The scheduler asks three things of it: how much of a request is already in the prefix cache
(``get_computed_blocks``), to make room for the tokens it is about to schedule
(``allocate_slots``, which may say no), and to let a request go (``free``). It also registers
full blocks in the prefix cache as computation advances (``cache_blocks``).

Writes and sharing: a request writes KV only at positions >= its ``num_computed_tokens``. Prefix
hits share full blocks, which lie wholly before that point, so they are never written. A fork
(parallel sampling) shares a partially filled block as well; the first request that is about to
write into a block with ``ref_cnt > 1`` gets a fresh copy instead (copy-on-write): the pair
(src, dst) is queued in ``pending_block_copies`` for the runner to copy before the forward.

Host tier (optional, host_block_pool.py): a cached block evicted from the device pool is
offloaded to a host slot under its hash, and a lookup that misses on the device but hits on the
host takes a fresh device block and queues a host->device copy (``HostHit``). Swap preemption
(``swap_out`` / ``swap_in``, kv_swap.py) pins a request's blocks, full and partial, in host
slots while it waits and copies them back into new device blocks when it resumes, its computed
tokens kept.

KV connector (optional, core/kv_connector/): a lookup that misses on both tiers goes on in the
connector's store; each block found there takes a fresh device block that receives its KV
(``RemoteHit``, core/kv_connector/remote_hits.py), before the step's forward or, loaded
asynchronously, in a later step (``finish_remote_load``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    extend_block_hashes,
    shared_write_indices,
)
from jaxserve.core.kv_connector.remote_hits import RemoteBlocks, RemoteHit
from jaxserve.core.kv_swap import KVSwap

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.core.kv_connector.base import KVConnector
    from jaxserve.request import Request


@dataclass(frozen=True)
class HostHit:
    """A prefix-cache hit on the host tier: the block's contents are in host ``slot``."""

    slot: int
    block_hash: BlockHash


class KVCacheManager:
    """Block tables of all requests that hold KV blocks.

    Args:
        block_size: tokens per block (P).
        num_blocks: pool size including the null block 0.
        enable_caching: prefix caching on or off.
        max_model_len: longest sequence in tokens; a block table never exceeds
            ceil(max_model_len / block_size) entries.
        host_pool: the host tier's slots, or None (no host tier). Evicted blocks are offloaded
            to it only with prefix caching on; swapping works either way.
        connector: the KV connector's scheduler half (looked up with prefix caching on), or
            None.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool,
        max_model_len: int,
        host_pool: HostBlockPool | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.host_pool = host_pool
        # The prefix cache's host half: only with caching (a hit needs the hashes).
        self.host_cache = host_pool if enable_caching else None
        on_evict = self.host_cache.offload if self.host_cache is not None else None
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict)
        # The KV connector's store, looked up past both tiers (with prefix caching only).
        self.remote = RemoteBlocks(connector if enable_caching else None, self.block_pool)
        # req_id -> block table in logical order; entries are added by allocate_slots (and
        # replaced by copy-on-write), dropped by free.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks of its table are already in the prefix-cache map (or
        # were considered for it); only grows while the request holds blocks.
        self.num_cached_blocks: dict[str, int] = {}
        # (src, dst) block ids queued by copy-on-write since the scheduler last drained them.
        self.pending_block_copies: list[tuple[int, int]] = []
        # Swapped-out requests and their pinned host slots; None without a host tier.
        self.swap = KVSwap(self.block_pool, host_pool, enable_caching) if host_pool else None
        # Counters in tokens (prefix cache) and blocks (copies); monotonic.
        self.prefix_cache_queries = 0  # tokens looked up by get_computed_blocks
        self.prefix_cache_hits = 0  # of those, tokens found in the cache (either tier)
        self.host_cache_hits = 0  # of those, tokens found on the host tier only
        self.num_cow_copies = 0

    @property
    def usage(self) -> float:
        """Share of usable blocks held by some request, in [0, 1]."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock | HostHit], int]:
        """Longest run of cached full blocks at the start of the request's tokens, each found
        on the device or, failing that, on the host tier (a HostHit).

        At least one token is always left to compute, so that a full hit still yields logits:
        only the first ``(num_tokens - 1) // block_size`` blocks are candidates. Counts
        ``num_tokens`` queries and the hit tokens. Changes no ref count or slot
        (``allocate_slots`` takes the references and queues the restores).

        Returns:
            (blocks, num_computed_tokens) with num_computed_tokens = len(blocks) * block_size.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, which a hit would skip
            # (vLLM makes the same exception). The request's own blocks are still cached.
            return [], 0
        num_tokens = len(request.all_token_ids)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(request, self.block_size, max_hit_blocks)
        cached = self.block_pool.cached_blocks
        host = self.host_cache
        hits: list[KVCacheBlock | HostHit] = []
        num_host_hits = 0
        for i in range(max_hit_blocks):
            block = cached.get(hashes[i])
            if block is not None:
                hits.append(block)
                continue
            slot = host.lookup(hashes[i]) if host is not None else None
            if slot is None:
                hits.extend(self.remote.lookup(hashes[i:max_hit_blocks], request, i))
                break
            hits.append(HostHit(slot, hashes[i]))
            num_host_hits += 1
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        self.host_cache_hits += num_host_hits * self.block_size
        return hits, num_hit_tokens

    def retract_lookup(
        self, request: Request, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        """Undo the counters of a ``get_computed_blocks`` whose request was not admitted, so a
        request retried over several steps counts once."""
        if self.enable_caching:
            self.prefix_cache_queries -= len(request.all_token_ids)
            self.prefix_cache_hits -= num_hit_tokens
            self.host_cache_hits -= num_host_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock | HostHit] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make the request's block table cover the tokens it is about to compute.

        Args:
            request: its ``num_computed_tokens`` tokens already have KV in its table.
            num_new_tokens: tokens to compute this step (>= 1).
            new_computed_blocks: blocks whose KV the request takes over without computing it
                (prefix hits or a parent's blocks), appended to its table; ``None`` if none.
                A HostHit takes a fresh block, restored from the host before the forward.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``.

        Returns:
            The blocks newly taken from the free queue and appended to the table (empty when
            none were needed), or None when the pool cannot serve: then nothing changed.
        """
        bs = self.block_size
        req_id = request.request_id
        table = self.req_to_blocks.get(req_id)
        if not new_computed_blocks and self._writes_own_last_block(table, request, num_new_tokens):
            return []  # the fast path of nearly every decode step
        num_held = len(table) if table is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_end = num_computed + num_new_tokens
        num_borrowed = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = -(-num_end // bs) - num_held - num_borrowed
        cow_indices = shared_write_indices(
            table, new_computed_blocks, num_computed // bs, num_end, bs
        )
        num_host = sum(1 for b in new_computed_blocks or () if isinstance(b, (HostHit, RemoteHit)))
        num_needed = max(num_new_blocks, 0) + len(cow_indices) + num_host
        # Borrowed blocks that sit free in the queue stop being allocatable once touched.
        num_free = self.block_pool.get_num_free_blocks()
        if num_borrowed:
            num_free -= sum(
                1 for b in new_computed_blocks if isinstance(b, KVCacheBlock) and b.ref_cnt == 0
            )
        if num_needed > num_free:
            return None
        if table is None:
            table = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = num_new_computed_tokens // bs
        if num_host:
            table.extend(self._take_with_restores(new_computed_blocks, num_host, req_id))
        elif num_borrowed:
            self.block_pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
        for i in cow_indices:
            self._copy_on_write(table, i)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table.extend(new_blocks)
        return new_blocks

    def _writes_own_last_block(
        self, table: list[KVCacheBlock] | None, request: Request, num_new_tokens: int
    ) -> bool:
        """Whether all ``num_new_tokens`` land in one block the table already has and that no
        one else holds (then allocate_slots has nothing to do)."""
        if table is None:
            return False
        num_computed = request.num_computed_tokens
        first_write = num_computed // self.block_size
        return (
            num_computed + num_new_tokens <= (first_write + 1) * self.block_size
            and first_write < len(table)
            and table[first_write].ref_cnt == 1
        )

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's newly full, computed blocks into the prefix cache.

        Call after ``num_computed_tokens`` advanced; only blocks wholly below it are hashed.
        A no-op when prefix caching is off.
        """
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                request, self.req_to_blocks[req_id], num_cached, num_full, self.block_size
            )
            self.num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (evicted first), and the host
        slots it holds while swapped out. Idempotent."""
        self._free_table(request.request_id)
        self.remote.drop(request.request_id)
        if self.swap is not None:
            self.swap.release(request.request_id)

    def finish_remote_load(self, request: Request, num_loaded: int) -> int:
        """The request's asynchronous load (RemoteBlocks) wrote its first ``num_loaded``
        blocks: they enter the prefix cache, the rest are freed. Returns the tokens its table
        now holds (all computed)."""
        req_id = request.request_id
        table = self.req_to_blocks[req_id]
        self.remote.finish(req_id, table, num_loaded)
        self.num_cached_blocks[req_id] = len(table)
        return len(table) * self.block_size

    def _free_table(self, req_id: str) -> None:
        table = self.req_to_blocks.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if table is not None:
            self.block_pool.free_blocks(reversed(table))

    # ---- host tier ----------------------------------------------------------------------------
    def _take_with_restores(
        self, borrowed: list[KVCacheBlock | HostHit | RemoteHit], num_host: int, req_id: str
    ) -> list[KVCacheBlock]:
        """The borrowed blocks as device blocks: device hits touched, each HostHit restored
        into a fresh block that enters the prefix cache under its hash, each RemoteHit a fresh
        block that receives its KV (RemoteBlocks.take). The hit slots are locked before any
        block is taken, so the offloads those evictions cause cannot take them."""
        host = self.host_cache
        if host is not None:
            host.lock(b.slot for b in borrowed if isinstance(b, HostHit))
        self.block_pool.touch(b for b in borrowed if isinstance(b, KVCacheBlock))
        fresh = iter(self.block_pool.get_new_blocks(num_host))
        out: list[KVCacheBlock] = []
        for b in borrowed:
            if isinstance(b, (HostHit, RemoteHit)):
                block = next(fresh)
                if isinstance(b, HostHit):
                    host.restore(b.slot, block.block_id)
                    self.block_pool.cache_block(block, b.block_hash)
                else:
                    self.remote.take(b, block, req_id)
                b = block
            out.append(b)
        return out

    def is_swapped(self, req_id: str) -> bool:
        return self.swap is not None and self.swap.is_swapped(req_id)

    def swap_blocks(self, request: Request) -> int:
        """Block copies that swapping the (running) request out and back in would take."""
        return self.swap.num_blocks_to_copy(self._computed_blocks(request))

    def recompute_tokens(self, request: Request) -> int:
        """Tokens a recompute preemption of the (running) request would compute again: all of
        its computed tokens, less, with prefix caching, those of its leading hashed blocks
        (prefix hits when it comes back, from the device or the host tier)."""
        num = request.num_computed_tokens
        if self.enable_caching:
            for block in self._computed_blocks(request):
                if block.block_hash is None:
                    break
                num -= self.block_size
        return num

    def swap_out(self, request: Request) -> bool:
        """Move a running request's computed blocks to pinned host slots and free its device
        blocks; its computed tokens stay valid. Returns False, changing nothing, when the
        host tier cannot take them."""
        if not self.swap.swap_out(request.request_id, self._computed_blocks(request)):
            return False
        self._free_table(request.request_id)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give a swapped-out request a block table again, covering its computed tokens and
        ``num_new_tokens`` more. Returns it, or None (nothing changed) when the device pool is
        short."""
        num_blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        table = self.swap.swap_in(request.request_id, num_blocks)
        if table is None:
            return None
        self.req_to_blocks[request.request_id] = table
        self.num_cached_blocks[request.request_id] = 0
        self.cache_blocks(request)  # restored full blocks (a duplicate hash stays private)
        return table

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Hand over the step's (device->host, host->device) copies; ([], []) without a host
        tier."""
        if self.host_pool is None:
            return [], []
        return self.host_pool.take_copies()

    def _computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        table = self.req_to_blocks.get(request.request_id, [])
        return table[: -(-request.num_computed_tokens // self.block_size)]

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """The request's block table (the live list: do not mutate); empty if it holds none."""
        return self.req_to_blocks.get(req_id, [])

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Hand over the (src, dst) copies queued since the last call."""
        copies, self.pending_block_copies = self.pending_block_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def free_all(self) -> bool:
        """Release every block table and drop queued copies: the recovery of a step that
        failed part-way. Returns whether the pool then accounts for every block (all free, no
        reference left); False means a half-done update lost track of some, and the caller
        must rebuild the pool."""
        for table in self.req_to_blocks.values():
            self.block_pool.free_blocks(reversed(table))
        self.req_to_blocks.clear()
        self.num_cached_blocks.clear()
        self.pending_block_copies.clear()
        self.remote.clear()
        # Queued host copies may not have run: the host tier's contents are not trusted.
        if self.swap is not None:
            self.swap.clear()
            self.host_pool.reset()
        pool = self.block_pool
        return pool.get_num_free_blocks() == pool.num_usable_blocks and all(
            block.ref_cnt == 0 for block in pool.blocks[1:]
        )

    def _copy_on_write(self, table: list[KVCacheBlock], index: int) -> None:
        src = table[index]
        (dst,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks((src,))  # drops only this request's reference
        table[index] = dst
        self.pending_block_copies.append((src.block_id, dst.block_id))
        self.num_cow_copies += 1
