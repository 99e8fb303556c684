"""KVSwap: the requests swapped out to the host KV tier and the host slots that hold their KV.

Swap preemption keeps a preempted request's computed tokens: its blocks, full and partial, are
copied into host slots that stay pinned while it waits, and come back into device blocks when
it resumes. A full block whose hash the host already holds is only pinned, not copied; on the
way back, a full block whose hash is still cached on the device is shared again, not copied.
The copies are queued in the HostBlockPool and run at the start of the next step
(runner/kv_offload.py): a swapped-out block is read before anything reuses it.

Invariant (tests/core/sched_fake_model.py: check_host_invariants): a host slot's pin count is
the number of swapped-out requests whose slot list holds it.
"""

from __future__ import annotations

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.kv_cache_utils import KVCacheBlock


class KVSwap:
    """Swapped-out requests of one device pool and one host tier.

    Args:
        block_pool: the device pool (blocks come back into it).
        host_pool: the host tier's slots.
        enable_caching: prefix caching on: full blocks still cached on the device are shared
            again on swap-in instead of copied.
    """

    def __init__(self, block_pool: BlockPool, host_pool: HostBlockPool, enable_caching: bool):
        self.block_pool = block_pool
        self.host_pool = host_pool
        self.enable_caching = enable_caching
        # req_id -> the pinned host slots of its blocks, in logical order; set by swap_out,
        # dropped by swap_in or release.
        self.swapped: dict[str, list[int]] = {}

    def is_swapped(self, req_id: str) -> bool:
        return req_id in self.swapped

    def num_blocks_to_copy(self, blocks: list[KVCacheBlock]) -> int:
        """Block copies that swapping these blocks out and back in would take: the ones not
        on the host yet, down, and all of them back up."""
        host = self.host_pool
        missing = sum(
            1 for b in blocks if b.block_hash is None or host.lookup(b.block_hash) is None
        )
        return missing + len(blocks)

    def swap_out(self, req_id: str, blocks: list[KVCacheBlock]) -> bool:
        """Pin host slots holding ``blocks`` (the request's computed blocks) for ``req_id``,
        queueing a copy for each block the host does not hold yet. The device blocks are the
        caller's to free. Returns False, changing nothing, when the host cannot take them."""
        host = self.host_pool
        if not blocks:
            return False
        present = [None if b.block_hash is None else host.lookup(b.block_hash) for b in blocks]
        for slot in present:  # pinned first, so taking slots for the others cannot evict them
            if slot is not None:
                host.pin(slot)
        if sum(1 for s in present if s is None) > host.num_takeable():
            for slot in present:
                if slot is not None:
                    host.unpin(slot)
            return False
        self.swapped[req_id] = [
            s if s is not None else host.write_pinned(b.block_id, b.block_hash)
            for b, s in zip(blocks, present, strict=True)
        ]
        return True

    def swap_in(self, req_id: str, num_blocks: int) -> list[KVCacheBlock] | None:
        """A block table of ``num_blocks`` (>= the swapped blocks) for ``req_id``: its blocks
        restored from the host (or shared again), then fresh ones. Returns None, changing
        nothing, when the device pool is short."""
        slots = self.swapped[req_id]
        host, pool = self.host_pool, self.block_pool
        reused: list[KVCacheBlock | None] = [None] * len(slots)
        if self.enable_caching:
            for i, slot in enumerate(slots):
                block_hash = host.slot_hash[slot]
                if block_hash is not None:
                    reused[i] = pool.cached_blocks.get(block_hash)
        num_reused = sum(1 for b in reused if b is not None)
        num_free = pool.get_num_free_blocks()
        num_free -= sum(1 for b in reused if b is not None and b.ref_cnt == 0)
        if num_blocks - num_reused > num_free:
            return None
        pool.touch(b for b in reused if b is not None)  # before taking: not evicted by it
        fresh = iter(pool.get_new_blocks(num_blocks - num_reused))
        table: list[KVCacheBlock] = []
        for slot, block in zip(slots, reused, strict=True):
            if block is None:
                block = next(fresh)
                host.restore(slot, block.block_id)
            host.unpin(slot)  # a restored slot stays locked (unusable) until the step's copies
            table.append(block)
        table.extend(fresh)
        del self.swapped[req_id]
        return table

    def release(self, req_id: str) -> None:
        """Unpin a swapped-out request's slots (it finished or was aborted). Idempotent."""
        for slot in self.swapped.pop(req_id, ()):
            self.host_pool.unpin(slot)

    def clear(self) -> None:
        """Forget every swapped-out request (the host tier is being reset)."""
        self.swapped.clear()
