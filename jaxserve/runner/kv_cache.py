"""Sizing and allocating the paged KV cache: one (K pages, V pages) pair per layer.

The arithmetic of the pool size (weights, the step's workspace, KV bytes per block) is
memory_plan.py's, shared with `jaxserve plan`; this module reads the device's memory and
allocates the pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# (num_layers, page_shape, dtype, sharding) -> [(K pages, V pages)] per layer: how a runner
# gets its pages (allocate_kv_caches, or abstract_kv_caches to compile for another chip).
KVAllocator = Callable[..., list[tuple[Any, Any]]]


def device_memory_bytes(device: jax.Device, cpu_memory_bytes: int) -> int:
    """Memory the engine may plan with on `device`: the allocator's limit on GPU/TPU, the
    configured host budget on CPU (which reports none).

    Raises:
        RuntimeError: a GPU / TPU that reports no bytes_limit.
    """
    if device.platform == "cpu":
        return cpu_memory_bytes
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise RuntimeError(
            f"cannot read the memory limit of {device}; pass num_kv_blocks explicitly"
        )
    return int(limit)


def allocate_kv_caches(
    num_layers: int, page_shape: tuple[int, ...], dtype, sharding=None
) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed [K, S, P, H] K and V pages per layer, placed with `sharding` when given.

    `dtype` is the plan's kv_cache_dtype: the model dtype, or an FP8 dtype (one byte per
    value; the per-layer scales live apart, runner/kv_scales.py), so a page stays a plain
    slice of one array that a block copy moves as raw bytes.
    """

    def zeros():
        return jnp.zeros(page_shape, dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)
    return [(make(), make()) for _ in range(num_layers)]


def abstract_kv_caches(
    num_layers: int, page_shape: tuple[int, ...], dtype, sharding=None
) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """allocate_kv_caches' pages as jax.ShapeDtypeStructs (with their sharding): nothing is
    allocated, for compiling the step ahead of time for devices that are not attached."""
    page = jax.ShapeDtypeStruct(page_shape, jnp.dtype(dtype), sharding=sharding)
    return [(page, page) for _ in range(num_layers)]


def pages_usable(kv_caches: Any) -> bool:
    """Whether every page array is alive and the computation that produced it succeeded (a
    failed step may have donated them to a call whose result was lost, or poisoned them)."""
    leaves = jax.tree.leaves(kv_caches)
    if any(x.is_deleted() for x in leaves):
        return False
    try:
        jax.block_until_ready(leaves)
    except Exception:  # an asynchronous failure of the computation that produced them
        return False
    return True
