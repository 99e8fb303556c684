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

The program's body is tpu_kernel.py; this module holds its configuration and the call.
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
from jaxserve.pallas_kernels.ragged_paged_attention.tpu_kernel import attention_kernel
from jaxserve.pallas_kernels.ragged_paged_attention.validation import validate_inputs

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
        attention_kernel,
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
