"""The body of the GPU (Triton) kernel's program (gpu.py lays out the pallas_call around it).

Program (query block, kv head, split) finds the sequence its block belongs to (``_locate``:
a binary search over each sequence's first block), loads its query rows (block_q tokens times
the G query heads of its kv head, padded to a power of two), runs the online softmax over its
part of the KV tiles (``_tile_step``, gathering each tile's pages by block-table id) and
stores the normalised output, or with flash-decoding splits the partial (acc, max, sum) that
gpu.py's combine step merges (``_store``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import e4m3fn_from_bits

try:  # Triton lowering: deprecated from jax 0.11, so guard the import.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None

MASK_VALUE = -1e30  # finite, so that masked rows never produce inf - inf


class _Dims(NamedTuple):
    """Static sizes of a program's work."""

    num_tokens: int
    head_dim: int
    num_pages: int
    page_size: int
    num_slots: int
    width: int
    group: int  # G: query heads per kv head
    group_p: int  # G padded to a power of two (Triton's shapes)
    rows: int  # M = block_q * group_p
    block_q: int
    kv_tile: int
    pages_per_tile: int
    max_pos: int  # the reference reads positions < B * P only


class _Block(NamedTuple):
    """Where a program's rows are: its sequence, its tokens and the KV tiles it reads."""

    seq_c: Any  # the sequence, clipped to a real slot
    blk_start: Any  # first token of the block
    first_pos: Any  # position of that token
    tile_begin: Any  # KV tiles [tile_begin, tile_end) of this split
    tile_end: Any
    row_ok: Any  # bool[block_q, group_p]: a real row (token in the block, real head)


