"""KV cache blocks, the free-block queue and block hashing (docs/architecture.md).

A KVCacheBlock is the host-side metadata of one physical block of ``block_size`` token slots in
the device's KV page arrays. Free blocks (``ref_cnt == 0``) sit in FreeKVCacheBlockQueue, an
intrusive doubly linked list threaded through the blocks themselves, so that taking a cached
block back out of the middle of the queue (a prefix hit) is O(1) with no search.

Block hashes identify a full block by its content and its whole prefix: ``hash(parent_hash,
token ids, extra_keys)``. They are SHA-256 digests of a canonical pickle, so the same tokens give
the same hash in every process (Python's ``hash`` is salted per process).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.request import Request

BlockHash = bytes  # 32-byte SHA-256 digest


class KVCacheBlock:
    """Metadata of one physical KV block.

    block_id: index into the device page arrays, 0..num_blocks-1 (0 is the null block).
    ref_cnt: number of requests whose block table holds this block; mutated by BlockPool only.
    block_hash: set while the block is in the prefix-cache map (it is full and its contents are
        final); cleared when the block is evicted. Mutated by BlockPool only.
    prev_free / next_free: links of the free queue; both None while the block is not in it.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked queue of free blocks, ordered by eviction priority (head = evicted first).

    Two sentinel nodes (head and tail) are never handed out, so every link operation is the same
    few pointer writes with no None checks. Blocks are allocated from the head and freed to the
    tail, which makes the queue an LRU list of cached-but-unused blocks. All operations are O(1)
    per block.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0  # blocks currently linked in; mutated by this class only
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block. Raises ValueError when the queue is empty."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV cache block left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first n blocks in order. Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        # Re-link the head sentinel to the first block left in the queue.
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue. Raises ValueError if it is not in it."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Link a block in at the tail (evicted last)."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Link blocks in at the tail, keeping their order (the first is evicted first)."""
        last = self._tail.prev_free
        count = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head to tail; O(num_free), for tests and debugging."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out

    def __len__(self) -> int:
        return self.num_free_blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Content hash of one full block, chained to the hash of the block before it.

    The payload is a protocol-5 pickle of ``(parent, tuple(ints), extra_keys)``: pickling ints,
    bytes, None and tuples of them is canonical, so the digest is the same in every process.
    ``extra_keys`` carries whatever else the KV depends on (e.g. a LoRA id); None for plain text.
    """
    payload = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def extend_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """Make ``request.block_hashes`` cover its first ``num_blocks`` blocks; returns that list.

    Only hashes blocks not hashed before, so a request's hashes cost O(1) per block over its
    life. ``num_blocks`` is clamped to the full blocks of ``request.all_token_ids``: a partial
    block is never hashed.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_blocks = min(num_blocks, len(tokens) // block_size)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def shared_write_indices(
    table: list[KVCacheBlock] | None,
    borrowed: list[KVCacheBlock] | None,
    first_write: int,
    num_end: int,
    block_size: int,
) -> list[int]:
    """Indices, in a block table extended by ``borrowed``, of the existing blocks that tokens
    [first_write * block_size, num_end) will write while they are shared (copy-on-write).

    A block counts as shared if another holder keeps it: ref_cnt > 1 for a block already in
    the table, ref_cnt >= 1 for a borrowed one (touching it adds the writer's reference).
    """
    current = table or []
    last_write = min(-(-num_end // block_size), len(current) + len(borrowed or ()))
    out = []
    for i in range(first_write, last_write):
        if i < len(current):
            shared = current[i].ref_cnt > 1
        else:
            shared = borrowed[i - len(current)].ref_cnt >= 1
        if shared:
            out.append(i)
    return out
