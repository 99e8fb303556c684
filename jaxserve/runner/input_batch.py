"""InputBatch: persistent host buffers, one row ("slot") per request the runner holds.

The buffers are sized once (max_num_seqs x max_model_len tokens, max_num_seqs x
max_blocks_per_seq block ids) and updated incrementally from each SchedulerOutput: a new request
writes its row once, a running request appends its new block ids and its sampled token. Nothing
is rebuilt per step; prepare() gathers the rows of this step's batch with vectorised numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxserve.runner.spec_rows import logits_rows
from jaxserve.runner.token_feed import empty_feed_arrays, feed_arrays


@dataclass
class PreparedBatch:
    """Host arrays of one step, padded to the step's buckets (T, R, B).

    slots: i32[num_reqs] batch row -> slot (real rows only).
    input_ids / positions / slot_mapping: i32[T]; padding tokens: id 0, position 0, slot 0
        (the null block, which nothing reads).
    block_tables: i32[R, B]; kv_lens: i32[R]; cu_q_lens: i32[R + 1]; num_seqs: i32[1].
    logits_indices: i32[R] the token rows whose logits are sampled: the last token row of
        each request, preceded, for a request verifying k speculative drafts, by the k rows
        before it (its last known token and its first k - 1 drafts); padding rows: 0.
    draft_ids: i32[R] per logits row, the draft it verifies (the input token of the next token
        row), -1 where none: a request's last logits row, padding (rejection_sampler.py).
    sampling_rows: bool[num_reqs] rows whose scheduled tokens reach the end of the known tokens
        (they sample); a mid-prefill chunk does not.
    num_drafts: i32[num_reqs] drafts each request verifies (its logits rows are 1 + that).
    from_slot: i32[T] the slot whose sample in flight is a token row's input, -1: none; and
    sample_slot: i32[R] the slot a logits row's sample is recorded in (token_feed.py).
    """

    req_ids: list[str]
    slots: np.ndarray
    num_scheduled: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray
    draft_ids: np.ndarray
    sampling_rows: np.ndarray
    num_drafts: np.ndarray
    from_slot: np.ndarray
    sample_slot: np.ndarray

    @classmethod
    def padding(cls, padded_tokens: int, padded_rows: int, width: int) -> PreparedBatch:
        """An all-padding batch of the given buckets (no real request): for warm-up."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        from_slot, sample_slot = empty_feed_arrays(padded_tokens, padded_rows)
        return cls(
            req_ids=[],
            slots=zeros(0),
            num_scheduled=zeros(0),
            input_ids=zeros(padded_tokens),
            positions=zeros(padded_tokens),
            slot_mapping=zeros(padded_tokens),
            block_tables=zeros(padded_rows, width),
            kv_lens=zeros(padded_rows),
            cu_q_lens=zeros(padded_rows + 1),
            num_seqs=zeros(1),
            logits_indices=zeros(padded_rows),
            draft_ids=np.full(padded_rows, -1, np.int32),
            sampling_rows=np.zeros(0, bool),
            num_drafts=zeros(0),
            from_slot=from_slot,
            sample_slot=sample_slot,
        )

    @classmethod
    def null_block(
        cls, padded_tokens: int, padded_rows: int, width: int, block_size: int
    ) -> PreparedBatch:
        """A batch of the given buckets whose rows attend as real ones do, reading and writing
        the null block only (every block-table entry 0): for warm-up's first runs, which an
        all-padding batch (no row, so no attention work) does not fully pay.

        The first rows decode one token each over a context of two pages (one when the width
        is one page), the next is a prefill chunk of the remaining tokens after a page of
        context (as a chunked prefill or a prefix-cache hit continues), within the width's
        capacity (tokens past it stay padding). R - 1 decodes when T > R; else (R = T) T // 2
        of them, so that the chunk has several tokens too, and the last rows are padding.
        """
        t, r, capacity = padded_tokens, padded_rows, width * block_size
        decodes = r - 1 if t > r else t // 2
        q_lens = np.zeros(r, np.int32)
        q_lens[:decodes] = 1
        q_lens[decodes] = min(t - decodes, max(capacity - 1, 1))  # room for some context
        kv_lens = np.zeros(r, np.int32)
        kv_lens[:decodes] = min(block_size + 1, capacity)
        kv_lens[decodes] = min(q_lens[decodes] + block_size, capacity)
        cu_q_lens = np.zeros(r + 1, np.int32)
        cu_q_lens[1:] = np.cumsum(q_lens)
        positions = np.zeros(t, np.int32)
        positions[:decodes] = kv_lens[:decodes] - 1
        chunk = kv_lens[decodes] - q_lens[decodes]
        positions[decodes : cu_q_lens[-1]] = np.arange(chunk, kv_lens[decodes])
        logits_indices = np.where(q_lens > 0, cu_q_lens[1:] - 1, 0).astype(np.int32)
        return replace(
            cls.padding(t, r, width),
            positions=positions,
            slot_mapping=positions % block_size,  # block 0: the null block
            kv_lens=kv_lens,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([decodes + 1], np.int32),
            logits_indices=logits_indices,
        )


