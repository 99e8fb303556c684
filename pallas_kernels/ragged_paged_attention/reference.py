"""Pure-jnp ragged paged attention: the ground truth every kernel is tested against, and what
the plan takes under tensor parallelism where no kernel can run per device (GSPMD partitions it).

Shapes (glossary in README): T tokens of the flattened ragged batch, R sequence slots (padded),
N query heads, K kv heads (N % K == 0), H head dim, S pages in the pool, P tokens per page,
B block-table width (pages per sequence this call may read).

KV page layout, one array per layer for K and one for V:

    pages[K, S, P, H]      token at position p of a sequence with block table bt lives at
                           pages[:, bt[p // P], p % P, :]; its flat slot is bt[p // P] * P + p % P.

FP8 KV cache (kv_quant.py): pages may be float8_e4m3fn / float8_e5m2, holding K / k_scale and
V / v_scale (saturated); k_scale and v_scale are traced f32[] scalars (None: 1), and every
implementation reads K = pages * k_scale, V = pages * v_scale.

Sequence r owns query rows cu_q_lens[r] : cu_q_lens[r + 1] of q; these are its *last*
q_len = cu_q_lens[r + 1] - cu_q_lens[r] tokens, so query row i of r sits at position
kv_lens[r] - q_len + i and attends causally to positions 0 .. that position. Rows past
cu_q_lens[num_seqs] are padding: their output is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import dequantize, quantize

# Query rows processed per chunk, bounding the gathered K/V to [chunk, B * P, K, H].
_TOKEN_CHUNK = 256
_MASK_VALUE = -1e30


def write_kv(
    k_pages: jax.Array,  # [K, S, P, H]
    v_pages: jax.Array,  # [K, S, P, H]
    new_k: jax.Array,  # [T, K, H]
    new_v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T] flat slot per token; padding tokens point into null block 0
    k_scale: jax.Array | None = None,  # f32[] (None: 1)
    v_scale: jax.Array | None = None,  # f32[] (None: 1)
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K/V into their slots. In place when the pages are donated.

    The pages store new_k / k_scale and new_v / v_scale in their own dtype; into FP8 pages the
    cast saturates (kv_quant.quantize). Only the new tokens are converted, never the pool.
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    flat_shape = (num_kv_heads, num_pages * page_size, head_dim)
    k_flat = (
        k_pages.reshape(flat_shape)
        .at[:, slot_mapping]
        .set(quantize(new_k.swapaxes(0, 1), k_scale, k_pages.dtype), mode="drop")
    )
    v_flat = (
        v_pages.reshape(flat_shape)
        .at[:, slot_mapping]
        .set(quantize(new_v.swapaxes(0, 1), v_scale, v_pages.dtype), mode="drop")
    )
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the sequence slot of each query row (rows past the last sequence get R - 1)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, rows, side="right").astype(jnp.int32) - 1
    return jnp.clip(seq, 0, cu_q_lens.shape[0] - 2)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
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
    k_scale: jax.Array | None = None,  # f32[] K = k_pages * k_scale (None: 1)
    v_scale: jax.Array | None = None,  # f32[] V = v_pages * v_scale (None: 1)
) -> jax.Array:  # [T, N, H]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    width = block_tables.shape[1] * page_size  # context positions one sequence may read

    seq = token_seq_ids(cu_q_lens, num_tokens)  # i32[T]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])  # i32[T] absolute position
    valid_row = (rows < cu_q_lens[num_seqs[0]]) & (seq < num_seqs[0])

    def chunk(args):
        q_c, seq_c, pos_c, valid_c = args  # [C, N, H], [C], [C], [C]
        pages = block_tables[seq_c]  # [C, B]
        # The ground truth dequantizes literally: f32 K and V of the gathered pages.
        k = dequantize(k_pages[:, pages], k_scale).reshape(num_kv_heads, -1, width, head_dim)
        v = dequantize(v_pages[:, pages], v_scale).reshape(num_kv_heads, -1, width, head_dim)
        qg = q_c.reshape(-1, num_kv_heads, group, head_dim)  # [C, K, G, H]
        s = jnp.einsum("CKGH,KCWH->CKGW", qg.astype(jnp.float32), k) * sm_scale  # [C, K, G, W]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = jnp.arange(width, dtype=jnp.int32)
        mask = kv_pos[None, :] <= pos_c[:, None]  # [C, W] causal, also bounds by kv_len
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos_c[:, None] - sliding_window
        mask &= valid_c[:, None]
        s = jnp.where(mask[:, None, None, :], s, _MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(mask[:, None, None, :], p, 0.0)
        o = jnp.einsum("CKGW,KCWH->CKGH", p, v)
        return o.reshape(-1, num_q_heads, head_dim).astype(q.dtype)

    if num_tokens <= _TOKEN_CHUNK or num_tokens % _TOKEN_CHUNK:
        return chunk((q, seq, q_pos, valid_row))
    num_chunks = num_tokens // _TOKEN_CHUNK
    split = lambda x: x.reshape(num_chunks, _TOKEN_CHUNK, *x.shape[1:])
    out = jax.lax.map(chunk, (split(q), split(seq), split(q_pos), split(valid_row)))
    return out.reshape(num_tokens, num_q_heads, head_dim)
