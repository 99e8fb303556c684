"""Ragged paged attention in plain XLA ops, chunked over the context: the fast CPU backend.

Same signature and semantics as reference.py. The reference gathers, for every query row, the
whole block-table width B * P at once, so the caller must bucket B by the batch's longest
context and every step pays for the power-of-two rounding. Here a while loop walks the context
in chunks of C positions, with online softmax (flash attention's running max / sum), and stops
at the chunk that holds the batch's longest context, a run-time value. So:

- the cost follows the longest context of the batch rounded up to C, not to a power of two;
- the block table can always be passed at full width (max_model_len / P pages): the step
  compiles once per token bucket instead of once per (token bucket, width bucket);
- memory per iteration is bounded: the gathered K/V of one chunk is [K, T, C, H].

Every row still computes up to the batch's longest context (masked past its own): the waste of
a short request batched with a long one, as in the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.pallas_kernels.ragged_paged_attention.reference import token_seq_ids
from jaxserve.pallas_kernels.ragged_paged_attention.validation import validate_inputs

_MASK_VALUE = -1e30
# Gathered floats per chunk iteration (T * C * K * H); bounds memory and sets C for large T.
# 2**21 rather than 2**23: at 256 decode rows, 2-page chunks beat 8-page ones 4.5x at context
# 128 and 1.4x at context 1000 (one layer, K=2, H=64, P=32, side by side on the 2-core CPU).
_CHUNK_ELEMENTS = 1 << 21
_MAX_CHUNK_POSITIONS = 256  # over-read past the longest context is at most this


def chunk_pages(num_tokens: int, kv_shape: tuple[int, ...], table_width: int) -> int:
    """Pages per chunk: the largest power of two keeping one chunk's gather under
    _CHUNK_ELEMENTS and its positions under _MAX_CHUNK_POSITIONS (at least one page)."""
    num_kv_heads, _, page_size, head_dim = kv_shape
    by_memory = _CHUNK_ELEMENTS // max(num_tokens * num_kv_heads * head_dim * page_size, 1)
    limit = max(1, min(by_memory, _MAX_CHUNK_POSITIONS // page_size, table_width))
    return 1 << (limit.bit_length() - 1)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_chunk")
)
def ragged_paged_attention_chunked(
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
    pages_per_chunk: int | None = None,
) -> jax.Array:  # [T, N, H]
    """See the module docstring; pages_per_chunk overrides chunk_pages() (tuning, tests).

    Raises:
        ValueError: bad shapes / dtypes / options (validation.py).
    """
    validate_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages = pages_per_chunk or chunk_pages(num_tokens, k_pages.shape, block_tables.shape[1])
    width = pages * page_size  # C: context positions per chunk
    num_chunks = -(-block_tables.shape[1] // pages)
    table = jnp.pad(block_tables, ((0, 0), (0, num_chunks * pages - block_tables.shape[1])))

    seq = token_seq_ids(cu_q_lens, num_tokens)  # i32[T]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])  # i32[T]
    valid = (rows < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])
    real = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
    longest = jnp.max(jnp.where(real, kv_lens, 0))
    trips = jnp.minimum(-(-longest // width), num_chunks)
    token_table = table[seq]  # i32[T, chunks * pages]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)  # [T, K, G, H]

    def body(i, carry):
        m, denom, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        ids = lax.dynamic_slice_in_dim(token_table, i * pages, pages, axis=1)  # [T, pages]
        k = k_pages[:, ids].reshape(num_kv_heads, num_tokens, width, head_dim)  # [K, T, C, H]
        v = v_pages[:, ids].reshape(num_kv_heads, num_tokens, width, head_dim)
        s = jnp.einsum("TKGH,KTCH->TKGC", qg, k.astype(jnp.float32)) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = i * width + jnp.arange(width, dtype=jnp.int32)
        mask = (pos[None, :] <= q_pos[:, None]) & valid[:, None]  # [T, C] causal, <= kv_len
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[..., None] + jnp.einsum("TKGC,KTCH->TKGH", p, v.astype(jnp.float32))
        return m_new, denom * alpha + p.sum(axis=-1), acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, _MASK_VALUE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(0, trips, body, init)
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom, 1e-30)[..., None], 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
