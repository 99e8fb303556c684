"""Static input checks shared by every ragged paged attention kernel.

Everything here runs at trace time on shapes, dtypes and Python scalars, so a bad call fails
before anything is compiled or allocated. Values inside the arrays (lengths, block ids) are data
and cannot be checked without a device round trip; their contract is in reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import FP8_DTYPES

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# KV pages: a float dtype (the model's), or an FP8 KV cache (kv_quant.py).
KV_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate_inputs(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, S, P, H]
    v_pages: jax.Array,  # [K, S, P, H]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, B]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: jax.Array | None = None,  # f32[] or None (kv_quant.py)
    v_scale: jax.Array | None = None,  # f32[] or None
) -> None:
    """Check the shapes, dtypes and static options of one ragged paged attention call.

    Raises:
        ValueError: naming the argument, the value found and the limit it breaks.
    """
    _check_pages(q, k_pages, v_pages)
    _check_scales(k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, kv_head_dim = k_pages.shape
    _require(num_tokens >= 1, f"q must hold at least one token row, got T={num_tokens}")
    _require(
        kv_head_dim == head_dim,
        f"k_pages head dim {kv_head_dim} must equal q head dim {head_dim}",
    )
    _require(
        num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
        f"q heads N={num_q_heads} must be a multiple of kv heads K={num_kv_heads}",
    )
    _require(num_pages >= 1, f"k_pages must hold at least one page, got S={num_pages}")
    _check_metadata(kv_lens, block_tables, cu_q_lens, num_seqs)
    _require(sm_scale > 0, f"sm_scale must be > 0, got {sm_scale}")
    _require(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window must be None or >= 1, got {sliding_window}",
    )
    _require(soft_cap is None or soft_cap > 0, f"soft_cap must be None or > 0, got {soft_cap}")


def _check_pages(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> None:
    """Raise ValueError unless q is [T, N, H] in a float dtype and the KV pages are
    [K, S, P, H], alike in shape and dtype, in a KV dtype."""
    _require(q.ndim == 3, f"q must be [T, N, H], got shape {q.shape}")
    _require(k_pages.ndim == 4, f"k_pages must be [K, S, P, H], got shape {k_pages.shape}")
    _require(
        v_pages.shape == k_pages.shape,
        f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}",
    )
    _require(
        v_pages.dtype == k_pages.dtype,
        f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}",
    )
    _require(q.dtype in FLOAT_DTYPES, f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    _require(
        k_pages.dtype in KV_DTYPES,
        f"k_pages dtype must be one of {KV_DTYPES}, got {k_pages.dtype}",
    )


def _check_scales(k_scale: jax.Array | None, v_scale: jax.Array | None) -> None:
    """Raise ValueError unless the KV scales are both None or both float32 scalars."""
    _require(
        (k_scale is None) == (v_scale is None),
        "k_scale and v_scale must be given together (or neither: scales of 1), got "
        f"k_scale={'None' if k_scale is None else 'an array'}, "
        f"v_scale={'None' if v_scale is None else 'an array'}",
    )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            shape, dtype = jnp.shape(scale), jnp.result_type(scale)
            _require(
                shape == () and dtype == jnp.float32,
                f"{name} must be a float32 scalar (shape ()), got {dtype}{list(shape)}",
            )


def _check_metadata(
    kv_lens: jax.Array, block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array
) -> None:
    """Raise ValueError unless block_tables is [R, B] with B >= 1 and every metadata array is
    int32 in its shape for those R slots."""
    _require(block_tables.ndim == 2, f"block_tables must be [R, B], got {block_tables.shape}")
    num_slots, width = block_tables.shape
    _require(width >= 1, f"block_tables width B must be >= 1, got {width}")
    for name, arr, shape in (
        ("kv_lens", kv_lens, (num_slots,)),
        ("block_tables", block_tables, (num_slots, width)),
        ("cu_q_lens", cu_q_lens, (num_slots + 1,)),
        ("num_seqs", num_seqs, (1,)),
    ):
        _require(arr.shape == shape, f"{name} must have shape {shape}, got {arr.shape}")
        _require(arr.dtype == jnp.int32, f"{name} must be int32, got {arr.dtype}")


def require_power_of_two(name: str, value: int, minimum: int) -> None:
    """Raise ValueError unless value is a power of two and >= minimum (Triton tile shapes)."""
    ok = value >= minimum and value & (value - 1) == 0
    _require(ok, f"{name} must be a power of two >= {minimum}, got {value}")
