"""KVCacheManager: prefix lookup, allocation (all or nothing), sharing, freeing, copy-on-write."""

from __future__ import annotations

from sched_fake_model import make_request

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.request import Request


def _manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        block_size=4, num_blocks=num_blocks, enable_caching=caching, max_model_len=256
    )


def _compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """Allocate and 'compute' num_tokens more tokens of req, as the scheduler would."""
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens
    kv.cache_blocks(req)


def _snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {k: [b.block_id for b in v] for k, v in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
        dict(pool.cached_blocks),
    )


def test_allocate_grows_table_by_blocks() -> None:
    kv = _manager()
    req = make_request("a", list(range(10)))
    new = kv.allocate_slots(req, 10)
    assert [b.block_id for b in new] == [1, 2, 3] and kv.get_block_ids("a") == [1, 2, 3]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # positions 10, 11 fit in block 3
    req.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [4]


def test_get_computed_blocks_leaves_one_token_and_counts_tokens() -> None:
    kv = _manager()
    first = make_request("a", list(range(12)))  # exactly 3 full blocks
    _compute(kv, first, 12)
    assert len(kv.block_pool.cached_blocks) == 3
    same = make_request("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(same)
    # A full hit would leave nothing to compute: the last block is dropped.
    assert num_hit == 8 and blocks == kv.get_blocks("a")[:2]
    longer = make_request("c", list(range(13)))
    blocks, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 12 and blocks == kv.get_blocks("a")
    other = make_request("d", [99] + list(range(1, 12)))
    assert kv.get_computed_blocks(other) == ([], 0)
    assert kv.prefix_cache_queries == 12 + 13 + 12 and kv.prefix_cache_hits == 8 + 12
    kv.retract_lookup(longer, 12)
    assert kv.prefix_cache_queries == 12 + 12 and kv.prefix_cache_hits == 8


def test_shared_prefix_ref_counts_and_free() -> None:
    kv = _manager()
    a = make_request("a", list(range(10)))
    _compute(kv, a, 10)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and all(blk.ref_cnt == 1 for blk in hits)
    new = kv.allocate_slots(b, 3, hits, num_hit)
    assert len(new) == 1
    assert [blk.ref_cnt for blk in kv.get_blocks("b")] == [2, 2, 1]
    assert kv.get_blocks("b")[:2] == kv.get_blocks("a")[:2]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.get_blocks("b")] == [1, 1, 1]
    kv.free(b)
    kv.free(b)  # idempotent
    pool = kv.block_pool
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_partial_blocks_never_hashed() -> None:
    kv = _manager()
    req = make_request("a", list(range(6)))
    _compute(kv, req, 6)
    table = kv.get_blocks("a")
    assert table[0].block_hash is not None and table[1].block_hash is None
    req.append_output_token_id(6)
    req.append_output_token_id(7)  # tokens 6 and 7 exist, but only 6 is computed
    _compute(kv, req, 1)
    assert table[1].block_hash is None and len(req.block_hashes) == 1
    _compute(kv, req, 1)
    assert table[1].block_hash is not None and len(req.block_hashes) == 2


def test_allocate_slots_failure_has_no_side_effects() -> None:
    kv = _manager(num_blocks=6)  # 5 usable blocks
    a = make_request("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)  # 2 cached, evictable blocks
    b = make_request("b", list(range(8)) + list(range(100, 116)))  # 24 tokens: 6 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = _snapshot(kv)
    assert kv.allocate_slots(b, 16, hits, num_hit) is None
    assert kv.allocate_slots(b, 24) is None
    assert _snapshot(kv) == before
    c = make_request("c", list(range(4)))
    _compute(kv, c, 4)  # running request: growth beyond the pool fails cleanly too
    before = _snapshot(kv)
    assert kv.allocate_slots(c, 17) is None
    assert _snapshot(kv) == before


def test_touching_evictable_hits_counts_against_free_blocks() -> None:
    kv = _manager(num_blocks=4)  # 3 usable
    a = make_request("a", list(range(8)))
    _compute(kv, a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])  # 13 tokens: 2 hits + 2 new
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and kv.block_pool.get_num_free_blocks() == 3
    assert kv.allocate_slots(b, 5, hits, num_hit) is None  # 2 hits use 2 of the 3 free
    assert kv.allocate_slots(b, 4, hits, num_hit) is not None


def test_fork_shares_prompt_and_copies_the_written_block() -> None:
    kv = _manager()
    parent = make_request("p", list(range(6)))
    _compute(kv, parent, 6)
    child = make_request("c", list(range(6)))
    borrowed = kv.get_blocks("p")[:2]
    new = kv.allocate_slots(child, 1, borrowed, 5)  # recompute position 5: in block 1
    assert new == []
    ptable, ctable = kv.get_blocks("p"), kv.get_blocks("c")
    assert ctable[0] is ptable[0] and ptable[0].ref_cnt == 2  # full block: shared
    assert ctable[1] is not ptable[1] and ptable[1].ref_cnt == 1 and ctable[1].ref_cnt == 1
    assert kv.take_block_copies() == [(ptable[1].block_id, ctable[1].block_id)]
    assert kv.take_block_copies() == [] and kv.num_cow_copies == 1
    kv.free(parent)
    kv.free(child)
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks


def test_caching_disabled_never_hashes_or_hits() -> None:
    kv = _manager(caching=False)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert not kv.block_pool.cached_blocks and kv.prefix_cache_queries == 0
