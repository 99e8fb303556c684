"""BlockPool: null block, allocation, ref counts, LRU eviction order, prefix-cache map."""

from __future__ import annotations

import pytest
from sched_fake_model import make_request

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_utils import hash_block_tokens


def _free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_null_block_is_reserved() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4 and pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks) and pool.null_block.ref_cnt == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, enable_caching=True)


def test_free_and_touch_ref_counts() -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second holder
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert _free_ids(pool) == [3, 4, 5, 2]  # b went to the tail; a still held
    pool.touch([b])  # b leaves the free queue from the tail
    assert b.ref_cnt == 1 and _free_ids(pool) == [3, 4, 5]
    assert pool.get_usage() == pytest.approx(2 / 5)


def test_eviction_is_lru_and_chain_tail_first() -> None:
    pool = BlockPool(7, enable_caching=True)
    req = make_request("r", list(range(12)))
    blocks = pool.get_new_blocks(3)  # ids 1, 2, 3 hold the 3 full blocks of req
    pool.cache_full_blocks(req, blocks, 0, 3, 4)
    assert len(pool.cached_blocks) == 3
    pool.free_blocks(reversed(blocks))  # as a request does: tail of the chain first
    assert _free_ids(pool) == [4, 5, 6, 3, 2, 1]
    # Uncached blocks 4..6 go first, then the chain from its tail: 3, then 2.
    taken = pool.get_new_blocks(5)
    assert [b.block_id for b in taken] == [4, 5, 6, 3, 2]
    assert pool.num_evictions == 2
    assert taken[3].block_hash is None and taken[4].block_hash is None
    assert list(pool.cached_blocks.values()) == [blocks[0]]  # the chain's head survives


def test_cache_full_blocks_hashes_and_skips_duplicates() -> None:
    pool = BlockPool(8, enable_caching=True)
    req = make_request("r", list(range(9)))  # 2 full blocks of 4 and one partial
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 4)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert blocks[0].block_hash == h0 and pool.get_cached_block(h0) is blocks[0]
    assert blocks[1].block_hash == hash_block_tokens(h0, [4, 5, 6, 7])
    assert blocks[2].block_hash is None  # partial: never hashed
    assert len(req.block_hashes) == 2
    # Same content computed by another request at the same time: stays private.
    twin = make_request("t", list(range(9)))
    twin_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(twin, twin_blocks, 0, 2, 4)
    assert all(b.block_hash is None for b in twin_blocks)
    assert pool.get_cached_block(h0) is blocks[0] and len(pool.cached_blocks) == 2


def test_evicted_block_keeps_no_stale_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    req = make_request("r", [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [block], 0, 1, 4)
    pool.free_blocks([block])
    h = block.block_hash
    assert pool.get_cached_block(h) is block and pool.get_num_free_blocks() == 1
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None and pool.get_cached_block(h) is None


def test_reset_prefix_cache_only_when_nothing_held() -> None:
    pool = BlockPool(4, enable_caching=True)
    req = make_request("r", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, 4)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert not pool.cached_blocks and blocks[0].block_hash is None
