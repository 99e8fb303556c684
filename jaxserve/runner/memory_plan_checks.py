"""plan_memory's argument checks (memory_plan.py): TypeError / ValueError, each naming the
argument, its value and the limit."""

from __future__ import annotations

import numpy as np

from jaxserve.runner.memory_sizes import DTYPE_SIZES, KV_DTYPE_SIZES


def check_arguments(
    *,
    dtype: str,
    kv_cache_dtype: str,
    memory_utilization: float,
    num_kv_blocks: int | None,
    platform: str | None,
    **positive_ints: int,
) -> None:
    """plan_memory's argument checks (TypeError / ValueError, each named with its value)."""
    if platform not in (None, "cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu', 'tpu' or None, got {platform!r}")
    for name, value, sizes in (
        ("dtype", dtype, DTYPE_SIZES),
        ("kv_cache_dtype", kv_cache_dtype, KV_DTYPE_SIZES),
    ):
        if value not in sizes:
            raise ValueError(f"{name} must be one of {sorted(sizes)}, got {value!r}")
    for name, value in positive_ints.items():
        check_positive_int(name, value)
    if num_kv_blocks is not None:
        check_positive_int("num_kv_blocks", num_kv_blocks)
    if isinstance(memory_utilization, bool) or not (
        isinstance(memory_utilization, (int, float)) and 0.0 < memory_utilization <= 1.0
    ):
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization!r}")


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
