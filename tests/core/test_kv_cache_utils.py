"""KVCacheBlock, FreeKVCacheBlockQueue and block hashing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sched_fake_model import make_request

from jaxserve.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    extend_block_hashes,
    hash_block_tokens,
)


def _queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def _ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_queue_starts_in_order_and_pops_from_head() -> None:
    blocks, queue = _queue(5)
    assert _ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    assert queue.popleft() is blocks[0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    assert _ids(queue) == [3, 4] and queue.num_free_blocks == 2
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_queue_remove_from_middle_and_ends() -> None:
    blocks, queue = _queue(5)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert _ids(queue) == [1, 3] and len(queue) == 2
    with pytest.raises(ValueError):
        queue.remove(blocks[2])  # not in the queue any more


def test_queue_append_goes_to_tail_in_order() -> None:
    blocks, queue = _queue(4)
    taken = queue.popleft_n(4)
    assert len(queue) == 0 and _ids(queue) == []
    queue.append(taken[2])
    queue.append_n([taken[0], taken[3]])
    queue.append(taken[1])
    assert _ids(queue) == [2, 0, 3, 1] and len(queue) == 4
    assert queue.popleft() is blocks[2]


def test_queue_empty_raises() -> None:
    _, queue = _queue(2)
    with pytest.raises(ValueError, match="asked for 3 free blocks, only 2"):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.popleft_n(0) == []


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    h = hash_block_tokens(None, [1, 2, 3])
    assert h == hash_block_tokens(None, (1, 2, 3)) and len(h) == 32
    assert h != hash_block_tokens(None, [1, 2, 4])
    assert h != hash_block_tokens(b"x" * 32, [1, 2, 3])
    assert h != hash_block_tokens(None, [1, 2, 3], ("lora", 1))


def test_hashes_equal_across_processes() -> None:
    code = (
        "from jaxserve.core.kv_cache_utils import hash_block_tokens as h\n"
        "p = h(None, [5, 6, 7, 8])\n"
        "print(h(p, [9, 10, 11, 12], ('k', 3)).hex())\n"
    )
    parent = hash_block_tokens(None, [5, 6, 7, 8])
    expected = hash_block_tokens(parent, [9, 10, 11, 12], ("k", 3)).hex()
    for seed in ("0", "12345"):  # different str-hash salts must not matter
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.strip() == expected


def test_extend_block_hashes_only_full_blocks_and_incremental() -> None:
    req = make_request("r", list(range(10)))
    hashes = extend_block_hashes(req, 4, 99)  # clamped to the 2 full blocks
    assert len(hashes) == 2 and hashes is req.block_hashes
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    first = list(hashes)
    req.append_output_token_id(10)
    req.append_output_token_id(11)
    extend_block_hashes(req, 4, 99)
    assert req.block_hashes[:2] == first and len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])
