"""One entry point for every ragged paged attention implementation, chosen by name."""

from __future__ import annotations

import jax

from jaxserve.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)

BACKENDS = ("reference",)


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
    """Attention of the ragged batch over the paged KV cache; see reference.py for semantics."""
    if backend == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
