"""Ragged paged attention for NVIDIA Hopper (sm_90a): a Pallas Mosaic GPU kernel.

Semantics and signature are those of reference.py. Mosaic GPU is the supported GPU Pallas
backend; gpu.py lowers through the deprecated Triton backend.

One module of about 800 lines, past the project's 400: the host-side tile plan (_plan_tiles,
the query-tile gather and the output rows), the SMEM / barrier layout and the kernel body that
reads them share one set of constants and index conventions, and the tests check them against
each other; split, each part would be unreadable without the others.

Glossary (reference.py): T tokens, R sequence slots, N query heads, K kv heads, G = N / K,
H head dim, S pages, P page size, B block-table width. Here also: M = 64 query rows per
tile (one warpgroup WGMMA), Qb query tiles, Ms query rows stored per tile, W = block_kv.

Work layout:

    grid = (Qb, K, splits)   query tiles, kv heads, flash-decoding splits of the KV range

One CTA is one warpgroup (128 threads) working on a tile of M = 64 query rows: row r is
token r // G, query head r % G of the CTA's kv head. The G heads of a kv head share every K/V
page in shared memory, so a page is read once per query tile, not once per head (GQA).
A tile holds block_q <= 64 // G tokens of ONE sequence. The plan (_plan_tiles, plain jnp run by
XLA before the kernel) numbers the tiles of each sequence consecutively: sequence s owns
cdiv(q_len_s, block_q) tiles, so Qb = cdiv(T, block_q) + R bounds any batch; unused tiles exit
at once. Padding rows (past cu_q_lens[num_seqs]) get no tile and come out as zeros.

The wrapper gathers q into the tile layout [K, Qb * Ms, H] (Ms = block_q * G rounded up to 8),
so a CTA's query tile and output tile are plain rectangles moved by TMA, and gathers the
output back to [T, N, H]. Both gathers are XLA ops on O(T * N * H) elements, small next to
the K/V traffic of any real batch.

Pipeline (per CTA). The query tile is copied once into shared memory (SMEM). The KV range its
rows can see (sliding window start to the causal limit of its last row, never past kv_len
nor past B * P) is cut into steps of W = block_kv tokens = W / P pages. Each page of a step is
one TMA copy k_pages[kv_head, block_tables[seq, page]] -> a P-row slice of one of num_stages
SMEM buffers; one mbarrier per buffer (and per K / V) counts the W / P copies. Up to
num_stages steps are in flight; a buffer is refilled as soon as both WGMMAs reading it
(S = Q K^T, then P V) have completed. In the last step, slots past the tile's needed pages
re-read its last needed page (an L2 hit) instead of reading past kv_len; those columns are
masked. So every buffer row holds finite data from real pages, and every step issues the same
number of copies (the mbarrier arrival count is static). Online softmax (running max and sum
per row, base-2 exponentials) runs in registers in the WGMMA accumulator layout; the mask is
causal (row position), sliding window and row validity. With splits > 1 each split writes
its normalised f32 partial output and log-sum-exp, merged by a jnp combine step.

Supported, everything else refused with a ValueError:
    FP8 KV pages (kv_quant.py) and KV scales are refused: WGMMA would need FP8 for both
        operands, or a cast of every K / V tile from SMEM through registers back to SMEM, which
        this kernel does not do. The registry refuses it for an FP8 KV cache (Triton runs).
    dtypes: q, k_pages, v_pages all bfloat16 or all float16 (WGMMA operand types). float32 is
        refused: Hopper tensor cores take f32 only as tf32 (10-bit mantissa, a silent
        precision loss against the f32 reference) and only K-major, which P V with V pages
        in SMEM is not. Use the "xla" or "pallas_triton" backend for float32.
    H in {64, 128}; P a multiple of 8 dividing W (16, 32, 64, 128 with the default W = 128);
    G = N / K <= 64. The chip is the registry's to check, from the execution plan's Target
        (kernels.py): compute capability 9.0 (Hopper: H100/H200/GH200; WGMMA does not exist on
        Blackwell, sm_100, which would need a tcgen05 kernel), and not CUDA runtimes 12.8.0 to
        12.9.0, whose ptxas miscompiles score masks of this kind (jax's own Mosaic GPU flash
        attention refuses causal masking there). The kernel itself probes no device.

The kernel is lowered with Lane semantics, set explicitly: jax 0.11 changed the default to
Warpgroup semantics.

Testing without a GPU: jax.export lowers the kernel for CUDA on CPU (the whole Pallas -> Mosaic
GPU MLIR path for sm_90a; only the final MLIR -> PTX -> SASS compilation needs the GPU).
interpret=True runs the kernel in jax's Mosaic GPU interpret mode on CPU, which simulates SMEM,
TMA copies and mbarriers (a wrong arrival count deadlocks there as it would on the GPU). That
interpreter has no WGMMA with a transposed or register operand, so in interpret mode the two
matmuls are jnp dots of the same SMEM tiles and register layouts are not applied; everything
else is the code that runs on the GPU. (tests/pallas_kernels/test_rpa_mosaic_gpu.py also runs
the WGMMA path itself in the interpreter, through a test-only shim of jax 0.10's internals.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import is_fp8
from jaxserve.pallas_kernels.ragged_paged_attention.reference import token_seq_ids
from jaxserve.pallas_kernels.ragged_paged_attention.validation import validate_inputs

try:  # Mosaic GPU Pallas; guarded so that importing this module never fails.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None

try:  # GPU interpret mode: a private module (jax >= 0.10).
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - depends on the installed jax
    InterpretGPUParams = None

MASK_VALUE = -1e30  # finite, so that fully masked rows never produce inf - inf
LOG2E = math.log2(math.e)
DEFAULT_NUM_CORES = 132  # H100/H200 SM count; used when the plan gives none
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)
TILE_ROWS = 64  # M: query rows per CTA, the M of one warpgroup's WGMMA
SMEM_BUDGET = 220 * 1024  # dynamic SMEM we let one CTA use (the sm_90 maximum is 227 KiB)
_SWIZZLE_BYTES = 128  # SMEM swizzle of WGMMA operands: rows of 128 bytes
_META_FIELDS = 8  # columns of the plan table the kernel reads (6 used, 8 for alignment)
# Plan table columns (see TilePlan).
SEQ, FIRST_POS, NUM_TOKENS, STEP_LO, STEP_HI, PAGE_END = range(6)


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
    """Tuning of the Mosaic GPU kernel; every field is a static (compile-time) choice.

    block_q: query tokens per tile; block_q * G must be <= 64 (one WGMMA M of query rows).
    block_kv: W, KV tokens per pipeline step (the N of S = Q K^T): a multiple of 64 in
        [64, 256], and of the page size P.
    num_stages: K/V buffers in shared memory, >= 2 (double buffering or deeper).
    num_kv_splits: flash-decoding parts of each tile's KV range (1: no split, no combine).
    approx_math: let Mosaic GPU use approximate exp2/tanh/log2 (faster, less exact).
    """

    block_q: int
    block_kv: int = 128
    num_stages: int = 2
    num_kv_splits: int = 1
    approx_math: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.block_q <= TILE_ROWS:
            raise ValueError(f"block_q must be in [1, {TILE_ROWS}], got {self.block_q}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"block_kv must be a multiple of 64 in [64, 256], got {self.block_kv}")
        if not 2 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [2, 8], got {self.num_stages}")
        if self.num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {self.num_kv_splits}")


def stored_rows(block_q: int, group: int) -> int:
    """Ms: the rows of a tile that can hold queries (block_q * G), rounded up to the 8-row
    granule of TMA boxes and SMEM tiles."""
    return -(-block_q * group // 8) * 8


def smem_bytes(config: MosaicGpuConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory one CTA allocates: query tile, K and V rings, f32 staging when split.

    Args:
        config: the kernel config.
        head_dim: H.
        itemsize: bytes per q/K/V element.

    Returns:
        Bytes of dynamic SMEM (barriers, a few bytes, not counted).
    """
    total = TILE_ROWS * head_dim * itemsize  # query tile, reused for the output tile
    total += 2 * config.num_stages * config.block_kv * head_dim * itemsize  # K and V rings
    if config.num_kv_splits > 1:
        total += TILE_ROWS * head_dim * 4 + TILE_ROWS * 4  # f32 output tile, log-sum-exp
    return total


