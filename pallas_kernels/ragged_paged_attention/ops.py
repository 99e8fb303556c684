"""One entry point for every ragged paged attention implementation, chosen by name.

Backends:
    "reference"   pure jnp (reference.py): the ground truth.
    "xla"         plain XLA ops chunked over the context (chunked.py); its cost follows the
                  batch's longest context, so callers need no width buckets.
    "cpu"         "xla" with its row pass (decodes, short chunks) in this project's C++ kernel
                  (cpu_rows.cc, an XLA FFI call built on first use): the CPU default when it
                  builds. Calls with non-f32 q or pages run "xla" (same results).
    "pallas"      this project's Pallas kernel for the platform jax runs on: the Triton-lowered
                  GPU kernel on GPU, the Mosaic kernel on TPU, and the GPU kernel in interpret
                  mode on CPU (slow; for tests).
    "pallas_gpu"  the GPU kernel; native on GPU, interpret mode elsewhere.
    "pallas_tpu"  the TPU kernel; native on TPU, interpret mode elsewhere.

The page-writing side (write_kv) stays an XLA scatter: with the cache donated to the step it
updates the pages in place, and it must complete before attention reads the new tokens anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention import cpu_rows
from jaxserve.pallas_kernels.ragged_paged_attention.chunked import ragged_paged_attention_chunked
from jaxserve.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

BACKENDS = ("reference", "xla", "cpu", "pallas", "pallas_gpu", "pallas_tpu")
# Backends whose cost stops at the batch's longest context: callers may pass full-width tables.
LENGTH_BOUNDED_BACKENDS = ("xla", "cpu", "pallas", "pallas_gpu", "pallas_tpu")


def default_attention_backend(platform: str | None = None) -> str:
    """The backend attention_backend="auto" resolves to: "pallas" on gpu/tpu; on cpu "cpu"
    when its C++ kernel builds here (cpu_rows.available()), else "xla" (interpret mode is far
    slower than plain XLA ops there).

    Args:
        platform: a jax platform name ("cpu", "gpu", "cuda", "rocm", "tpu"); default: the
            platform of jax.default_backend().
    """
    platform = jax.default_backend() if platform is None else platform
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        return "pallas"
    return "cpu" if cpu_rows.available() else "xla"


def resolve_backend(backend: str, platform: str | None = None) -> tuple[str, bool]:
    """Map a backend name to (kernel, interpret) for a platform: kernel is "reference", "xla",
    "cpu", "gpu" or "tpu"; interpret is True when the kernel cannot run natively there.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    platform = jax.default_backend() if platform is None else platform
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f'attention backend "cpu" runs on the cpu platform only, not {platform!r}')
    if backend in ("reference", "xla", "cpu"):
        return backend, False
    if backend == "pallas":
        return ("tpu", False) if platform == "tpu" else ("gpu", not on_gpu)
    if backend == "pallas_gpu":
        return "gpu", not on_gpu
    return "tpu", platform != "tpu"


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
) -> jax.Array:  # [T, N, H]
    """Attention of the ragged batch over the paged KV cache; see reference.py for semantics.

    Raises:
        ValueError: an unknown backend, or inputs the chosen kernel rejects (naming the
            argument, its value and the limit).
    """
    kernel, interpret = resolve_backend(backend)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if kernel == "reference":
        return ragged_paged_attention_reference(*args, **options)
    if kernel == "xla":
        return ragged_paged_attention_chunked(*args, **options)
    if kernel == "cpu":
        f32 = q.dtype == jnp.float32 and k_pages.dtype == jnp.float32
        return ragged_paged_attention_chunked(*args, **options, row_kernel="cpu" if f32 else "xla")
    if kernel == "gpu":
        return ragged_paged_attention_gpu(*args, **options, interpret=interpret)
    return ragged_paged_attention_tpu(*args, **options, interpret=interpret)
