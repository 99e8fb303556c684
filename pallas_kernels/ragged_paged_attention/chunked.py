"""Ragged paged attention in plain XLA ops: the fast CPU backend.

Same signature and semantics as reference.py. The reference gathers, for every query row, the
whole block-table width B * P at once. Here every piece of work walks the context in chunks of
C positions with online softmax (flash attention's running max / sum) and stops at its own
last needed chunk, a run-time value, so the block table can be passed at full width
(max_model_len / P pages) and the step compiles once per token bucket.

The batch splits into two passes, each row handled by exactly one:

- row pass, for sequences with one query token (decodes), and for prefill rows too few to
  fill a quarter of a tile (see below). Every row needs its own pages, so rows are gathered
  together: sorted by context length (longest first) and cut into blocks of
  `rows_per_block`; each block loops only to its own longest context, and blocks past the last
  decode row are never run. A short decode batched with a long one costs its own length
  rounded to a chunk, not the long one's, and padding rows cost nothing.
- tile pass, for sequences with several query tokens (prefill chunks). Their rows share one
  block table, so a tile of up to `tile_rows` consecutive rows of one sequence gathers each
  chunk's K/V once ([K, C, H]) and attends all its rows to it, causally: a 2048-token prompt
  reads its pages about 2048 / tile_rows times instead of once per query row. A sequence's
  last, partial tile is only formed when it holds more than a quarter of a tile; otherwise
  those rows join the row pass (256 chunks of 8 tokens would otherwise cost 256 tiles of 128).

With row_kernel="cpu" the row pass is the C++ kernel of cpu_rows.cc instead (f32 only): it
streams each row's pages once, where XLA:CPU runs the row pass's tiny batched dots far below
the machine's memory bandwidth (bench/attention_cpu.py, docs/benchmarks.md); tiles stay XLA
GEMMs.

Memory per loop iteration is bounded by the tunables: [K, rows_per_block, C, H] gathered in the
row pass, [K, C', H] and scores [K, tile_rows * G, C'] in the tile pass. Both passes keep the
KV head as the leading (batch) dimension of their dots, which XLA:CPU runs faster than the
token-major layout on prefill tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.pallas_kernels.ragged_paged_attention.cpu_rows import cpu_rows_attention
from jaxserve.pallas_kernels.ragged_paged_attention.reference import token_seq_ids
from jaxserve.pallas_kernels.ragged_paged_attention.validation import validate_inputs

_MASK_VALUE = -1e30
# Defaults, tuned on the 2-core CPU (K=2, G=4, H=64, P=32) with bench/attention_cpu.py: row
# blocks of 2 beat 8 on the decode batches there (a block computes its padding and its shorter
# rows up to its longest), except for many short chunks; 256-position tiles beat 512 for
# 256-token prompts without losing on 2048-token ones (docs/benchmarks.md).
ROWS_PER_BLOCK = 2
ROW_CHUNK_POSITIONS = 128
TILE_ROWS = 128
TILE_CHUNK_POSITIONS = 256
ROW_KERNELS = ("xla", "cpu")


def chunk_pages(positions: int, page_size: int, table_width: int) -> int:
    """Pages per chunk for about `positions` context positions: a power of two, at least 1,
    at most the table width."""
    n = max(1, min(positions // page_size, table_width))
    return 1 << (n.bit_length() - 1)


def _online_softmax_step(carry, s, v, mask, value_spec: str):
    """One flash-attention update. carry (m, denom, acc) [..., G], [..., G], [..., G, H];
    s scores [..., G, C] (already masked to _MASK_VALUE); v the chunk's values for value_spec."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[..., None] + jnp.einsum(value_spec, p, v)
    return m_new, denom * alpha + p.sum(axis=-1), acc


def _init_carry(shape: tuple[int, ...], head_dim: int):
    return (
        jnp.full(shape, _MASK_VALUE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )


def _finish(carry) -> jax.Array:
    _, denom, acc = carry
    return jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)


def _scores(q, k, spec: str, sm_scale: float, soft_cap: float | None) -> jax.Array:
    s = jnp.einsum(spec, q, k.astype(jnp.float32)) * sm_scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _first_chunk(first_pos: jax.Array, width: int, sliding_window: int | None) -> jax.Array:
    """The first chunk any row starting at first_pos can see (0 without a window)."""
    if sliding_window is None:
        return jnp.int32(0)
    return jnp.maximum(first_pos - sliding_window + 1, 0) // width