def attention_kernel(
    kv_lens_ref,  # i32[R]
    block_tables_ref,  # i32[R, B]
    cu_q_lens_ref,  # i32[R + 1]
    num_seqs_ref,  # i32[1]
    q_ref,  # [T, N, H]
    k_pages_ref,  # [K, S, P, H] in HBM
    v_pages_ref,  # [K, S, P, H] in HBM
    kv_scales_ref,  # f32[2] (k_scale, v_scale)
    o_ref,  # [T, N, H] (splits == 1) or f32[splits, T, N, H]
    *stat_refs,  # (row max, row sum) f32[splits, T, N] when splits > 1
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    kv_tile: int,
    num_splits: int,
):
    """The kernel: locate the block, load its query rows, run its KV tiles, store."""
    dims = _dims(q_ref, k_pages_ref, block_tables_ref, block_q, kv_tile)
    kv_head, split = pl.program_id(1), pl.program_id(2)
    blk = _locate(cu_q_lens_ref, kv_lens_ref, num_seqs_ref, dims, sliding_window, num_splits)
    head_slice = pl.ds(kv_head * dims.group, dims.group_p)
    q = pltriton.load(
        q_ref.at[pl.ds(blk.blk_start, block_q), head_slice, :],
        mask=blk.row_ok[:, :, None],
        other=0,
    ).reshape(dims.rows, dims.head_dim)  # [M, H]
    token_off = jax.lax.broadcasted_iota(jnp.int32, (block_q, dims.group_p), 0)
    row_pos = blk.first_pos + token_off.reshape(dims.rows)  # i32[M]
    step = functools.partial(
        _tile_step,
        q=q,
        pages=(k_pages_ref, v_pages_ref, block_tables_ref),
        where=(blk.seq_c, kv_head, row_pos, jnp.minimum(row_pos, dims.max_pos)),
        dims=dims,
        score_scale=sm_scale * kv_scales_ref[0],  # K = pages * k_scale (kv_quant.py)
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    init = (
        jnp.zeros((dims.rows, dims.head_dim), jnp.float32),
        jnp.full((dims.rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((dims.rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(blk.tile_begin, blk.tile_end, step, init)
    acc = acc * kv_scales_ref[1]  # V = pages * v_scale, on the f32 accumulator
    refs = (o_ref, *stat_refs)
    _store(refs, (acc, row_max, row_sum), blk, head_slice, split, dims, num_splits)


def _dims(q_ref, k_pages_ref, block_tables_ref, block_q: int, kv_tile: int) -> _Dims:
    num_tokens, num_q_heads, head_dim = q_ref.shape
    num_kv_heads, num_pages, page_size, _ = k_pages_ref.shape
    num_slots, width = block_tables_ref.shape
    group = num_q_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)
    return _Dims(
        num_tokens, head_dim, num_pages, page_size, num_slots, width, group, group_p,
        rows=block_q * group_p, block_q=block_q, kv_tile=kv_tile,
        pages_per_tile=kv_tile // page_size, max_pos=width * page_size - 1,
    )  # fmt: skip


def _locate(cu_q_lens_ref, kv_lens_ref, num_seqs_ref, dims: _Dims, sliding_window, num_splits):
    """The program's _Block: its sequence (block numbering: gpu.py's docstring), its tokens,
    and the KV tiles of its split, from the sliding window's start to its last row's causal
    limit (none for the padding pseudo-sequence)."""
    block_q, kv_tile = dims.block_q, dims.kv_tile
    block_idx, split = pl.program_id(0), pl.program_id(2)
    num_seqs = num_seqs_ref[0]
    num_iters = max(1, (dims.num_slots + 1).bit_length())
    seq = _find_block_sequence(cu_q_lens_ref, num_seqs, block_idx, block_q, num_iters)
    is_real = seq < num_seqs
    seq_c = jnp.minimum(seq, dims.num_slots - 1)
    q_start = cu_q_lens_ref[seq]
    q_end = jnp.where(is_real, cu_q_lens_ref[jnp.minimum(seq + 1, dims.num_slots)], dims.num_tokens)
    blk_start = q_start + (block_idx - (q_start // block_q + seq)) * block_q
    blk_end = jnp.minimum(q_end, blk_start + block_q)

    # Positions: row r of the tile is token blk_start + r // group_p, head r % group_p.
    kv_len = kv_lens_ref[seq_c]
    first_pos = kv_len - q_end + blk_start
    last_pos = jnp.minimum(kv_len - q_end + blk_end - 1, dims.max_pos)
    kv_hi = jnp.where(is_real & (blk_end > blk_start), last_pos + 1, 0)
    kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    tile_lo = kv_lo // kv_tile
    num_tiles = jnp.maximum(pl.cdiv(kv_hi, kv_tile) - tile_lo, 0)
    per_split = pl.cdiv(num_tiles, num_splits)
    tile_begin = tile_lo + split * per_split
    tile_end = tile_lo + jnp.minimum(num_tiles, (split + 1) * per_split)

    token_off = jax.lax.broadcasted_iota(jnp.int32, (block_q, dims.group_p), 0)
    head_off = jax.lax.broadcasted_iota(jnp.int32, (block_q, dims.group_p), 1)
    row_ok = (token_off < blk_end - blk_start) & (head_off < dims.group)  # [block_q, Gp]
    return _Block(seq_c, blk_start, first_pos, tile_begin, tile_end, row_ok)


def _tile_step(tile, carry, *, q, pages, where, dims: _Dims, score_scale, soft_cap, sliding_window):
    """One KV tile of the online softmax: its pages gathered by block-table id, the masked
    scores, and (acc f32[M, H], row max f32[M], row sum f32[M]) updated."""
    k_pages_ref, v_pages_ref, block_tables_ref = pages
    seq_c, kv_head, row_pos, row_pos_c = where
    acc, m_prev, l_prev = carry
    kv_tile, head_dim = dims.kv_tile, dims.head_dim
    page_idx = jnp.minimum(
        tile * dims.pages_per_tile + jax.lax.iota(jnp.int32, dims.pages_per_tile), dims.width - 1
    )
    page_ids = jnp.clip(block_tables_ref[seq_c, page_idx], 0, dims.num_pages - 1)
    # Pages in the compute dtype from here on (FP8 pages are cast after the load).
    k = _to_compute(k_pages_ref[kv_head, page_ids, :, :].reshape(kv_tile, head_dim), q.dtype)
    v = _to_compute(v_pages_ref[kv_head, page_ids, :, :].reshape(kv_tile, head_dim), q.dtype)
    precision = _dot_precision()
    s = (
        jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision, preferred_element_type=jnp.float32
        )
        * score_scale
    )  # [M, W]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    col = tile * kv_tile + jax.lax.broadcasted_iota(jnp.int32, (dims.rows, kv_tile), 1)
    mask = col <= row_pos_c[:, None]
    if sliding_window is not None:
        mask &= col > row_pos[:, None] - sliding_window
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + p.sum(axis=1)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision,
        preferred_element_type=jnp.float32,
    )  # [M, H]
    return alpha[:, None] * acc + pv, m_next, l_next


# jax_default_matmul_precision values that ask for full float32 products.
_FULL_F32 = ("highest", "float32", "F32_F32_F32")


def _dot_precision() -> jax.lax.Precision | None:
    """The tile products' precision, as jax's default matmul precision sets it for XLA's own
    matmuls (read at trace time): full float32 under ``jax.default_matmul_precision("highest")``
    (Triton's IEEE dot), else Triton's default, TF32 for float32 operands on sm_80+ (what XLA's
    default gives a float32 model's other matmuls there). bf16 and fp16 operands multiply
    exactly either way."""
    return (
        jax.lax.Precision.HIGHEST if jax.config.jax_default_matmul_precision in _FULL_F32 else None
    )


def _to_compute(tile, dtype):
    """A loaded KV tile in the compute dtype: uint8 tiles are float8_e4m3fn bytes, converted
    with integer ops (gpu.py's soft_fp8: GPUs below sm_89), anything else cast."""
    if tile.dtype == jnp.uint8:
        return e4m3fn_from_bits(tile).astype(dtype)
    return tile.astype(dtype)


def _store(refs, state, blk: _Block, head_slice, split, dims: _Dims, num_splits: int) -> None:
    """The block's rows: normalised into o_ref (one split), or the split's partial acc, max
    and sum (several: gpu.py combines them)."""
    o_ref, *stat_refs = refs
    acc, row_max, row_sum = state
    rows_out = pl.ds(blk.blk_start, dims.block_q)
    shape = (dims.block_q, dims.group_p)
    if num_splits == 1:
        safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
        out = jnp.where(row_sum[:, None] > 0, acc / safe_sum, 0.0)
        out = out.reshape(*shape, dims.head_dim).astype(o_ref.dtype)
        pltriton.store(o_ref.at[rows_out, head_slice, :], out, mask=blk.row_ok[:, :, None])
        return
    max_ref, sum_ref = stat_refs
    acc = acc.reshape(*shape, dims.head_dim)
    pltriton.store(o_ref.at[split, rows_out, head_slice, :], acc, mask=blk.row_ok[:, :, None])
    for ref, stat in ((max_ref, row_max), (sum_ref, row_sum)):
        pltriton.store(ref.at[split, rows_out, head_slice], stat.reshape(shape), mask=blk.row_ok)


def _find_block_sequence(cu_q_lens_ref, num_seqs, block_idx, block_q: int, num_iters: int):
    """Largest s in [0, num_seqs] with cu_q_lens[s] // block_q + s <= block_idx."""

    def body(_, bounds):
        lo, hi = bounds  # invariant: first_block(lo) <= block_idx < first_block(hi)
        mid = (lo + hi) // 2
        ok = cu_q_lens_ref[mid] // block_q + mid <= block_idx
        active = hi - lo > 1
        return (
            jnp.where(active & ok, mid, lo),
            jnp.where(active & ~ok, mid, hi),
        )

    lo, _ = jax.lax.fori_loop(0, num_iters, body, (jnp.int32(0), num_seqs + 1))
    return lo
