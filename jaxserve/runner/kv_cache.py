"""Sizing and allocating the paged KV cache: one (K pages, V pages) pair per layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def device_memory_bytes(device: jax.Device, cpu_memory_bytes: int) -> int:
    """Memory the engine may plan with on `device`: the allocator's limit on GPU/TPU, the
    configured host budget on CPU (which reports none)."""
    if device.platform == "cpu":
        return cpu_memory_bytes
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise RuntimeError(
            f"cannot read the memory limit of {device}; pass num_kv_blocks explicitly"
        )
    return int(limit)


def params_bytes(params) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))


def num_blocks_for_budget(
    *, budget_bytes: int, weights_bytes: int, bytes_per_block: int, max_useful_blocks: int
) -> int:
    """Blocks (null block included) that fit in budget - weights, capped at what the engine can
    ever hold (max_num_seqs full-length sequences + the null block).

    Raises:
        ValueError: when not even two blocks (the null block and one usable) fit.
    """
    free = budget_bytes - weights_bytes
    num_blocks = min(free // bytes_per_block, max_useful_blocks) if free > 0 else 0
    if num_blocks < 2:
        raise ValueError(
            f"memory for the KV cache: {budget_bytes} bytes budget - {weights_bytes} bytes of "
            f"weights leaves room for {max(num_blocks, 0)} blocks of {bytes_per_block} bytes; "
            "need at least 2: raise memory_utilization or pass num_kv_blocks"
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_layers: int, page_shape: tuple[int, ...], dtype, sharding=None
) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed [K, S, P, H] K and V pages per layer, placed with `sharding` when given."""

    def zeros():
        return jnp.zeros(page_shape, dtype)

    make = jax.jit(zeros, out_shardings=sharding) if sharding is not None else jax.jit(zeros)
    return [(make(), make()) for _ in range(num_layers)]
