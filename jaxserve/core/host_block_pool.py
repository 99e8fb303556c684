"""HostBlockPool: the bookkeeping of the host-memory KV tier (pure Python, no jax).

The runner holds ``num_blocks`` host slots, each the size of one device KV block across all
layers (runner/kv_offload.py). This class decides what each slot holds and queues the copies
that the runner performs at the start of the next step; it never touches KV data itself.

Life of a slot:

    free --offload (a device eviction) / write (a swap-out)--> cached (hashed, in the LRU)
                                                            or private (unhashed, pinned)
    cached --pin (a swap-out holds it)--> pinned --unpin (last holder)--> cached (MRU end)
    private, pinned --unpin--> free
    cached --taken for another block (LRU head)--> that block's slot

Invariants (tests/core/sched_fake_model.py: check_host_invariants, after every step of the
scheduler property test): every slot is in exactly one of ``free``, ``lru`` (hashed and
unpinned) and pinned (``pins > 0``); ``hash_to_slot`` maps each hashed slot's hash to it and
nothing else; no copy is pending between steps. Within a step, a slot that a copy writes or
reads is ``locked``: it is not taken for other contents until the step's copies are handed over,
so a slot is written at most once per step, and never after a read of it. The runner performs
all of a step's device->host copies before its host->device copies (a slot written and read in
one step is read with its new contents), and both before the forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from jaxserve.core.kv_cache_utils import BlockHash


@dataclass(frozen=True)
class HostTier:
    """What the engine knows about the runner's host KV tier.

    num_blocks: host slots (0: no host tier).
    block_bytes: bytes of one block across all layers, K and V (what one copy moves).
    swap_bytes_per_s: device <-> host bandwidth measured by the runner (0: not measured);
        the "auto" preemption mode compares it with the prefill rate.
    swap_latency_s: the fixed seconds of one transfer (measured with the bandwidth).
    """

    num_blocks: int
    block_bytes: int
    swap_bytes_per_s: float = 0.0
    swap_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_bytes < 1:
            raise ValueError(
                f"HostTier needs num_blocks >= 0 and block_bytes >= 1, got {self.num_blocks} "
                f"and {self.block_bytes}"
            )


class HostBlockPool:
    """Slots of the host KV tier: an LRU prefix cache keyed by block hash, plus slots pinned
    by swapped-out requests.

    Args:
        num_blocks: host slots, >= 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"HostBlockPool.num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slot_hash: list[BlockHash | None] = [None] * num_blocks  # hash held, if any
        self.pins = [0] * num_blocks  # swapped-out requests holding the slot
        self.hash_to_slot: dict[BlockHash, int] = {}  # every hashed slot, pinned or not
        # Hashed, unpinned slots, least recently used first: taken from the front.
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end
        # Slots written or read by a copy of the step being scheduled; cleared by take_copies.
        self.locked: set[int] = set()
        self._deferred_free: list[int] = []  # freed while locked: free after take_copies
        # The step's copies, in the order they were decided.
        self.device_to_host: list[tuple[int, int]] = []  # (device block id, slot)
        self.host_to_device: list[tuple[int, int]] = []  # (slot, device block id)
        # Counters, monotonic.
        self.num_offloaded = 0  # device->host copies queued
        self.num_restored = 0  # host->device copies queued
        self.num_dropped = 0  # evicted device blocks not offloaded: no slot could be taken

    # ---- lookups ------------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.hash_to_slot.get(block_hash)

    def num_takeable(self) -> int:
        """Slots that ``take_slot`` can hand out now: free or evictable, and not locked."""
        # A free slot is never locked (one freed while locked waits in _deferred_free).
        return len(self.free) + len(self.lru) - sum(1 for s in self.locked if s in self.lru)

    # ---- writes -------------------------------------------------------------------------------
    def offload(self, block_hash: BlockHash, block_id: int) -> None:
        """A cached device block is being evicted: keep its contents under its hash.

        Already here: the slot becomes the most recently used, nothing is copied. Else a slot
        is taken and a device->host copy queued; with no slot to take, the block is dropped.
        """
        slot = self.hash_to_slot.get(block_hash)
        if slot is not None:
            if slot in self.lru:
                self.lru.move_to_end(slot)
            return
        slot = self.take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._write(block_id, slot, block_hash)
        self.lru[slot] = None

    def write_pinned(self, block_id: int, block_hash: BlockHash | None) -> int:
        """Copy a device block of a request being swapped out into a new slot, pinned once.

        A hashed block also enters the cache map (the caller checked that its hash is not
        here). The caller checked ``num_takeable()``; raises ValueError if no slot is left.
        """
        slot = self.take_slot()
        if slot is None:
            raise ValueError("no host KV slot left to swap into")
        self._write(block_id, slot, block_hash)
        self.pins[slot] = 1
        return slot

    def take_slot(self) -> int | None:
        """A slot for new contents, locked for this step: a free one, else the least recently
        used cached one (its hash is dropped), never one a copy of this step uses. None if
        there is none."""
        if self.free:
            return self.free.pop()
        for slot in self.lru:
            if slot not in self.locked:
                del self.lru[slot]
                del self.hash_to_slot[self.slot_hash[slot]]
                self.slot_hash[slot] = None
                return slot
        return None

    def _write(self, block_id: int, slot: int, block_hash: BlockHash | None) -> None:
        self.locked.add(slot)
        self.device_to_host.append((block_id, slot))
        self.num_offloaded += 1
        if block_hash is not None:
            self.slot_hash[slot] = block_hash
            self.hash_to_slot[block_hash] = slot

    # ---- reads and pins -----------------------------------------------------------------------
    def lock(self, slots: Iterable[int]) -> None:
        """Keep these slots from being taken in this step (a restore will read them)."""
        self.locked.update(slots)

    def restore(self, slot: int, block_id: int) -> None:
        """Queue the copy of ``slot`` into device block ``block_id``; the slot stays (an
        inclusive cache), locked for this step and the most recently used."""
        self.locked.add(slot)
        self.host_to_device.append((slot, block_id))
        self.num_restored += 1
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        """One more swapped-out request holds the slot: it cannot be taken until unpinned."""
        if self.pins[slot] == 0:
            if self.slot_hash[slot] is None:
                raise ValueError(f"host slot {slot} is free; only a written slot can be pinned")
            del self.lru[slot]
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """Drop one holder; the last one makes a hashed slot cached (most recently used) and
        frees a private one (after this step's copies if one uses it)."""
        if self.pins[slot] < 1:
            raise ValueError(f"host slot {slot} is not pinned")
        self.pins[slot] -= 1
        if self.pins[slot]:
            return
        if self.slot_hash[slot] is not None:
            self.lru[slot] = None
        elif slot in self.locked:
            self._deferred_free.append(slot)
        else:
            self.free.append(slot)

    # ---- per step -----------------------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Hand over the step's (device->host, host->device) copies and unlock every slot."""
        d2h, h2d = self.device_to_host, self.host_to_device
        self.device_to_host, self.host_to_device = [], []
        self.locked.clear()
        self.free.extend(self._deferred_free)
        self._deferred_free.clear()
        return d2h, h2d

    def reset(self) -> None:
        """Forget every slot and queued copy (after a failed step, when queued copies may not
        have run). Counters survive."""
        num = self.num_blocks
        self.slot_hash = [None] * num
        self.pins = [0] * num
        self.hash_to_slot.clear()
        self.lru.clear()
        self.free = list(range(num - 1, -1, -1))
        self.locked.clear()
        self._deferred_free.clear()
        self.device_to_host, self.host_to_device = [], []