class InputBatch:
    """Per-slot token ids, block tables and counters of the requests the runner holds."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # [slots, tokens]: one past max_model_len, because a prompt of exactly max_model_len
        # tokens still samples one token (which is never computed, so needs no KV slot).
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)  # valid entries of block_table
        self.num_tokens = np.zeros(max_num_seqs, np.int32)  # prompt + outputs known so far
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed = np.zeros(max_num_seqs, np.int32)  # tokens whose KV is in the cache
        # Samples of dispatched steps not collected yet (async scheduling): they follow the
        # known tokens, their ids on the device only (token_feed.py).
        self.num_pending = np.zeros(max_num_seqs, np.int32)
        self.slot_of: dict[str, int] = {}
        # Lowest slots first, so a small batch stays in a compact range of rows.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot_of)

    # ---- incremental updates -------------------------------------------------------------
    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        block_ids: list[int],
        num_computed_tokens: int,
    ) -> int:
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id!r} is already in the batch")
        slot = self._free_slots.pop()
        n = len(token_ids)
        self.token_ids[slot, :n] = token_ids
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = num_prompt_tokens
        self.num_computed[slot] = num_computed_tokens
        self.num_pending[slot] = 0
        self.block_table[slot, : len(block_ids)] = block_ids
        self.num_blocks[slot] = len(block_ids)
        self.slot_of[req_id] = slot
        return slot

    def remove(self, req_id: str) -> int | None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.num_blocks[slot] = 0
            self.num_pending[slot] = 0
            self._free_slots.append(slot)
        return slot

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    def append_tokens(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each given slot (vectorised): a sample in flight
        becomes known."""
        self.token_ids[slots, self.num_tokens[slots]] = token_ids
        self.num_tokens[slots] += 1
        self.num_pending[slots] -= 1

    def append_token_runs(self, slots: np.ndarray, counts: np.ndarray, token_ids: np.ndarray):
        """Append counts[i] tokens to slots[i], the runs back to back in ``token_ids``
        (speculative steps emit several tokens per request)."""
        offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(slots, counts)
        self.token_ids[rows, self.num_tokens[rows] + offsets] = token_ids
        self.num_tokens[slots] += counts
        self.num_pending[slots] -= 1

    def set_drafts(self, req_id: str, draft_ids: list[int]) -> None:
        """Write a request's speculative drafts after its known tokens (not counted among
        them): the step reads them as the input tokens of its draft positions."""
        slot = self.slot_of[req_id]
        start = self.num_tokens[slot]
        self.token_ids[slot, start : start + len(draft_ids)] = draft_ids

    def update_cached(
        self, req_id: str, num_computed_tokens: int, new_block_ids: list[int]
    ) -> None:
        """A running request scheduled again: its computed count and any new blocks."""
        slot = self.slot_of[req_id]
        self.num_computed[slot] = num_computed_tokens
        if new_block_ids:
            self.append_blocks(slot, new_block_ids)

    # ---- per-step gather -----------------------------------------------------------------
    def _token_rows(
        self, slots: np.ndarray, num_scheduled: np.ndarray, cu: np.ndarray, total: int,
        padded_tokens: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """Per token row of the step (padded to ``padded_tokens``): its input id, position
        and KV slot; and the ``total`` real rows' positions."""
        num_reqs = len(slots)
        row_of_token = np.repeat(np.arange(num_reqs, dtype=np.int32), num_scheduled)  # [total]
        computed = self.num_computed[slots]
        pos_real = computed[row_of_token] + (np.arange(total, dtype=np.int32) - cu[row_of_token])
        slot_rows = slots[row_of_token]
        P = self.block_size
        input_ids = np.zeros(padded_tokens, np.int32)
        positions = np.zeros(padded_tokens, np.int32)
        slot_mapping = np.zeros(padded_tokens, np.int32)
        input_ids[:total] = self.token_ids[slot_rows, pos_real]
        positions[:total] = pos_real
        slot_mapping[:total] = self.block_table[slot_rows, pos_real // P] * P + pos_real % P
        return input_ids, positions, slot_mapping, pos_real

    def prepare(
        self,
        req_ids: list[str],
        num_scheduled: np.ndarray,
        padded_tokens: int,
        padded_rows: int,
        padded_width_fn,
        num_drafts: np.ndarray | None = None,
    ) -> PreparedBatch:
        """Gather this step's rows into padded arrays (see PreparedBatch); ``num_drafts``:
        i32[num_reqs] speculative drafts per request (written by set_drafts), None: none."""
        num_reqs = len(req_ids)
        slot_of = self.slot_of
        slots = np.fromiter((slot_of[r] for r in req_ids), np.int32, num_reqs)
        total = int(num_scheduled.sum())
        cu = np.zeros(padded_rows + 1, np.int32)
        np.cumsum(num_scheduled, out=cu[1 : num_reqs + 1])
        cu[num_reqs + 1 :] = total

        seq_lens_real = self.num_computed[slots] + num_scheduled
        input_ids, positions, slot_mapping, pos_real = self._token_rows(
            slots, num_scheduled, cu, total, padded_tokens
        )
        P = self.block_size
        width = padded_width_fn(int(-(-seq_lens_real.max() // P)))
        block_tables = np.zeros((padded_rows, width), np.int32)
        block_tables[:num_reqs] = self.block_table[slots, :width]
        kv_lens = np.zeros(padded_rows, np.int32)
        kv_lens[:num_reqs] = seq_lens_real
        if num_drafts is None:
            num_drafts = np.zeros(num_reqs, np.int32)
        logits_indices, draft_ids = logits_rows(cu[1 : num_reqs + 1], num_drafts, input_ids,
                                                padded_rows)  # fmt: skip
        num_known, num_pending = self.num_tokens[slots], self.num_pending[slots]
        sampling_rows = seq_lens_real >= num_known + num_pending
        from_slot, sample_slot = feed_arrays(
            slots, num_scheduled, pos_real, num_known, num_pending, sampling_rows,
            np.cumsum(num_drafts + 1) - 1, padded_tokens, padded_rows,
        )  # fmt: skip
        return PreparedBatch(
            req_ids=req_ids,
            slots=slots,
            num_scheduled=num_scheduled,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            kv_lens=kv_lens,
            cu_q_lens=cu,
            num_seqs=np.array([num_reqs], np.int32),
            logits_indices=logits_indices,
            draft_ids=draft_ids,
            sampling_rows=sampling_rows,
            num_drafts=num_drafts,
            from_slot=from_slot,
            sample_slot=sample_slot,
        )