def default_mosaic_gpu_config(
    q_shape: tuple[int, int, int],  # (T, N, H)
    kv_shape: tuple[int, int, int, int],  # (K, S, P, H)
    table_shape: tuple[int, int],  # (R, B)
    num_cores: int = DEFAULT_NUM_CORES,
    itemsize: int = 2,
) -> MosaicGpuConfig:
    """Pick a config from static shapes.

    Args:
        q_shape: (T, N, H) of q.
        kv_shape: (K, S, P, H) of k_pages.
        table_shape: (R, B) of block_tables.
        num_cores: SMs of the target GPU (sets the flash-decoding split count).
        itemsize: bytes per q/K/V element.

    Returns:
        Full query tiles (block_q = 64 // G); W = 128-token KV steps (64 when the tables
        span at most 64 tokens; 256 or 192 for pages that 128 does not fit); as many stages
        (2 to 4) as fit the SMEM budget; and, for decode-heavy batches (T <= 4 R) too small
        to give each SM two busy CTAs, up to 16 KV splits.
    """
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, _, page_size, _ = kv_shape
    num_slots, width = table_shape
    group = max(1, num_q_heads // max(1, num_kv_heads))
    block_q = max(1, TILE_ROWS // group)
    candidates = (64, 128) if width * page_size <= 64 else (128, 64, 256, 192)
    block_kv = next((w for w in candidates if w % page_size == 0), 128)
    splits = 1
    if num_tokens <= 4 * num_slots:  # decode-heavy: about one busy tile per sequence
        busy_ctas = max(1, num_slots * num_kv_heads)
        wanted = -(-2 * num_cores // busy_ctas)
        splits = max(1, min(16, wanted, (width * page_size) // (2 * block_kv)))
    config = MosaicGpuConfig(block_q=block_q, block_kv=block_kv, num_kv_splits=splits)
    stage_bytes = 2 * block_kv * head_dim * itemsize
    fixed = smem_bytes(config, head_dim, itemsize) - config.num_stages * stage_bytes
    stages = max(2, min(4, (SMEM_BUDGET - fixed) // stage_bytes))
    return dataclasses.replace(config, num_stages=stages)


class TilePlan(NamedTuple):
    """Where each query tile sits in the ragged batch (from _plan_tiles; all int32).

    meta: [Qb, 8] the kernel's table. Columns: SEQ the tile's sequence slot; FIRST_POS the
        context position of its first token; NUM_TOKENS its real tokens (0: unused tile);
        STEP_LO, STEP_HI the KV steps [lo, hi) of W tokens its rows can see; PAGE_END the
        pages [0, page_end) of the sequence it may read.
    start: [Qb] the q row of each tile's first token.
    cu_tiles: [R + 1] tiles of sequence slot s are cu_tiles[s] : cu_tiles[s + 1].
    """

    meta: jax.Array
    start: jax.Array
    cu_tiles: jax.Array


def _plan_tiles(
    kv_lens: jax.Array,  # i32[R]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    num_tokens: int,
    block_q: int,
    block_kv: int,
    page_size: int,
    width: int,
    sliding_window: int | None,
) -> TilePlan:
    """Cut each real sequence's query rows into tiles of block_q tokens and find the KV
    steps and pages each tile needs.

    Args:
        kv_lens, cu_q_lens, num_seqs: as in reference.py.
        num_tokens: T.
        block_q: tokens per tile.
        block_kv: W, tokens per KV step.
        page_size: P.
        width: B, the block-table width.
        sliding_window: as in reference.py.

    Returns:
        The TilePlan of Qb = cdiv(T, block_q) + R tiles.
    """
    num_slots = kv_lens.shape[0]
    num_tiles = -(-num_tokens // block_q) + num_slots
    real = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs[0]
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(real, jnp.maximum(cu_q_lens[1:] - q_start, 0), 0)  # i32[R]
    tiles_per_seq = -(-q_len // block_q)
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq)])
    cu_tiles = cu_tiles.astype(jnp.int32)  # i32[R + 1]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # The owner is the last slot whose first tile is <= tile (slots without tiles skipped).
    seq = jnp.searchsorted(cu_tiles, tile, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_slots - 1)  # i32[Qb]
    local = tile - cu_tiles[seq]  # tile index within its sequence
    start = q_start[seq] + local * block_q
    active = tile < cu_tiles[num_slots]
    num_tok = jnp.where(active, jnp.clip(q_start[seq] + q_len[seq] - start, 0, block_q), 0)
    # Query row i of a sequence sits at context position kv_len - q_len + i.
    first_pos = kv_lens[seq] - q_len[seq] + local * block_q
    # The reference reads positions < B * P only, and the last row sees the most.
    last_pos = jnp.minimum(first_pos + num_tok - 1, width * page_size - 1)
    kv_hi = jnp.where(num_tok > 0, jnp.maximum(last_pos + 1, 0), 0)  # exclusive
    kv_lo = jnp.zeros_like(kv_hi)
    if sliding_window is not None:  # the first row sees the lowest positions
        kv_lo = jnp.maximum(first_pos - sliding_window + 1, 0)
    step_lo = kv_lo // block_kv
    # No step at all when the window starts past the last position the tile may read.
    step_hi = jnp.where(kv_hi > kv_lo, -(-kv_hi // block_kv), step_lo)
    page_end = -(-kv_hi // page_size)
    columns = [seq, first_pos, num_tok, step_lo, step_hi, page_end]
    columns += [jnp.zeros_like(seq)] * (_META_FIELDS - len(columns))
    return TilePlan(meta=jnp.stack(columns, axis=1), start=start, cu_tiles=cu_tiles)


def _gather_query_tiles(
    q: jax.Array,  # [T, N, H]
    plan: TilePlan,
    *,
    num_kv_heads: int,
    block_q: int,
) -> jax.Array:  # [K, Qb * Ms + M - Ms, H]
    """Lay q out tile by tile: row r of tile b, kv head k, is query head k * G + r % G of
    token start[b] + r // G, or zeros where that is not one of the tile's tokens. M - Ms zero
    rows at the end keep the last tile's M-row TMA load in bounds."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = stored_rows(block_q, group)
    r = jnp.arange(rows, dtype=jnp.int32)
    token_off, head = r // group, r % group  # i32[Ms]
    token = plan.start[:, None] + token_off[None, :]  # i32[Qb, Ms]
    valid = token_off[None, :] < plan.meta[:, NUM_TOKENS, None]  # implies r < block_q * G
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    tiles = qg[jnp.clip(token, 0, num_tokens - 1), :, head[None, :], :]  # [Qb, Ms, K, H]
    tiles = jnp.where(valid[:, :, None, None], tiles, jnp.zeros((), q.dtype))
    tiles = tiles.transpose(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim)  # [K, Qb*Ms, H]
    return jnp.pad(tiles, ((0, 0), (0, TILE_ROWS - rows), (0, 0)))


def _output_rows(
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    plan: TilePlan,
    *,
    num_tokens: int,
    group: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array]:
    """Where each token's output sits in the tile layout.

    Returns:
        (rows i32[T, G], valid bool[T]): the tile-layout rows of each token's G heads (0 for
        padding rows), and whether the token is a real query row.
    """
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = token_seq_ids(cu_q_lens, num_tokens)  # i32[T]
    valid = (token < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])
    local = token - cu_q_lens[seq]  # row within its sequence
    tile = plan.cu_tiles[seq] + local // block_q
    first = tile * stored_rows(block_q, group) + (local % block_q) * group
    rows = first[:, None] + jnp.arange(group, dtype=jnp.int32)[None, :]
    return jnp.where(valid[:, None], rows, 0), valid


def _combine_splits(
    out: jax.Array,  # f32[splits, K, T, G, H] normalised partial outputs
    lse: jax.Array,  # f32[splits, K, T, G] log2 of each split's softmax mass (MASK: none)
) -> jax.Array:  # f32[K, T, G, H]
    """Merge flash-decoding partials: split j holds a share 2^lse_j of the row's mass."""
    top = lse.max(axis=0, keepdims=True)
    weight = jnp.where(lse > MASK_VALUE / 2, jnp.exp2(lse - top), 0.0)  # [splits, K, T, G]
    denom = weight.sum(axis=0)  # zero only for rows that see no position at all
    merged = (out * weight[..., None]).sum(axis=0)
    return merged / jnp.where(denom > 0, denom, 1.0)[..., None]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static facts of one kernel instantiation, closed over by the kernel body."""

    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    group: int
    page_size: int
    width: int
    num_pages: int
    config: MosaicGpuConfig
    interpret: bool

    @property
    def pages_per_step(self) -> int:
        return self.config.block_kv // self.page_size

    @property
    def rows(self) -> int:
        return stored_rows(self.config.block_q, self.group)


def _in_layout(st: _Static, x: jax.Array) -> jax.Array:
    """x in the WGMMA accumulator register layout ([M, n]) or its per-row reduction ([M]).
    Identity in interpret mode (layout_cast has no CPU rule)."""
    if st.interpret:
        return x
    layout = plgpu.Layout.WGMMA if x.ndim == 2 else plgpu.Layout.WGMMA.reduce(1)
    return plgpu.layout_cast(x, layout)


def _iota(st: _Static, shape: tuple[int, ...], dimension: int) -> jax.Array:
    """i32 iota along `dimension`, in the layout _in_layout gives that shape."""
    return _in_layout(st, lax.broadcasted_iota(jnp.int32, shape, dimension))


def _scores(st: _Static, q_smem, k_smem, slot) -> jax.Array:  # f32[M, W]
    """Q K^T of one KV step: a WGMMA reading K transposed from its SMEM buffer."""
    if st.interpret:  # the GPU interpreter has no transposed WGMMA operand
        k = k_smem.at[slot][...]
        return jnp.dot(q_smem[...], k.T, preferred_element_type=jnp.float32)

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return acc_ref[...]  # reading the accumulator waits for the WGMMA

    return pl.run_scoped(scope, plgpu.ACC((TILE_ROWS, st.config.block_kv), jnp.float32))


def _weighted_values(st: _Static, p: jax.Array, v_smem, slot) -> jax.Array:  # f32[M, H]
    """P V of one KV step: a WGMMA with P from registers and V from its SMEM buffer."""
    if st.interpret:  # the GPU interpreter has no register WGMMA operand
        return jnp.dot(p, v_smem.at[slot][...], preferred_element_type=jnp.float32)

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((TILE_ROWS, v_smem.shape[-1]), jnp.float32))


def _row_bounds(
    st: _Static, first_pos: jax.Array, num_tok: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """(row_hi, row_lo), i32[M] in the row layout: row r of the tile (token r // G) sees
    context positions row_lo[r] <= col <= row_hi[r]; row_lo is None without a window.
    Rows that are not real tokens of the tile get row_hi = -1 and see nothing."""
    token = lax.div(_iota(st, (TILE_ROWS,), 0), jnp.int32(st.group))
    pos = first_pos + token
    # Causal limit, capped like the reference that reads positions < B * P only.
    row_hi = jnp.where(token < num_tok, jnp.minimum(pos, st.width * st.page_size - 1), -1)
    if st.sliding_window is None:
        return row_hi, None
    return row_hi, pos - (st.sliding_window - 1)  # col > pos - window


def _online_softmax_step(
    st: _Static,
    s: jax.Array,  # f32[M, W] raw scores Q K^T
    step: jax.Array,  # KV step index: columns are positions step * W + c
    row_hi: jax.Array,  # i32[M]
    row_lo: jax.Array | None,  # i32[M]
    m_prev: jax.Array,  # f32[M] running max (log2 domain)
    l_prev: jax.Array,  # f32[M] running sum
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Mask and exponentiate one step's scores.

    Returns:
        (p f32[M, W], alpha f32[M], m_next, l_next): the step's probabilities (unnormalised,
        0 where masked), the factor rescaling the previous accumulator, and the new
        running max and sum.
    """
    shape = s.shape
    # Scale into the log2 domain once so that exp2 (the native instruction) applies.
    if st.soft_cap is None:
        s = s * (st.sm_scale * LOG2E)
    else:
        s = (st.soft_cap * LOG2E) * jnp.tanh(s * (st.sm_scale / st.soft_cap))
    col = step * st.config.block_kv + _iota(st, shape, 1)
    mask = col <= lax.broadcast_in_dim(row_hi, shape, [0])
    if row_lo is not None:
        mask = mask & (col >= lax.broadcast_in_dim(row_lo, shape, [0]))
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    # Fully masked rows keep m = MASK_VALUE, where exp2(s - m) would be 1: select 0 instead.
    p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_next, shape, [0])), 0.0)
    l_next = l_prev * alpha + p.sum(axis=1)
    return p, alpha, m_next, l_next


def _split_steps(
    first_step: jax.Array, end_step: jax.Array, split: jax.Array, splits: int
) -> tuple[jax.Array, jax.Array]:
    """(step_lo, num_steps): split `split`'s share of the tile's KV steps [first, end), in
    `splits` consecutive parts of cdiv(end - first, splits) steps (the last ones may be
    shorter or empty)."""
    per_split = lax.div(end_step - first_step + (splits - 1), jnp.int32(splits))
    step_lo = first_step + split * per_split
    num_steps = jnp.maximum(jnp.minimum(step_lo + per_split, end_step) - step_lo, 0)
    return step_lo, num_steps


def _start_step_copies(
    st: _Static,
    tables_ref,  # GMEM i32[R, B]
    kv_hbm: tuple[Any, Any],  # GMEM K, V pages [K, S, P, H]
    kv_smem: tuple[Any, Any],  # SMEM K, V rings [stages, W, H]
    kv_bars: tuple[Any, Any],  # K, V mbarriers [stages]
    *,
    kv_head: jax.Array,
    seq: jax.Array,
    page_end: jax.Array,
    step: jax.Array,
    slot: jax.Array | int,
) -> None:
    """Start the TMA copies of KV step `step` (pages step * W / P + i) into ring buffer
    `slot`: one copy per page and K / V, each arriving on the slot's mbarrier."""
    for i in range(st.pages_per_step):
        # Slots past the tile's needed pages re-read its last needed page: never a page
        # past kv_len (nor an unset table entry), and masked columns all the same.
        page_idx = jnp.minimum(step * st.pages_per_step + i, page_end - 1)
        page_id = jnp.clip(tables_ref[seq, page_idx], 0, st.num_pages - 1)
        buffer_rows = pl.ds(i * st.page_size, st.page_size)  # static: page i of the step
        for hbm, smem, bar in zip(kv_hbm, kv_smem, kv_bars, strict=True):
            plgpu.copy_gmem_to_smem(
                hbm.at[kv_head, page_id], smem.at[slot, buffer_rows], bar.at[slot]
            )


def _attention_kernel(
    meta_ref,  # GMEM i32[Qb, 8] the TilePlan table
    tables_ref,  # GMEM i32[R, B]
    q_ref,  # GMEM [K, Qb * Ms + M - Ms, H] query tiles
    k_hbm,  # GMEM [K, S, P, H]
    v_hbm,  # GMEM [K, S, P, H]
    o_ref,  # GMEM [K, Qb * Ms, H] (one split) or f32[splits, K, Qb * Ms, H]
    *refs,  # lse_ref f32[splits, K, Qb * Ms] when split, then the scratch of _scratch_types
    st: _Static,
):
    """One CTA: query tile `tile` of kv head `kv_head`, KV split `split` (module docstring)."""
    splits, stages = st.config.num_kv_splits, st.config.num_stages
    lse_ref, refs = (refs[0], refs[1:]) if splits > 1 else (None, refs)
    q_smem, k_smem, v_smem, *f32_staging, q_bar, k_bar, v_bar = refs
    tile = lax.axis_index("tile")
    kv_head = lax.axis_index("kv_head")
    split = lax.axis_index("split")
    num_tok = meta_ref[tile, NUM_TOKENS]

    @pl.when(num_tok > 0)  # Qb only bounds the tiles: unused ones do nothing
    def _():
        seq, first_pos = meta_ref[tile, SEQ], meta_ref[tile, FIRST_POS]
        step_lo, num_steps = _split_steps(
            meta_ref[tile, STEP_LO], meta_ref[tile, STEP_HI], split, splits
        )
        start_copies = functools.partial(
            _start_step_copies,
            st,
            tables_ref,
            (k_hbm, v_hbm),
            (k_smem, v_smem),
            (k_bar, v_bar),
            kv_head=kv_head,
            seq=seq,
            page_end=meta_ref[tile, PAGE_END],
        )
        # Tile `tile` owns rows [tile * Ms, tile * Ms + Ms) of q_ref; the M-row box also
        # takes the next tile's first rows, which _row_bounds masks out.
        plgpu.copy_gmem_to_smem(
            q_ref.at[kv_head, pl.ds(tile * st.rows, TILE_ROWS)], q_smem, q_bar.at[0]
        )
        for stage in range(stages):  # prologue: fill the ring
            pl.when(stage < num_steps)(
                functools.partial(start_copies, step=step_lo + stage, slot=stage)
            )
        row_hi, row_lo = _row_bounds(st, first_pos, num_tok)
        plgpu.barrier_wait(q_bar.at[0])

        def step_body(i, carry):
            acc, m_prev, l_prev = carry  # f32[M, H], f32[M], f32[M]
            slot = lax.rem(i, jnp.int32(stages))  # step i lives in buffer i % stages
            plgpu.barrier_wait(k_bar.at[slot])
            s = _scores(st, q_smem, k_smem, slot)
            p, alpha, m_next, l_next = _online_softmax_step(
                st, s, step_lo + i, row_hi, row_lo, m_prev, l_prev
            )
            plgpu.barrier_wait(v_bar.at[slot])
            pv = _weighted_values(st, p.astype(q_smem.dtype), v_smem, slot)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

            @pl.when(i + stages < num_steps)  # both WGMMAs reading `slot` are done: refill
            def _():
                start_copies(step=step_lo + i + stages, slot=slot)

            return acc, m_next, l_next

        init = (
            _in_layout(st, jnp.zeros((TILE_ROWS, q_smem.shape[-1]), jnp.float32)),
            _in_layout(st, jnp.full((TILE_ROWS,), MASK_VALUE, jnp.float32)),
            _in_layout(st, jnp.zeros((TILE_ROWS,), jnp.float32)),
        )
        acc, row_max, row_sum = lax.fori_loop(0, num_steps, step_body, init)
        out_rows = pl.ds(tile * st.rows, st.rows)
        if splits == 1:
            _write_output(st, acc, row_sum, q_smem, o_ref.at[kv_head, out_rows])
        else:
            o32_smem, lse_smem = f32_staging
            _write_output(st, acc, row_sum, o32_smem, o_ref.at[split, kv_head, out_rows])
            _write_log_sum_exp(st, row_max, row_sum, lse_smem, lse_ref.at[split, kv_head, out_rows])
        plgpu.wait_smem_to_gmem(0)


def _write_output(st: _Static, acc: jax.Array, row_sum: jax.Array, smem, dst) -> None:
    """Normalise the accumulator (f32[M, H]) and start its TMA store of the stored rows.

    smem is the query tile (every WGMMA reading it is done) or the f32 staging tile. Rows that
    saw nothing have acc = 0 and sum 0: dividing by 1 keeps their zeros."""
    safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
    out = acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])
    smem[...] = out.astype(smem.dtype)
    plgpu.commit_smem()  # make the register stores visible to the TMA engine
    plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, st.rows)], dst)


def _write_log_sum_exp(st: _Static, row_max: jax.Array, row_sum: jax.Array, smem, dst) -> None:
    """Start the TMA store of log2(sum_j 2^s_j) per row (MASK_VALUE: this split saw nothing)."""
    safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
    smem[...] = jnp.where(row_sum > 0, row_max + jnp.log2(safe_sum), MASK_VALUE)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, st.rows)], dst)


