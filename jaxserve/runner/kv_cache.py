"""Sizing and allocating the paged KV cache: one (K pages, V pages) pair per layer.

The arithmetic of the pool size (weights, the step's workspace, KV bytes per block) is
memory_plan.py's, shared with `jaxserve plan`; this module reads the device's memory and
allocates the pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.memory_plan import blocks_for_budget


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


def params_bytes(params) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))


def num_blocks_for_budget(
    *,
    budget_bytes: int,
    weights_bytes: int,
    bytes_per_block: int,
    max_useful_blocks: int,
    workspace_bytes: int = 0,
) -> int:
    """Blocks (null block included) that fit in budget - weights - workspace, capped at what
    the engine can ever hold (max_num_seqs full-length sequences + the null block): the rule
    of memory_plan.MemoryPlan.num_kv_blocks (which the engine uses), on plain numbers.

    Raises:
        ValueError: when not even two blocks (the null block and one usable) fit.
    """
    num_blocks = blocks_for_budget(
        budget_bytes=budget_bytes,
        used_bytes=weights_bytes + workspace_bytes,
        bytes_per_block=bytes_per_block,
        max_useful_blocks=max_useful_blocks,
    )
    if num_blocks < 2:
        raise ValueError(
            f"memory for the KV cache: {budget_bytes} bytes budget - {weights_bytes} bytes of "
            f"weights - {workspace_bytes} bytes of workspace leaves room for {num_blocks} blocks "
            f"of {bytes_per_block} bytes; need at least 2: raise memory_utilization or pass "
            "num_kv_blocks"
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
