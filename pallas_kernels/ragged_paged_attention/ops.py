"""Ragged paged attention by implementation name: the entry point of tests and benchmarks.

The engine never calls this: its execution plan chooses an AttentionImpl once, when the engine
is built (registry.py), and the model calls that object. Here the name is resolved at trace
time, by the same rules (registry.select_attention), for the platform of jax's first device or
the one given.

The page-writing side (write_kv) stays an XLA scatter: with the cache donated to the step it
updates the pages in place, and it must complete before attention reads the new tokens anyway.
"""

from __future__ import annotations

import jax

from jaxserve.pallas_kernels.ragged_paged_attention.impl import AttentionImpl
from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import is_fp8
from jaxserve.pallas_kernels.ragged_paged_attention.registry import select_attention
from jaxserve.pallas_kernels.ragged_paged_attention.target import (
    AMPERE,
    BLACKWELL,
    HOPPER,
    OLDER_GPU,
    Target,
)


def device_facts(device: jax.Device) -> dict[str, object]:
    """platform ("cpu" | "gpu" | "tpu"), gpu_generation, device_kind, num_cores,
    cuda_runtime_version and compute_capability of a device (the Target fields that describe
    the chip)."""
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    facts: dict[str, object] = dict(platform=platform, device_kind=device.device_kind)
    if platform == "gpu":
        capability = getattr(device, "compute_capability", None)
        facts["gpu_generation"] = gpu_generation(capability)
        facts["compute_capability"] = None if capability is None else str(capability)
        facts["num_cores"] = getattr(device, "core_count", None)
        if device.platform != "rocm":
            facts["cuda_runtime_version"] = cuda_runtime_version()
    return facts


def cuda_runtime_version() -> int | None:
    """The CUDA runtime version of jax's CUDA plugin (e.g. 12090), or None without one."""
    try:
        from jax._src.lib import cuda_versions  # private, hence guarded; None without CUDA
    except ImportError:  # pragma: no cover - depends on the installed jax
        return None
    if cuda_versions is None:
        return None
    return int(cuda_versions.cuda_runtime_get_version())


def gpu_generation(compute_capability: str | None) -> str:
    """BLACKWELL (sm_100 and newer), HOPPER (sm_90), AMPERE (sm_80 / sm_86 / sm_89) or OLDER_GPU
    (anything else, ROCm GPUs included, which report no CUDA compute capability)."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return OLDER_GPU
    if major >= 10:
        return BLACKWELL
    return HOPPER if major == 9 else AMPERE if major == 8 else OLDER_GPU


def implementation_for(
    backend: str,
    q: jax.Array,
    k_pages: jax.Array,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    platform: str | None = None,
) -> AttentionImpl:
    """The implementation ``backend`` ("auto" or a registry name) means for these inputs.

    Args:
        platform: "cpu", "gpu" or "tpu"; default: that of jax.devices()[0] (whose chip also
            gives the GPU generation).

    Raises:
        ValueError: as registry.select_attention.
    """
    facts = device_facts(jax.devices()[0])
    if platform is not None and platform != facts["platform"]:
        facts = dict(platform=platform, gpu_generation=HOPPER if platform == "gpu" else None)
    target = Target(
        dtype=q.dtype.name,
        num_q_heads=q.shape[1],
        num_kv_heads=k_pages.shape[0],
        head_dim=q.shape[2],
        page_size=k_pages.shape[2],
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        kv_cache_dtype=k_pages.dtype.name if is_fp8(k_pages.dtype) else None,
        **facts,
    )
    return select_attention(backend, target)[0]


def ragged_paged_attention(
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
    backend: str = "reference",
    platform: str | None = None,
    k_scale: jax.Array | None = None,  # f32[] of an FP8 KV cache (kv_quant.py)
    v_scale: jax.Array | None = None,  # f32[]
) -> jax.Array:  # [T, N, H]
    """Attention of the ragged batch over the paged KV cache; see reference.py for semantics.

    Raises:
        ValueError: an unknown backend or one that cannot run here, or inputs the chosen kernel
            rejects (naming the argument, its value and the limit).
    """
    impl = implementation_for(
        backend, q, k_pages, sliding_window=sliding_window, soft_cap=soft_cap, platform=platform
    )
    return impl(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
