"""Ragged paged attention for TPU: a Pallas kernel lowered through Mosaic.

Semantics and signature are those of reference.py. Layout of the work:

    grid = (K, Q)   K kv heads, Q = cdiv(T, block_q) blocks of consecutive query tokens

The wrapper lays q out as [K, T * G, H] (one transpose in XLA), so a program's query tile is a
plain 2-D [M, H] block, M = block_q * G: row r is token block_start + r // G, head r % G of its
kv head (GQA without repeating K/V). A block may span several sequences; the program walks the
(sequence, KV tile) pairs its rows need, in order, as one flat work list, and keeps one online
softmax state (m, l, acc in VMEM) per row: a row is only ever updated by its own sequence.

Block tables, kv lens, cu_q_lens and num_seqs come in through scalar prefetch (SMEM). K/V stay
in HBM (memory_space ANY); each KV tile's pages are copied by async DMA into one of two VMEM
buffers while the other is being computed on (double buffering, a DMA semaphore per buffer and
K/V). Only pages the tile's rows can see are copied: from the sliding window's start to the
causal limit of the last row, never past kv_len. Every DMA a program starts, it waits for, so
programs are independent and both grid axes are parallel.

FP8 pages (kv_quant.py) are copied as FP8 (half the DMA bytes of bf16) and cast to q's dtype
once in VMEM; k_scale joins sm_scale on the scores and v_scale multiplies the f32 output,
both read from an f32[2] SMEM input (ones when no scales are given): never recompiled.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import scales_or_ones
from jaxserve.pallas_kernels.ragged_paged_attention.validation import validate_inputs

MASK_VALUE = -1e30  # finite, so that masked rows never produce inf - inf
_LANES = 128  # m and l are kept lane-replicated: [M, 128]


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Tuning of the TPU kernel; every field is a static (compile-time) choice.

    block_q: query tokens per program; the tile has M = block_q * G rows, a multiple of 16.
    pages_per_tile: pages copied per DMA step (the KV tile is pages_per_tile * P tokens).
    vmem_limit_bytes: Mosaic scoped-VMEM limit, or None for the compiler default.
    """

    block_q: int
    pages_per_tile: int
    vmem_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_q", "pages_per_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def default_tpu_config(
    q_shape: tuple[int, int, int],  # (T, N, H)
    kv_shape: tuple[int, int, int, int],  # (K, S, P, H)
    table_shape: tuple[int, int],  # (R, B)
) -> TpuConfig:
    """Pick a config from static shapes: ~128 query rows (one MXU pass) and ~256-token KV tiles,
    both capped by the batch's own size."""
    num_tokens, num_q_heads, _ = q_shape
    num_kv_heads, _, page_size, _ = kv_shape
    _, width = table_shape
    group = num_q_heads // num_kv_heads
    row_align = 16 // math.gcd(group, 16)  # smallest block_q making M a multiple of 16
    block_q = max(row_align, (128 // group) // row_align * row_align)
    block_q = min(block_q, pl.cdiv(num_tokens, row_align) * row_align)
    pages_per_tile = max(1, min(width, 256 // page_size))
    return TpuConfig(block_q=block_q, pages_per_tile=pages_per_tile)


def _seq_bounds(
    cu_q_lens_ref,
    kv_lens_ref,
    seq,
    blk_start,
    blk_end,
    *,
    sliding_window,
    kv_tile: int,
    page_size: int,
    width: int,
    num_slots: int,
):
    """KV tiles [lo, hi) and pages [0, page_end) that sequence `seq`'s rows in this block see."""
    seq_c = jnp.minimum(seq, num_slots - 1)
    q_end = cu_q_lens_ref[seq_c + 1]
    row_lo = jnp.maximum(cu_q_lens_ref[seq_c], blk_start)
    row_hi = jnp.minimum(q_end, blk_end)
    kv_len = kv_lens_ref[seq_c]
    first_pos = kv_len - q_end + row_lo
    last_pos = jnp.minimum(kv_len - q_end + row_hi - 1, width * page_size - 1)
    kv_hi = jnp.where(row_hi > row_lo, last_pos + 1, 0)
    kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    lo = kv_lo // kv_tile
    hi = jnp.maximum(pl.cdiv(kv_hi, kv_tile), lo)
    page_end = jnp.minimum(pl.cdiv(kv_hi, page_size), width)
    return lo, hi, page_end


def _attention_kernel(
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
    rows, head_dim = q_ref.shape
    _, pages_per_tile, page_size, _ = k_buf.shape
    num_pages = k_hbm.shape[1]
    num_slots = kv_lens_ref.shape[0]
    kv_tile = pages_per_tile * page_size
    max_pos = width * page_size - 1
    kv_head, q_block = pl.program_id(0), pl.program_id(1)
    num_seqs = num_seqs_ref[0]
    blk_start = q_block * block_q
    blk_end = jnp.minimum(blk_start + block_q, num_tokens)
    bounds = functools.partial(
        _seq_bounds,
        cu_q_lens_ref,
        kv_lens_ref,
        blk_start=blk_start,
        blk_end=blk_end,
        sliding_window=sliding_window,
        kv_tile=kv_tile,
        page_size=page_size,
        width=width,
        num_slots=num_slots,
    )

    def live(seq):  # sequence seq has rows at or after this block's start, before its end
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_slots)] < blk_end)

    def normalize(seq, tile):  # first work item at or after (seq, tile)
        def past_end(c):
            return live(c[0]) & (c[1] >= bounds(c[0])[1])

        def next_seq(c):
            return c[0] + 1, bounds(c[0] + 1)[0]

        return jax.lax.while_loop(past_end, next_seq, (seq, tile))

    def copies(seq, tile, slot):  # (start, wait) of the DMAs of one KV tile
        _, _, page_end = bounds(seq)
        base = jnp.minimum(seq, num_slots - 1) * width
        descs = []
        for i in range(pages_per_tile):
            page_idx = tile * pages_per_tile + i
            page = block_tables_ref[base + jnp.minimum(page_idx, width - 1)]
            page = jnp.clip(page, 0, num_pages - 1)
            for kv, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                src, dst = hbm.at[kv_head, page], buf.at[slot, i]
                desc = pltpu.make_async_copy(src, dst, sems.at[slot, kv])
                descs.append((page_idx < page_end, desc))

        def start():
            for valid, desc in descs:
                pl.when(valid)(desc.start)

        def wait():
            for valid, desc in descs:
                pl.when(valid)(desc.wait)

        return start, wait

    def compute(seq, tile, slot):
        seq_c = jnp.minimum(seq, num_slots - 1)
        q_start, q_end = cu_q_lens_ref[seq_c], cu_q_lens_ref[seq_c + 1]
        kv_len = kv_lens_ref[seq_c]
        _, _, page_end = bounds(seq)
        fetched = (page_end - tile * pages_per_tile) * page_size  # columns copied this step
        # Pages in the compute dtype from here on (FP8 pages are cast in VMEM).
        k = k_buf[slot].astype(q_ref.dtype).reshape(kv_tile, head_dim)
        v = v_buf[slot].astype(q_ref.dtype).reshape(kv_tile, head_dim)
        # Unfetched buffer rows hold stale or uninitialised data: zero V there (0 * NaN = NaN).
        v_row = jax.lax.broadcasted_iota(jnp.int32, (kv_tile, head_dim), 0)
        v = jnp.where(v_row < fetched, v, jnp.zeros_like(v))
        s = (
            jax.lax.dot_general(
                q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            * (sm_scale * kv_scales_ref[0])  # K = pages * k_scale (kv_quant.py)
        )  # [M, W]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 0)
        token = blk_start + jax.lax.div(row, jnp.int32(group))  # non-negative: div == floor
        col = tile * kv_tile + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 1)
        pos = kv_len - q_end + token
        mask = (token >= q_start) & (token < q_end) & (col <= jnp.minimum(pos, max_pos))
        if sliding_window is not None:
            mask &= col > pos - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [M, 128]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
        l_ref[...] = alpha * l_prev + p.sum(axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

    acc_ref[...] = jnp.zeros_like(acc_ref)
    m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)

    first_seq = _last_seq_starting_by(cu_q_lens_ref, num_seqs, blk_start, num_slots)
    seq0, tile0 = normalize(first_seq, bounds(first_seq)[0])
    pl.when(live(seq0))(copies(seq0, tile0, 0)[0])

    def step(carry):
        seq, tile, slot = carry
        next_seq, next_tile = normalize(seq, tile + 1)
        pl.when(live(next_seq))(copies(next_seq, next_tile, 1 - slot)[0])  # prefetch
        copies(seq, tile, slot)[1]()
        compute(seq, tile, slot)
        return next_seq, next_tile, 1 - slot

    jax.lax.while_loop(lambda c: live(c[0]), step, (seq0, tile0, jnp.int32(0)))

    row_sum = l_ref[...][:, :1]
    out = jnp.where(row_sum > 0, acc_ref[...] / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    o_ref[...] = (out * kv_scales_ref[1]).astype(o_ref.dtype)  # V = pages * v_scale


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


def _check_tpu_shapes(q: jax.Array, k_pages: jax.Array, config: TpuConfig) -> None:
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // k_pages.shape[0]
    rows = config.block_q * group
    if rows % 16 and config.block_q < num_tokens:
        raise ValueError(
            f"block_q * (N // K) = {rows} query rows per tile must be a multiple of 16 "
            f"(block_q={config.block_q}, N // K={group})"
        )


def _resolve_config(q, k_pages, block_tables, overrides: dict) -> TpuConfig:
    """default_tpu_config for these shapes, with the overrides that are not None."""
    config = default_tpu_config(q.shape, k_pages.shape, block_tables.shape)
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def _tpu_call(kernel, q_t: jax.Array, k_pages: jax.Array, config: TpuConfig, group: int, interpret):
    """The pallas_call of `kernel` on grid (kv head, query tile) over head-major q_t
    [K, T * G, H]: 4 metadata arrays prefetched to SMEM, q and output tiles of block_q * G rows
    in VMEM, the page pools left in HBM (the body copies them into a double buffer), the KV
    scales in SMEM, and the body's scratch."""
    num_kv_heads, num_rows, head_dim = q_t.shape
    page_size = k_pages.shape[2]
    rows = config.block_q * group
    tile_spec = pl.BlockSpec((None, rows, head_dim), lambda h, b, *_: (h, b, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, config.pages_per_tile, page_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_kv_heads, pl.cdiv(num_rows // group, config.block_q)),
        in_specs=[tile_spec, hbm, hbm, pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=tile_spec,
        scratch_shapes=[
            buf,
            buf,
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((rows, head_dim), jnp.float32),
            pltpu.VMEM((rows, _LANES), jnp.float32),
            pltpu.VMEM((rows, _LANES), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=config.vmem_limit_bytes,
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "pages_per_tile",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def ragged_paged_attention_tpu(
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
    pages_per_tile: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    k_scale: jax.Array | None = None,  # f32[] (kv_quant.py; None: 1)
    v_scale: jax.Array | None = None,  # f32[]
) -> jax.Array:  # [T, N, H]
    """Ragged paged attention on TPU (Mosaic); same contract as the reference.

    Tuning arguments left at None come from default_tpu_config. interpret=True runs the body in
    XLA; interpret=pltpu.InterpretParams(...) runs TPU interpret mode, which simulates DMAs,
    semaphores and VMEM (and can detect races).

    Raises:
        ValueError: bad shapes/dtypes/options (validation.py), or a query tile whose row count
            block_q * (N // K) is not a multiple of 16.
    """
    validate_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    given = dict(block_q=block_q, pages_per_tile=pages_per_tile, vmem_limit_bytes=vmem_limit_bytes)
    config = _resolve_config(q, k_pages, block_tables, given)
    _check_tpu_shapes(q, k_pages, config)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    num_slots, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    # [T, N, H] -> [K, T * G, H]: row t * G + g of kv head k is query head k * G + g of token t.
    q_t = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_t = q_t.reshape(num_kv_heads, num_tokens * group, head_dim)
    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=config.block_q,
        group=group,
        num_tokens=num_tokens,
        width=width,
    )
    out = _tpu_call(kernel, q_t, k_pages, config, group, interpret)(
        kv_lens, block_tables.reshape(num_slots * width), cu_q_lens, num_seqs, q_t, k_pages,
        v_pages, scales_or_ones(k_scale, v_scale),
    )  # fmt: skip
    out = out.reshape(num_kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_q_heads, head_dim)