def _operand_transforms(dtype: jnp.dtype) -> tuple[Any, ...]:
    """SMEM layout of a WGMMA operand / TMA box: (8, 128 / itemsize) tiles, 128B swizzle."""
    return (
        plgpu.TilingTransform((8, _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(_SWIZZLE_BYTES),
    )


def _scratch_types(st: _Static, head_dim: int, dtype: jnp.dtype) -> list[Any]:
    """SMEM buffers and mbarriers of one CTA, in the order _attention_kernel unpacks them."""
    config = st.config
    ring = (config.num_stages, config.block_kv, head_dim)
    scratch = [
        plgpu.SMEM((TILE_ROWS, head_dim), dtype, transforms=_operand_transforms(dtype)),
        plgpu.SMEM(ring, dtype, transforms=_operand_transforms(dtype)),  # K
        plgpu.SMEM(ring, dtype, transforms=_operand_transforms(dtype)),  # V
    ]
    if config.num_kv_splits > 1:
        f32_tile = (TILE_ROWS, head_dim)
        scratch += [
            plgpu.SMEM(f32_tile, jnp.float32, transforms=_operand_transforms(jnp.float32)),
            plgpu.SMEM((TILE_ROWS,), jnp.float32),
        ]
    # A step's buffer is complete when all of its per-page copies have arrived.
    per_step = dict(num_arrivals=st.pages_per_step, num_barriers=config.num_stages)
    scratch += [plgpu.Barrier(num_barriers=1), plgpu.Barrier(**per_step), plgpu.Barrier(**per_step)]
    return scratch


def _check_supported(q: jax.Array, k_pages: jax.Array, config: MosaicGpuConfig) -> None:
    """Raise ValueError for inputs or targets this kernel does not support (module docstring)."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if plgpu is None:
        raise ValueError("the Mosaic GPU kernel needs jax.experimental.pallas.mosaic_gpu")
    for name, arr in (("q", q), ("k_pages", k_pages)):
        if arr.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} dtype {arr.dtype} is not supported by the Mosaic GPU kernel, which "
                f"takes bfloat16 or float16 (WGMMA operands; float32 would run as tf32 and "
                f"lose precision): use the 'xla' or 'pallas_triton' backend for float32"
            )
    if q.dtype != k_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal k_pages dtype {k_pages.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim H={head_dim} is not supported, only {SUPPORTED_HEAD_DIMS}")
    if group > TILE_ROWS:
        raise ValueError(f"N // K = {group} query heads per kv head must be <= {TILE_ROWS}")
    if config.block_q * group > TILE_ROWS:
        raise ValueError(
            f"block_q * (N // K) = {config.block_q * group} query rows must be <= {TILE_ROWS} "
            f"(block_q={config.block_q})"
        )
    if page_size % 8 or config.block_kv % page_size:
        raise ValueError(
            f"page size P={page_size} must be a multiple of 8 dividing block_kv={config.block_kv}"
        )
    used = smem_bytes(config, head_dim, q.dtype.itemsize)
    if used > SMEM_BUDGET:
        raise ValueError(
            f"config needs {used} bytes of shared memory per CTA, over the {SMEM_BUDGET} "
            f"budget: lower num_stages or block_kv ({config})"
        )


def _interpret_params(interpret: Any) -> Any:
    """plgpu.kernel's `interpret`: None (compile for the GPU) or GPU interpret params."""
    if interpret is False or interpret is None:
        return None
    if InterpretGPUParams is None:
        raise ValueError("interpret mode needs jax's Mosaic GPU interpreter (jax >= 0.10)")
    return InterpretGPUParams() if interpret is True else interpret


def _refuse_fp8(k_pages: jax.Array, k_scale: jax.Array | None) -> None:
    """Raise ValueError for FP8 pages or KV scales: this kernel reads no FP8 KV cache."""
    if is_fp8(k_pages.dtype) or k_scale is not None:
        raise ValueError(
            f"the Mosaic GPU kernel cannot read an FP8 KV cache (k_pages dtype {k_pages.dtype}"
            f"{', KV scales given' if k_scale is not None else ''}): use 'pallas_triton' or 'xla'"
        )


def _resolve_config(
    q: jax.Array,
    k_pages: jax.Array,
    block_tables: jax.Array,
    config: MosaicGpuConfig | None,
    num_cores: int | None,
) -> MosaicGpuConfig:
    """`config`, or when None default_mosaic_gpu_config for these shapes on num_cores SMs
    (None: DEFAULT_NUM_CORES)."""
    if config is not None:
        return config
    return default_mosaic_gpu_config(
        q.shape,
        k_pages.shape,
        block_tables.shape,
        num_cores or DEFAULT_NUM_CORES,
        k_pages.dtype.itemsize,
    )


def _mosaic_kernel(st: _Static, q_tiles: jax.Array, num_tiles: int, interpret_params: Any) -> Any:
    """The plgpu.kernel of _attention_kernel on grid (tile, kv head, split) for q_tiles
    [K, Qb * Ms + M - Ms, H]: its output in the tile layout, [K, Qb * Ms, H] in q's dtype, or
    with splits > 1 each split's f32 partial output [splits, K, Qb * Ms, H] and log-sum-exp
    [splits, K, Qb * Ms]."""
    num_kv_heads, _, head_dim = q_tiles.shape
    config = st.config
    splits = config.num_kv_splits
    tile_rows = num_tiles * st.rows
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((num_kv_heads, tile_rows, head_dim), q_tiles.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((splits, num_kv_heads, tile_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_kv_heads, tile_rows), jnp.float32),
        )
    return plgpu.kernel(
        functools.partial(_attention_kernel, st=st),
        out_type=out_type,
        scratch_types=_scratch_types(st, head_dim, q_tiles.dtype),
        grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(
            approx_math=config.approx_math, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=interpret_params,
        kernel_name="ragged_paged_attention_mosaic_gpu",
    )


def _token_major_output(
    result: Any, rows: jax.Array, valid: jax.Array, q: jax.Array, splits: int
) -> jax.Array:  # [T, N, H]
    """The kernel's tile-layout result (merged across splits) gathered back to [T, N, H] in
    q's dtype, with zeros on padding rows (rows, valid: _output_rows)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if splits == 1:
        out = result[:, rows]  # [K, T, G, H]
    else:
        partial_out, lse = result
        out = _combine_splits(partial_out[:, :, rows], lse[:, :, rows]).astype(q.dtype)
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "config", "num_cores", "interpret"),
)
def ragged_paged_attention_mosaic_gpu(
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
    config: MosaicGpuConfig | None = None,
    num_cores: int | None = None,
    interpret: Any = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:  # [T, N, H]
    """Ragged paged attention on Hopper GPUs (Pallas Mosaic GPU); the contract of
    ragged_paged_attention_reference.

    Args:
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale,
            sliding_window, soft_cap: as in reference.py.
        config: tuning; None picks default_mosaic_gpu_config(...) for these shapes.
        num_cores: SMs of the GPU, for the default config (None: DEFAULT_NUM_CORES).
        interpret: True (or an InterpretGPUParams) runs jax's Mosaic GPU interpret mode on
            the current backend (CPU; slow, for tests); see the module docstring.
        k_scale, v_scale: must be None (no FP8 KV cache here, see the module docstring).

    Returns:
        [T, N, H] in q's dtype; padding rows are zeros.

    Raises:
        ValueError: bad shapes/dtypes/options (validation.py); a dtype other than bfloat16
            or float16 (float32 included), or q and pages of different dtypes; H not in
            {64, 128}; P not a multiple of 8 dividing block_kv; more than 64 query rows per
            tile; a config over the SMEM budget; FP8 pages or KV scales.
    """
    validate_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _refuse_fp8(k_pages, k_scale)
    interpret_params = _interpret_params(interpret)
    config = _resolve_config(q, k_pages, block_tables, config, num_cores)
    _check_supported(q, k_pages, config)
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    st = _Static(
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        group=q.shape[1] // num_kv_heads, page_size=page_size, width=block_tables.shape[1],
        num_pages=num_pages, config=config, interpret=interpret_params is not None,
    )  # fmt: skip
    return _run_kernel(
        st, q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, interpret_params
    )


def _run_kernel(
    st: _Static,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    interpret_params: Any,
) -> jax.Array:  # [T, N, H]
    """Plan the tiles, gather the query tiles, run the kernel and put its output back in token
    order (ragged_paged_attention_mosaic_gpu's arguments, checked)."""
    num_tokens, config = q.shape[0], st.config
    plan = _plan_tiles(
        kv_lens, cu_q_lens, num_seqs, num_tokens=num_tokens, block_q=config.block_q,
        block_kv=config.block_kv, page_size=st.page_size, width=st.width,
        sliding_window=st.sliding_window,
    )  # fmt: skip
    q_tiles = _gather_query_tiles(q, plan, num_kv_heads=k_pages.shape[0], block_q=config.block_q)
    kernel = _mosaic_kernel(st, q_tiles, plan.meta.shape[0], interpret_params)
    result = kernel(plan.meta, block_tables, q_tiles, k_pages, v_pages)
    rows, valid = _output_rows(
        cu_q_lens, num_seqs, plan, num_tokens=num_tokens, group=st.group, block_q=config.block_q
    )
    return _token_major_output(result, rows, valid, q, config.num_kv_splits)
