"""The C++ row kernel (cpu_rows.cc) for the CPU: built on first use (see cpu_ffi.py), called
as an XLA FFI custom call.

XLA:CPU runs one decode row's attention as tiny batched dots ([G, H] x [H, C] per KV head)
plus gathers of its pages, far below the memory bandwidth; this kernel walks each row's pages
directly and streams them once. The xla backend's tile pass keeps the prefill tiles (real
GEMMs there). When it cannot be built (or JAXSERVE_CPU_KERNEL=0), `available()` is False and
`unavailable_reason()` says why; the engine then picks the plain xla backend.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.cpu_ffi import CpuKernel

KERNEL = CpuKernel(
    Path(__file__).with_name("cpu_rows.cc"),
    symbol="JaxserveRaggedPagedAttentionCpuRows",
    target="jaxserve_ragged_paged_attention_cpu_rows",
)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return KERNEL.available()


def unavailable_reason() -> str | None:
    """Why `available()` is False, or None."""
    return KERNEL.unavailable_reason()


def cpu_rows_attention(
    q: jax.Array,  # f32[T, N, H]
    k_pages: jax.Array,  # f32[K, S, P, H]
    v_pages: jax.Array,  # f32[K, S, P, H]
    kv_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, B]
    cu_q_lens: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1]
    skip_rows: jax.Array,  # i32[R] leading rows of each sequence left to the caller
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:  # f32[T, N, H]
    """Attention of every query row past its sequence's first skip_rows[r] rows, with
    reference.py's semantics; all other rows (skipped ones, padding) are zero. Inputs are
    assumed validated (validation.validate_inputs) and f32.

    Raises:
        RuntimeError: the kernel is not available (see unavailable_reason()).
    """
    KERNEL.require()
    call = jax.ffi.ffi_call(KERNEL.target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, skip_rows,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )  # fmt: skip
