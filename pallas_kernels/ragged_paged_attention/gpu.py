"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel lowered through Triton.

Semantics and signature are those of reference.py. Layout of the work:

    grid = (Q, K, splits)   Q query blocks, K kv heads, flash-decoding splits of the KV range

Query block i belongs to one sequence s: the blocks of s are numbered from
first_block(s) = cu_q_lens[s] // block_q + s (increasing in s, at least cdiv(q_len, block_q)
apart, so every block holds rows of one sequence only; some are empty and exit at once). Block
num_seqs is a pseudo-sequence covering the padding rows cu_q_lens[num_seqs]:T, written as zeros.
Q = cdiv(T, block_q) + R + 1 bounds the last block of any sequence. A program finds its
sequence by binary search over first_block.

Each program holds the rows of block_q tokens times the G query heads of its kv head (GQA
without repeating K/V: rows = block_q * G, padded to a power of two for Triton) and runs an
online softmax over KV tiles of kv_tile tokens, gathering the tile's pages from the page pool
(left in HBM, memory_space ANY) by block-table id. It reads only the tiles its rows can see:
from the sliding window's start to its last row's causal limit, so never past kv_len. With
splits > 1 the KV range is cut into `splits` parts whose partial (acc, max, sum) are merged by
a small jnp combine step (flash decoding), for long contexts at small batch.

FP8 pages (kv_quant.py) are loaded as FP8 and cast to q's dtype in the program; k_scale joins
sm_scale on the scores and v_scale multiplies the f32 accumulator, both read from a small
f32[2] input (ones when no scales are given), so a new scale never recompiles.

Lowering: Triton compiler params select the Triton lowering (Mosaic GPU is the default since
jax 0.9 and would reject this kernel). On CPU, interpret=True runs the same body in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import scales_or_ones
from jaxserve.pallas_kernels.ragged_paged_attention.validation import (
    require_power_of_two,
    validate_inputs,
)

try:  # Triton lowering: deprecated from jax 0.11, so guard the import.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None

