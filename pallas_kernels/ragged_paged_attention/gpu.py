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
f32[2] input (ones when no scales are given), so a new scale never recompiles. With soft_fp8
(GPUs below compute capability 8.9, which cannot convert float8_e4m3fn: kv_quant.py) e4m3 pages
enter the call as their bytes (a bitcast, no copy) and the program converts each loaded tile
with integer ops (kv_quant.e4m3fn_from_bits).

Lowering: Triton compiler params select the Triton lowering (Mosaic GPU is the default since
jax 0.9 and would reject this kernel). On CPU, interpret=True runs the same body in XLA.

The program's body is gpu_kernel.py; this module holds its configuration, the call and the
combine step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.ragged_paged_attention.gpu_kernel import attention_kernel
from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import scales_or_ones
from jaxserve.pallas_kernels.ragged_paged_attention.validation import (
    require_power_of_two,
    validate_inputs,
)

try:  # Triton lowering: deprecated from jax 0.11, so guard the import.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None

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
        "soft_fp8",
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
    soft_fp8: bool = False,
    k_scale: jax.Array | None = None,  # f32[] (kv_quant.py; None: 1)
    v_scale: jax.Array | None = None,  # f32[]
) -> jax.Array:  # [T, N, H]
    """Ragged paged attention on GPU (Triton lowering); same contract as the reference.

    Tuning arguments left at None come from default_gpu_config, for a GPU of num_cores
    streaming multiprocessors (None: DEFAULT_NUM_CORES; the execution plan passes the real
    count). interpret=True runs the kernel body in XLA (any backend, slow): the CPU test path.
    soft_fp8=True converts float8_e4m3fn pages with integer ops instead of the cast GPUs below
    sm_89 lack (the execution plan sets it from the target's compute capability).

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
        attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=config.block_q,
        kv_tile=config.kv_tile,
        num_splits=config.num_kv_splits,
    )
    if soft_fp8 and k_pages.dtype == jnp.float8_e4m3fn:
        k_pages = jax.lax.bitcast_convert_type(k_pages, jnp.uint8)
        v_pages = jax.lax.bitcast_convert_type(v_pages, jnp.uint8)
    result = _gpu_call(kernel, q, k_pages, block_tables.shape[0], config, interpret)(
        kv_lens, block_tables, cu_q_lens, num_seqs, q, k_pages, v_pages,
        scales_or_ones(k_scale, v_scale),
    )  # fmt: skip
    if config.num_kv_splits == 1:
        return result
    return _combine_splits(*result, dtype=q.dtype)
