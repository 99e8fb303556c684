"""The body of the TPU kernel's program (tpu.py lays out the pallas_call around it).

One program owns query tile q_block of kv head kv_head: rows [blk_start, blk_end) of the
flattened batch, G rows per token. It walks the (sequence, KV tile) work items those rows need
as one flat list, in order, double-buffering the KV pages: while tile i is computed from one
VMEM buffer, tile i + 1's pages are copied from HBM into the other. The online softmax state
(m, l, acc) lives in VMEM scratch and is finished into the output tile at the end.

``_Program`` names the parts: ``bounds`` (which tiles and pages a sequence's rows see),
``live`` / ``normalize`` (the work list), ``copies`` (one tile's DMAs), ``masked_scores`` and
``accumulate`` (one tile's contribution). Its methods only trace: every value stays a jax value
or a ref, exactly as one function's closures would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -1e30  # finite, so that masked rows never produce inf - inf


def attention_kernel(
    kv_lens_ref,  # SMEM i32[R]
    block_tables_ref,  # SMEM i32[R * B] (flattened: 1-D SMEM arrays pad less)
    cu_q_lens_ref,  # SMEM i32[R + 1]
    num_seqs_ref,  # SMEM i32[1]
    q_ref,  # VMEM [M, H]
    k_hbm,  # HBM [K, S, P, H]
    v_hbm,  # HBM [K, S, P, H]
    kv_scales_ref,  # SMEM f32[2] (k_scale, v_scale)
    o_ref,  # VMEM [M, H]
    k_buf,  # VMEM [2, pages_per_tile, P, H]
    v_buf,  # VMEM [2, pages_per_tile, P, H]
    sems,  # DMA semaphores [2 buffers, 2 (K, V)]
    acc_ref,  # VMEM f32[M, H]
    m_ref,  # VMEM f32[M, 128]
    l_ref,  # VMEM f32[M, 128]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    group: int,
    num_tokens: int,
    width: int,
):
    """The kernel: the program's work list run to its end, then its output tile written."""
    prog = _Program(
        (kv_lens_ref, block_tables_ref, cu_q_lens_ref, num_seqs_ref),
        (q_ref, k_hbm, v_hbm, kv_scales_ref, o_ref),
        (k_buf, v_buf, sems, acc_ref, m_ref, l_ref),
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, block_q=block_q,
        group=group, num_tokens=num_tokens, width=width,
    )  # fmt: skip
    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)

    first_seq = _last_seq_starting_by(cu_q_lens_ref, prog.num_seqs, prog.blk_start, prog.num_slots)
    seq0, tile0 = prog.normalize(first_seq, prog.bounds(first_seq)[0])
    pl.when(prog.live(seq0))(prog.copies(seq0, tile0, 0)[0])

    def step(carry):
        seq, tile, slot = carry
        next_seq, next_tile = prog.normalize(seq, tile + 1)
        pl.when(prog.live(next_seq))(prog.copies(next_seq, next_tile, 1 - slot)[0])  # prefetch
        prog.copies(seq, tile, slot)[1]()
        prog.accumulate(*prog.masked_scores(seq, tile, slot))
        return next_seq, next_tile, 1 - slot

    jax.lax.while_loop(lambda c: prog.live(c[0]), step, (seq0, tile0, jnp.int32(0)))

    row_sum = l_ref[...][:, :1]
    out = jnp.where(row_sum > 0, acc_ref[...] / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    o_ref[...] = (out * kv_scales_ref[1]).astype(o_ref.dtype)  # V = pages * v_scale


class _Program:
    """One program's refs, static settings and ids, and the steps of its work list."""

    def __init__(self, meta, io, scratch, *, sm_scale, sliding_window, soft_cap, block_q,
                 group, num_tokens, width) -> None:  # fmt: skip
        self.kv_lens_ref, self.block_tables_ref, self.cu_q_lens_ref, num_seqs_ref = meta
        self.q_ref, self.k_hbm, self.v_hbm, self.kv_scales_ref, _ = io
        self.k_buf, self.v_buf, self.sems, self.acc_ref, self.m_ref, self.l_ref = scratch
        self.sm_scale, self.sliding_window, self.soft_cap = sm_scale, sliding_window, soft_cap
        self.group, self.width = group, width
        self.rows, self.head_dim = self.q_ref.shape
        _, self.pages_per_tile, self.page_size, _ = self.k_buf.shape
        self.num_pages = self.k_hbm.shape[1]
        self.num_slots = self.kv_lens_ref.shape[0]
        self.kv_tile = self.pages_per_tile * self.page_size
        self.max_pos = width * self.page_size - 1
        self.kv_head, q_block = pl.program_id(0), pl.program_id(1)
        self.num_seqs = num_seqs_ref[0]
        self.blk_start = q_block * block_q
        self.blk_end = jnp.minimum(self.blk_start + block_q, num_tokens)

    def bounds(self, seq):
        """KV tiles [lo, hi) and pages [0, page_end) that sequence ``seq``'s rows in this
        block see."""
        seq_c = jnp.minimum(seq, self.num_slots - 1)
        q_end = self.cu_q_lens_ref[seq_c + 1]
        row_lo = jnp.maximum(self.cu_q_lens_ref[seq_c], self.blk_start)
        row_hi = jnp.minimum(q_end, self.blk_end)
        kv_len = self.kv_lens_ref[seq_c]
        first_pos = kv_len - q_end + row_lo
        last_pos = jnp.minimum(kv_len - q_end + row_hi - 1, self.max_pos)
        kv_hi = jnp.where(row_hi > row_lo, last_pos + 1, 0)
        window = self.sliding_window
        kv_lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)
        lo = kv_lo // self.kv_tile
        hi = jnp.maximum(pl.cdiv(kv_hi, self.kv_tile), lo)
        page_end = jnp.minimum(pl.cdiv(kv_hi, self.page_size), self.width)
        return lo, hi, page_end

    def live(self, seq):
        """Sequence ``seq`` has rows at or after this block's start, before its end."""
        first_row = self.cu_q_lens_ref[jnp.minimum(seq, self.num_slots)]
        return (seq < self.num_seqs) & (first_row < self.blk_end)

    def normalize(self, seq, tile):
        """The first work item at or after (seq, tile)."""

        def past_end(c):
            return self.live(c[0]) & (c[1] >= self.bounds(c[0])[1])

        def next_seq(c):
            return c[0] + 1, self.bounds(c[0] + 1)[0]

        return jax.lax.while_loop(past_end, next_seq, (seq, tile))

    def copies(self, seq, tile, slot):
        """(start, wait) of the DMAs of one KV tile's pages into buffer ``slot``: only the
        pages the rows can see."""
        _, _, page_end = self.bounds(seq)
        base = jnp.minimum(seq, self.num_slots - 1) * self.width
        descs = []
        for i in range(self.pages_per_tile):
            page_idx = tile * self.pages_per_tile + i
            page = self.block_tables_ref[base + jnp.minimum(page_idx, self.width - 1)]
            page = jnp.clip(page, 0, self.num_pages - 1)
            for kv, (hbm, buf) in enumerate(((self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf))):
                src, dst = hbm.at[self.kv_head, page], buf.at[slot, i]
                desc = pltpu.make_async_copy(src, dst, self.sems.at[slot, kv])
                descs.append((page_idx < page_end, desc))

        def start():
            for valid, desc in descs:
                pl.when(valid)(desc.start)

        def wait():
            for valid, desc in descs:
                pl.when(valid)(desc.wait)

        return start, wait

    def masked_scores(self, seq, tile, slot):
        """One tile's scores f32[M, W] (soft-capped, masked), its mask and its V [W, H]."""
        seq_c = jnp.minimum(seq, self.num_slots - 1)
        q_start, q_end = self.cu_q_lens_ref[seq_c], self.cu_q_lens_ref[seq_c + 1]
        kv_len = self.kv_lens_ref[seq_c]
        _, _, page_end = self.bounds(seq)
        fetched = (page_end - tile * self.pages_per_tile) * self.page_size  # columns copied
        kv_tile, head_dim, dtype = self.kv_tile, self.head_dim, self.q_ref.dtype
        # Pages in the compute dtype from here on (FP8 pages are cast in VMEM).
        k = self.k_buf[slot].astype(dtype).reshape(kv_tile, head_dim)
        v = self.v_buf[slot].astype(dtype).reshape(kv_tile, head_dim)
        # Unfetched buffer rows hold stale or uninitialised data: zero V there (0 * NaN = NaN).
        v_row = jax.lax.broadcasted_iota(jnp.int32, (kv_tile, head_dim), 0)
        v = jnp.where(v_row < fetched, v, jnp.zeros_like(v))
        s = jax.lax.dot_general(
            self.q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        ) * (self.sm_scale * self.kv_scales_ref[0])  # [M, W]; K = pages * k_scale (kv_quant.py)
        if self.soft_cap is not None:
            s = self.soft_cap * jnp.tanh(s / self.soft_cap)
        row = jax.lax.broadcasted_iota(jnp.int32, (self.rows, kv_tile), 0)
        token = self.blk_start + jax.lax.div(row, jnp.int32(self.group))  # >= 0: div == floor
        col = tile * kv_tile + jax.lax.broadcasted_iota(jnp.int32, (self.rows, kv_tile), 1)
        pos = kv_len - q_end + token
        mask = (token >= q_start) & (token < q_end) & (col <= jnp.minimum(pos, self.max_pos))
        if self.sliding_window is not None:
            mask &= col > pos - self.sliding_window
        return jnp.where(mask, s, MASK_VALUE), mask, v

    def accumulate(self, s, mask, v) -> None:
        """The online softmax step of one tile: m, l and acc updated in VMEM."""
        m_prev, l_prev = self.m_ref[...], self.l_ref[...]  # [M, 128]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
        self.l_ref[...] = alpha * l_prev + p.sum(axis=1, keepdims=True)
        self.m_ref[...] = m_next
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        self.acc_ref[...] = self.acc_ref[...] * alpha[:, :1] + pv


def _last_seq_starting_by(cu_q_lens_ref, num_seqs, token, num_slots: int):
    """Largest s in [0, max(num_seqs - 1, 0)] with cu_q_lens[s] <= token (binary search)."""

    def body(_, bounds):
        lo, hi = bounds  # invariant: cu_q_lens[lo] <= token (or lo == 0), answer < hi
        mid = (lo + hi) // 2
        ok = cu_q_lens_ref[mid] <= token
        active = hi - lo > 1
        return jnp.where(active & ok, mid, lo), jnp.where(active & ~ok, mid, hi)

    num_iters = max(1, (num_slots + 1).bit_length())
    lo, _ = jax.lax.fori_loop(0, num_iters, body, (jnp.int32(0), jnp.maximum(num_seqs, 1)))
    return lo
