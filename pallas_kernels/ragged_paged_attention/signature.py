"""The one signature every ragged paged attention kernel shares (reference.py states its
semantics). Kernels add keyword-only options of their own (tuning configs, interpret mode);
the registry passes the ones a kernel declares (kernels.KernelSpec.options)."""

from __future__ import annotations

from typing import Protocol

import jax


class AttentionKernel(Protocol):
    """``out[t] = attention of query row t over its sequence's pages``, padding rows zero.

    Shapes: T query rows (tokens), N query heads, K KV heads (N % K == 0), H head dim, S pages
    of P slots, R sequence slots, B pages per block-table row. Page 0 is the null page.
    """

    def __call__(
        self,
        q: jax.Array,  # [T, N, H]
        k_pages: jax.Array,  # [K, S, P, H]
        v_pages: jax.Array,  # [K, S, P, H]
        kv_lens: jax.Array,  # i32[R] context length of each sequence, new tokens included
        block_tables: jax.Array,  # i32[R, B]
        cu_q_lens: jax.Array,  # i32[R + 1] query row offsets
        num_seqs: jax.Array,  # i32[1] real sequences; slots >= num_seqs are padding
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        k_scale: jax.Array | None = None,  # f32[] of an FP8 KV cache (kv_quant.py)
        v_scale: jax.Array | None = None,  # f32[]
    ) -> jax.Array:  # [T, N, H] in q's dtype
        ...