MASK_VALUE = -1e30  # finite, so that masked rows never produce inf - inf
DEFAULT_NUM_CORES = 132  # H100/H200 SM count; used when no GPU is attached at trace time


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """Tuning of the GPU kernel; every field is a static (compile-time) choice.

    block_q: query tokens per program; the tile has block_q * next_pow2(G) rows (>= 16 for
        Triton's dot).
    kv_tile: KV tokens per inner step, a multiple of the page size P (power of two, >= 16).
    num_kv_splits: flash-decoding parts of each sequence's KV range (1: no split, no combine).
    num_warps, num_stages: Triton launch parameters.
    """

    block_q: int
    kv_tile: int
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        require_power_of_two("block_q", self.block_q, 1)
        require_power_of_two("kv_tile", self.kv_tile, 16)
        for name in ("num_kv_splits", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def default_gpu_config(
    q_shape: tuple[int, int, int],  # (T, N, H)
    kv_shape: tuple[int, int, int, int],  # (K, S, P, H)
    table_shape: tuple[int, int],  # (R, B)
    num_cores: int = DEFAULT_NUM_CORES,
) -> GpuConfig:
    """Pick a config from static shapes: small tiles and KV splits for decode-heavy batches,
    bigger query tiles for prefill."""
    num_tokens, num_q_heads, _ = q_shape
    num_kv_heads, _, page_size, _ = kv_shape
    num_slots, width = table_shape
    group = pl.next_power_of_2(num_q_heads // num_kv_heads)
    decode_heavy = num_tokens <= 4 * num_slots
    rows = 16 if decode_heavy else 64
    block_q = max(1, rows // group)
    kv_tile = max(page_size, 32 if decode_heavy else 64)
    splits = 1
    if decode_heavy:
        busy_programs = num_slots * num_kv_heads  # at most one busy query block per sequence
        wanted = pl.cdiv(2 * num_cores, busy_programs)
        splits = max(1, min(16, wanted, (width * page_size) // (2 * kv_tile)))
    return GpuConfig(block_q=block_q, kv_tile=kv_tile, num_kv_splits=splits)


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


def _attention_kernel(
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
    num_tokens, num_q_heads, head_dim = q_ref.shape
    num_kv_heads, num_pages, page_size, _ = k_pages_ref.shape
    num_slots, width = block_tables_ref.shape
    group = num_q_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)  # heads per tile, padded for Triton's power-of-2 shapes
    rows = block_q * group_p
    pages_per_tile = kv_tile // page_size
    max_pos = width * page_size - 1  # the reference reads positions < B * P only

    block_idx, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = num_seqs_ref[0]
    num_iters = max(1, (num_slots + 1).bit_length())
    seq = _find_block_sequence(cu_q_lens_ref, num_seqs, block_idx, block_q, num_iters)
    is_real = seq < num_seqs
    seq_c = jnp.minimum(seq, num_slots - 1)
    q_start = cu_q_lens_ref[seq]
    q_end = jnp.where(is_real, cu_q_lens_ref[jnp.minimum(seq + 1, num_slots)], num_tokens)
    blk_start = q_start + (block_idx - (q_start // block_q + seq)) * block_q
    blk_end = jnp.minimum(q_end, blk_start + block_q)

    # Positions: row r of the tile is token blk_start + r // group_p, head r % group_p.
    kv_len = kv_lens_ref[seq_c]
    first_pos = kv_len - q_end + blk_start
    last_pos = jnp.minimum(kv_len - q_end + blk_end - 1, max_pos)
    kv_hi = jnp.where(is_real & (blk_end > blk_start), last_pos + 1, 0)
    kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    tile_lo = kv_lo // kv_tile
    num_tiles = jnp.maximum(pl.cdiv(kv_hi, kv_tile) - tile_lo, 0)
    per_split = pl.cdiv(num_tiles, num_splits)
    tile_begin = tile_lo + split * per_split
    tile_end = tile_lo + jnp.minimum(num_tiles, (split + 1) * per_split)

    token_off = jax.lax.broadcasted_iota(jnp.int32, (block_q, group_p), 0)
    head_off = jax.lax.broadcasted_iota(jnp.int32, (block_q, group_p), 1)
    row_ok = (token_off < blk_end - blk_start) & (head_off < group)  # [block_q, Gp]
    head_slice = pl.ds(kv_head * group, group_p)
    q = pltriton.load(
        q_ref.at[pl.ds(blk_start, block_q), head_slice, :],
        mask=row_ok[:, :, None],
        other=0,
    ).reshape(rows, head_dim)  # [M, H]
    row_pos = first_pos + token_off.reshape(rows)  # i32[M]
    score_scale = sm_scale * kv_scales_ref[0]  # K = pages * k_scale (kv_quant.py)
    v_scale = kv_scales_ref[1]
    row_pos_c = jnp.minimum(row_pos, max_pos)

    def tile_step(tile, carry):
        acc, m_prev, l_prev = carry  # f32[M, H], f32[M], f32[M]
        page_idx = jnp.minimum(
            tile * pages_per_tile + jax.lax.iota(jnp.int32, pages_per_tile), width - 1
        )
        page_ids = jnp.clip(block_tables_ref[seq_c, page_idx], 0, num_pages - 1)
        # Pages in the compute dtype from here on (FP8 pages are cast after the load).
        k = k_pages_ref[kv_head, page_ids, :, :].reshape(kv_tile, head_dim).astype(q.dtype)
        v = v_pages_ref[kv_head, page_ids, :, :].reshape(kv_tile, head_dim).astype(q.dtype)
        s = (
            jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * score_scale
        )  # [M, W]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        col = tile * kv_tile + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 1)
        mask = col <= row_pos_c[:, None]
        if sliding_window is not None:
            mask &= col > row_pos[:, None] - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = alpha * l_prev + p.sum(axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, H]
        return alpha[:, None] * acc + pv, m_next, l_next

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(tile_begin, tile_end, tile_step, init)
    acc = acc * v_scale  # V = pages * v_scale, on the f32 accumulator

    rows_out = pl.ds(blk_start, block_q)
    if num_splits == 1:
        safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
        out = jnp.where(row_sum[:, None] > 0, acc / safe_sum, 0.0)
        out = out.reshape(block_q, group_p, head_dim).astype(o_ref.dtype)
        pltriton.store(o_ref.at[rows_out, head_slice, :], out, mask=row_ok[:, :, None])
    else:
        max_ref, sum_ref = stat_refs
        acc = acc.reshape(block_q, group_p, head_dim)
        pltriton.store(o_ref.at[split, rows_out, head_slice, :], acc, mask=row_ok[:, :, None])
        for ref, stat in ((max_ref, row_max), (sum_ref, row_sum)):
            stat = stat.reshape(block_q, group_p)
            pltriton.store(ref.at[split, rows_out, head_slice], stat, mask=row_ok)


def _combine_splits(
    acc: jax.Array,  # f32[splits, T, N, H] unnormalised partial outputs
    row_max: jax.Array,  # f32[splits, T, N] partial row maxima
    row_sum: jax.Array,  # f32[splits, T, N] partial softmax denominators
    dtype: jnp.dtype,
) -> jax.Array:  # [T, N, H]
    """Merge flash-decoding partials: rescale each split to the global max and normalise."""
    weight = jnp.exp(row_max - row_max.max(axis=0, keepdims=True))  # [splits, T, N]
    denom = (row_sum * weight).sum(axis=0)  # [T, N]
    out = (acc * weight[..., None]).sum(axis=0)  # [T, N, H]
    safe = jnp.where(denom > 0, denom, 1.0)
    return jnp.where(denom[..., None] > 0, out / safe[..., None], 0.0).astype(dtype)


def _check_gpu_shapes(q: jax.Array, k_pages: jax.Array, config: GpuConfig) -> None:
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    require_power_of_two("head dim H", head_dim, 16)
    require_power_of_two("page size P", page_size, 1)
    if config.kv_tile % page_size:
        raise ValueError(f"kv_tile {config.kv_tile} must be a multiple of page size P={page_size}")
    rows = config.block_q * pl.next_power_of_2(num_q_heads // num_kv_heads)
    if rows < 16:
        raise ValueError(
            f"block_q * next_pow2(N // K) = {rows} query rows per tile must be >= 16 "
            f"(block_q={config.block_q})"
        )
    if pltriton is None:
        raise ValueError("the GPU kernel needs jax.experimental.pallas.triton; this jax lacks it")


def _resolve_config(q, k_pages, block_tables, num_cores: int | None, overrides: dict) -> GpuConfig:
    num_cores = DEFAULT_NUM_CORES if num_cores is None else num_cores
    config = default_gpu_config(q.shape, k_pages.shape, block_tables.shape, num_cores)
    given = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(config, **given)


def _out_shape(q: jax.Array, splits: int) -> object:
    """The kernel's output: [T, N, H] in q's dtype, or with splits > 1 each split's f32
    partials (acc [splits, T, N, H], row max and row sum [splits, T, N]) for _combine_splits."""
    if splits == 1:
        return jax.ShapeDtypeStruct(q.shape, q.dtype)
    num_tokens, num_q_heads, _ = q.shape
    return (
        jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
        jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32),
        jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32),
    )


def _gpu_call(
    kernel, q: jax.Array, k_pages: jax.Array, num_slots: int, config: GpuConfig, interpret
):
    """The pallas_call of `kernel` on grid (query block, kv head, split): Q = cdiv(T, block_q)
    + R + 1 query blocks (module docstring), every input whole, the page pools left in HBM."""
    num_blocks = pl.cdiv(q.shape[0], config.block_q) + num_slots + 1
    full = pl.no_block_spec  # whole array; Triton addresses it through one pointer
    whole = pl.BlockSpec(memory_space=pl.ANY)  # page pools stay in HBM, gathered in the body
    return pl.pallas_call(
        kernel,
        out_shape=_out_shape(q, config.num_kv_splits),
        grid=(num_blocks, k_pages.shape[0], config.num_kv_splits),
        in_specs=[full, full, full, full, full, whole, whole, full],
        compiler_params=None
        if interpret
        else pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "kv_tile",
        "num_kv_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "num_cores",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, S, P, H]
    v_pages: jax.Array,  # [K, S, P, H]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, B]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    kv_tile: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    num_cores: int | None = None,
    k_scale: jax.Array | None = None,  # f32[] (kv_quant.py; None: 1)
    v_scale: jax.Array | None = None,  # f32[]
) -> jax.Array:  # [T, N, H]
    """Ragged paged attention on GPU (Triton lowering); same contract as the reference.

    Tuning arguments left at None come from default_gpu_config, for a GPU of num_cores
    streaming multiprocessors (None: DEFAULT_NUM_CORES; the execution plan passes the real
    count). interpret=True runs the kernel body in XLA (any backend, slow): the CPU test path.

    Raises:
        ValueError: bad shapes/dtypes/options (validation.py), or shapes Triton cannot tile:
            H not a power of two >= 16, P not a power of two, kv_tile not a multiple of P.
    """
    validate_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    overrides = dict(
        block_q=block_q, kv_tile=kv_tile, num_kv_splits=num_kv_splits, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    config = _resolve_config(q, k_pages, block_tables, num_cores, overrides)
    _check_gpu_shapes(q, k_pages, config)
    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=config.block_q,
        kv_tile=config.kv_tile,
        num_splits=config.num_kv_splits,
    )
    result = _gpu_call(kernel, q, k_pages, block_tables.shape[0], config, interpret)(
        kv_lens, block_tables, cu_q_lens, num_seqs, q, k_pages, v_pages,
        scales_or_ones(k_scale, v_scale),
    )  # fmt: skip
    if config.num_kv_splits == 1:
        return result
    return _combine_splits(*result, dtype=q.dtype)