def _row_pass(
    qg, k_pages, v_pages, token_table, q_pos, needed, *, pages, rows_per_block, sm_scale,
    sliding_window, soft_cap,
):  # fmt: skip
    """Rows with needed > 0 (their context length), blocked by length. qg [T, K, G, H] f32;
    token_table [T, W] (W a multiple of pages). Returns f32[T, K, G, H], zero elsewhere."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    page_size = k_pages.shape[2]
    width = pages * page_size
    rb = min(rows_per_block, num_tokens)
    padded = -(-num_tokens // rb) * rb
    pad = padded - num_tokens
    qg = jnp.pad(qg, ((0, pad), (0, 0), (0, 0), (0, 0)))
    token_table = jnp.pad(token_table, ((0, pad), (0, 0)))
    q_pos = jnp.pad(q_pos, (0, pad))
    needed = jnp.pad(needed, (0, pad))
    order = jnp.argsort(-needed, stable=True).astype(jnp.int32)  # longest first; padding last
    sorted_needed = needed[order]
    num_blocks = -(-jnp.sum(needed > 0) // rb)

    def block(b, out):  # out: [padded, K, G, H] in sorted order
        rows = lax.dynamic_slice_in_dim(order, b * rb, rb)
        lens = lax.dynamic_slice_in_dim(sorted_needed, b * rb, rb)
        ok, pos, table = lens > 0, q_pos[rows], token_table[rows]
        q_blk = qg[rows].transpose(1, 0, 2, 3)  # [K, rb, G, H]
        lo = _first_chunk(jnp.min(jnp.where(ok, pos, jnp.iinfo(jnp.int32).max)), width,
                          sliding_window)  # fmt: skip
        hi = -(-lens[0] // width)

        def chunk(i, carry):
            ids = lax.dynamic_slice_in_dim(table, i * pages, pages, axis=1)  # [rb, pages]
            k = k_pages[:, ids].reshape(num_kv_heads, rb, width, head_dim)
            v = v_pages[:, ids].reshape(num_kv_heads, rb, width, head_dim)
            s = _scores(q_blk, k, "KRGH,KRCH->KRGC", sm_scale, soft_cap)
            c_pos = i * width + jnp.arange(width, dtype=jnp.int32)
            mask = (c_pos[None, :] <= pos[:, None]) & ok[:, None]  # [rb, C]
            if sliding_window is not None:
                mask &= c_pos[None, :] > pos[:, None] - sliding_window
            mask = mask[None, :, None, :]
            s = jnp.where(mask, s, _MASK_VALUE)
            return _online_softmax_step(carry, s, v.astype(jnp.float32), mask, "KRGC,KRCH->KRGH")

        carry = lax.fori_loop(lo, hi, chunk, _init_carry((num_kv_heads, rb, group), head_dim))
        res = _finish(carry).transpose(1, 0, 2, 3)  # [rb, K, G, H]
        return lax.dynamic_update_slice_in_dim(out, res, b * rb, axis=0)

    out_sorted = lax.fori_loop(0, num_blocks, block, jnp.zeros_like(qg))
    return jnp.zeros_like(qg).at[order].set(out_sorted)[:num_tokens]


def _tile_pass(
    qg, out, k_pages, v_pages, table, kv_lens, cu_q_lens, tiles, covered, *, pages, tq,
    sm_scale, sliding_window, soft_cap,
):  # fmt: skip
    """The first covered[r] rows of each sequence, in tiles[r] tiles of up to tq consecutive
    rows; writes their rows of out [T, K, G, H] and returns it."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    page_size = k_pages.shape[2]
    width = pages * page_size
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [R]
    tile_ends = jnp.cumsum(tiles)
    # Padded by one tile so a tile's slice never clamps (moving it onto earlier rows).
    qg = jnp.pad(qg, ((0, tq), (0, 0), (0, 0), (0, 0)))
    out = jnp.pad(out, ((0, tq), (0, 0), (0, 0), (0, 0)))
    rows_in_tile = jnp.arange(tq, dtype=jnp.int32)

    def tile(j, out):
        r = jnp.sum(tile_ends <= j).astype(jnp.int32)  # the sequence of tile j
        offset = (j - (tile_ends[r] - tiles[r])) * tq  # first row of the tile in the sequence
        start = cu_q_lens[r] + offset
        n = jnp.minimum(tq, covered[r] - offset)
        first_pos = kv_lens[r] - q_lens[r] + offset
        pos = first_pos + rows_in_tile  # [tq]
        ok = rows_in_tile < n
        q_tile = lax.dynamic_slice_in_dim(qg, start, tq).transpose(1, 0, 2, 3)
        q_tile = q_tile.reshape(num_kv_heads, tq * group, head_dim)  # [K, tq * G, H]
        seq_table = table[r]

        def chunk(i, carry):
            ids = lax.dynamic_slice_in_dim(seq_table, i * pages, pages)
            k = k_pages[:, ids].reshape(num_kv_heads, width, head_dim)
            v = v_pages[:, ids].reshape(num_kv_heads, width, head_dim)
            s = _scores(q_tile, k, "KMH,KCH->KMC", sm_scale, soft_cap)  # M = tq * G
            c_pos = i * width + jnp.arange(width, dtype=jnp.int32)
            mask = (c_pos[None, :] <= pos[:, None]) & ok[:, None]  # [tq, C]
            if sliding_window is not None:
                mask &= c_pos[None, :] > pos[:, None] - sliding_window
            mask = jnp.repeat(mask, group, axis=0)[None]  # [1, tq * G, C]
            s = jnp.where(mask, s, _MASK_VALUE)
            return _online_softmax_step(carry, s, v.astype(jnp.float32), mask, "KMC,KCH->KMH")

        hi = -(-(first_pos + n) // width)
        lo = _first_chunk(first_pos, width, sliding_window)
        carry = lax.fori_loop(lo, hi, chunk, _init_carry((num_kv_heads, tq * group), head_dim))
        res = _finish(carry).reshape(num_kv_heads, tq, group, head_dim).transpose(1, 0, 2, 3)
        old = lax.dynamic_slice_in_dim(out, start, tq)
        new = jnp.where(ok[:, None, None, None], res, old)
        return lax.dynamic_update_slice_in_dim(out, new, start, axis=0)

    return lax.fori_loop(0, tile_ends[-1], tile, out)[:num_tokens]


def _check_options(q: jax.Array, k_pages: jax.Array, row_kernel: str, **tunables: object) -> None:
    """Raise ValueError for a tunable (named) that is neither None nor a positive int, an
    unknown row_kernel, or row_kernel="cpu" with a non-f32 q or pages."""
    for name, value in tunables.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if row_kernel not in ROW_KERNELS:
        raise ValueError(f"row_kernel must be one of {ROW_KERNELS}, got {row_kernel!r}")
    if row_kernel == "cpu" and (q.dtype != jnp.float32 or k_pages.dtype != jnp.float32):
        raise ValueError(
            f'row_kernel="cpu" needs float32 q and pages, got {q.dtype} and {k_pages.dtype}'
        )


def _chunk_tables(
    block_tables: jax.Array,  # i32[R, B]
    page_size: int,
    pages_per_chunk: int | None,
    tile_pages_per_chunk: int | None,
) -> tuple[int, int, jax.Array]:
    """(pages per chunk of the row pass, of the tile pass, the block table padded with page 0
    to a width both divide); a chunk size left None comes from chunk_pages."""
    table_width = block_tables.shape[1]
    row_pages = pages_per_chunk or chunk_pages(ROW_CHUNK_POSITIONS, page_size, table_width)
    tile_pages = tile_pages_per_chunk or chunk_pages(TILE_CHUNK_POSITIONS, page_size, table_width)
    # Both chunk sizes divide the padded width (powers of two, the larger a multiple).
    padded_width = -(-table_width // max(row_pages, tile_pages)) * max(row_pages, tile_pages)
    table = jnp.pad(block_tables, ((0, 0), (0, padded_width - table_width)))
    return row_pages, tile_pages, table


def _split_rows(
    kv_lens: jax.Array,  # i32[R]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
    tq: int,
) -> tuple[jax.Array, ...]:
    """Which query rows the tile pass (tiles of tq rows) and the row pass take.

    Returns:
        (real, tiles, covered, seq, q_pos, needed): real bool[R], the slots below num_seqs;
        tiles i32[R], each sequence's tiles, covering its first covered[s] rows (i32[R]);
        seq i32[T], each row's sequence; q_pos i32[T], its position in that sequence's
        context; needed i32[T], the context positions a row-pass row attends to (0 for a
        padding row or one in a tile).
    """
    num_slots = kv_lens.shape[0]
    real = jnp.arange(num_slots) < num_seqs[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    # Tiles take each sequence's full tiles, and its remainder when that fills more than a
    # quarter of a tile; the rest (decodes, short chunks, small remainders) goes to the row
    # pass, so a tile never computes more than 4x its real rows.
    remainder = q_lens % tq
    tiles = jnp.where(real, q_lens // tq + (remainder * 4 > tq), 0)
    covered = jnp.minimum(tiles * tq, q_lens)  # [R] rows of each sequence in the tile pass
    seq = token_seq_ids(cu_q_lens, num_tokens)  # i32[T]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    q_pos = kv_lens[seq] - q_lens[seq] + (rows - cu_q_lens[seq])  # i32[T]
    valid = (rows < cu_q_lens[num_seqs[0]]) & real[seq]
    in_tile = rows - cu_q_lens[seq] < covered[seq]
    needed = jnp.where(valid & ~in_tile, q_pos + 1, 0)
    return real, tiles, covered, seq, q_pos, needed


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "pages_per_chunk", "rows_per_block",
        "tile_rows", "tile_pages_per_chunk", "row_kernel",
    ),
)  # fmt: skip
def ragged_paged_attention_chunked(
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
    pages_per_chunk: int | None = None,
    rows_per_block: int = ROWS_PER_BLOCK,
    tile_rows: int = TILE_ROWS,
    tile_pages_per_chunk: int | None = None,
    row_kernel: str = "xla",
    k_scale: jax.Array | None = None,  # f32[] (kv_quant.py; None: 1)
    v_scale: jax.Array | None = None,  # f32[]
) -> jax.Array:  # [T, N, H]
    """See the module docstring. Tunables (static): pages_per_chunk / rows_per_block for the
    row pass, tile_pages_per_chunk / tile_rows for the tile pass; chunk defaults come from
    ROW_CHUNK_POSITIONS and TILE_CHUNK_POSITIONS. row_kernel: "xla" (the row pass above) or
    "cpu" (the C++ kernel; f32 q and pages, CPU only).

    FP8 pages are gathered as FP8 (a chunk at a time) and cast to f32 after the gather; the
    scales multiply the f32 queries (k_scale) and the f32 output (v_scale), see kv_quant.py.

    Raises:
        ValueError: bad shapes / dtypes / options (validation.py), an unknown row_kernel, or
            row_kernel="cpu" with a non-f32 q or pages.
        RuntimeError: row_kernel="cpu" when the C++ kernel cannot be built here.
    """
    validate_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_options(
        q, k_pages, row_kernel, pages_per_chunk=pages_per_chunk, rows_per_block=rows_per_block,
        tile_rows=tile_rows, tile_pages_per_chunk=tile_pages_per_chunk,
    )  # fmt: skip
    qg = q.reshape(q.shape[0], k_pages.shape[0], -1, q.shape[2])  # [T, K, G, H]
    qg = qg.astype(jnp.float32)
    if k_scale is not None:
        qg = qg * k_scale  # q . (k_scale * k) as (k_scale * q) . k, in f32
    tunables = dict(pages_per_chunk=pages_per_chunk, rows_per_block=rows_per_block,
                    tile_rows=tile_rows, tile_pages_per_chunk=tile_pages_per_chunk)  # fmt: skip
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    out = _both_passes(
        qg, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        row_kernel=row_kernel, tunables=tunables, options=options,
    ).reshape(q.shape)  # fmt: skip
    if v_scale is not None:
        out = out * v_scale  # softmax . (v_scale * v) as (softmax . v) * v_scale, in f32
    return out.astype(q.dtype)


def _both_passes(
    qg: jax.Array,  # f32[T, K, G, H], k_scale applied
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    row_kernel: str,
    tunables: dict,  # pages_per_chunk, rows_per_block, tile_rows, tile_pages_per_chunk
    options: dict,  # sm_scale, sliding_window, soft_cap
) -> jax.Array:  # f32[T, K, G, H], before v_scale
    """The row pass (the XLA rows or the C++ kernel) over the rows the tiles leave, then the
    tile pass over the rest (ragged_paged_attention_chunked's arguments)."""
    num_tokens = qg.shape[0]
    row_pages, tile_pages, table = _chunk_tables(
        block_tables, k_pages.shape[2], tunables["pages_per_chunk"],
        tunables["tile_pages_per_chunk"],
    )  # fmt: skip
    tq = min(tunables["tile_rows"], num_tokens)
    real, tiles, covered, seq, q_pos, needed = _split_rows(
        kv_lens, cu_q_lens, num_seqs, num_tokens, tq
    )
    if row_kernel == "cpu":
        flat = qg.reshape(num_tokens, -1, qg.shape[3])  # [T, N, H]
        out = cpu_rows_attention(
            flat, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
            jnp.where(real, covered, 0), **options,
        ).reshape(qg.shape)  # fmt: skip
    else:
        out = _row_pass(
            qg, k_pages, v_pages, table[seq], q_pos, needed, pages=row_pages,
            rows_per_block=tunables["rows_per_block"], **options,
        )  # fmt: skip
    return _tile_pass(
        qg, out, k_pages, v_pages, table, kv_lens, cu_q_lens, tiles, covered, pages=tile_pages,
        tq=tq, **options,
    )  # fmt: skip
