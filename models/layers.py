"""Flax Linen layers of the shared decoder: RMSNorm, paged attention, SwiGLU MLP, decoder layer.

Weights are stored in the model dtype with the einsum layouts below (one letter per glossary
axis); norms, RoPE and softmax run in float32. Each attention layer takes its KV pages and
returns them updated, so the modules hold no state between calls.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.rope import apply_rope
from jaxserve.pallas_kernels.ragged_paged_attention import AttentionImpl, write_kv

KVCache = tuple[jax.Array, jax.Array]  # (k_pages, v_pages), each [K, S, P, H]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last axis; statistics in float32, scale applied in x.dtype
    (the HF order, which matters in bfloat16)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, scale, self.eps)


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache.

    Params: q_proj f[D, N, H], k_proj/v_proj f[D, K, H], o_proj f[N, H, D]; with
    attention_bias q_bias f[N, H], k_bias/v_bias f[K, H]; with attention_out_bias o_bias f[D];
    with qk_norm q_norm/k_norm f[H].
    """

    arch: ModelArchConfig
    dtype: jnp.dtype
    attention: AttentionImpl  # the execution plan's choice

    def _weight(self, name: str, shape: tuple[int, ...], init: nn.initializers.Initializer):
        return self.param(name, init, shape, self.dtype)

    def _project(self, x: jax.Array, name: str, heads: int) -> jax.Array:  # [T, heads, H]
        a, init = self.arch, nn.initializers.normal(self.arch.initializer_range)
        w = self._weight(name + "_proj", (a.hidden_size, heads, a.head_dim), init)
        y = jnp.einsum("TD,DNH->TNH", x, w)
        if a.attention_bias:
            y = y + self._weight(name + "_bias", (heads, a.head_dim), nn.initializers.zeros)
        if a.qk_norm and name in ("q", "k"):
            scale = self._weight(name + "_norm", (a.head_dim,), nn.initializers.ones)
            y = rms_norm(y, scale, a.rms_norm_eps)
        return y

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, D]
        kv_cache: KVCache,
        md: AttentionMetadata,
        cos: jax.Array,  # f32[T, H // 2]
        sin: jax.Array,  # f32[T, H // 2]
    ) -> tuple[jax.Array, KVCache]:  # [T, D], updated pages
        a = self.arch
        q = apply_rope(self._project(x, "q", a.num_heads), cos, sin)  # [T, N, H]
        k = apply_rope(self._project(x, "k", a.num_kv_heads), cos, sin)  # [T, K, H]
        v = self._project(x, "v", a.num_kv_heads)  # [T, K, H]
        k_pages, v_pages = write_kv(*kv_cache, k, v, md.slot_mapping)
        out = self.attention(
            q,
            k_pages,
            v_pages,
            md.seq_lens,
            md.block_tables,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=a.head_dim**-0.5,
            sliding_window=a.sliding_window,
        )  # [T, N, H]
        init = nn.initializers.normal(a.initializer_range)
        w_o = self._weight("o_proj", (a.num_heads, a.head_dim, a.hidden_size), init)
        # As one [T, N*H] x [N*H, D] GEMM: with the (N, H) contraction XLA:CPU copied w_o
        # into an H-major layout on every step (8 layers x 1 MiB at hidden 512).
        num_tokens = out.shape[0]
        y = out.astype(self.dtype).reshape(num_tokens, -1) @ w_o.reshape(-1, a.hidden_size)
        if a.attention_out_bias:
            y = y + self._weight("o_bias", (a.hidden_size,), nn.initializers.zeros)
        return y, (k_pages, v_pages)


class MLP(nn.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)). Params gate_proj/up_proj f[D, F], down_proj
    f[F, D]."""

    arch: ModelArchConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        d, f = self.arch.hidden_size, self.arch.intermediate_size
        init = nn.initializers.normal(self.arch.initializer_range)
        gate = jnp.einsum("TD,DF->TF", x, self.param("gate_proj", init, (d, f), self.dtype))
        up = jnp.einsum("TD,DF->TF", x, self.param("up_proj", init, (d, f), self.dtype))
        hidden = jax.nn.silu(gate) * up
        return jnp.einsum("TF,FD->TD", hidden, self.param("down_proj", init, (f, d), self.dtype))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    arch: ModelArchConfig
    dtype: jnp.dtype
    attention: AttentionImpl

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, D]
        kv_cache: KVCache,
        md: AttentionMetadata,
        cos: jax.Array,  # f32[T, H // 2]
        sin: jax.Array,  # f32[T, H // 2]
    ) -> tuple[jax.Array, KVCache]:
        eps = self.arch.rms_norm_eps
        h = RMSNorm(eps, self.dtype, name="input_norm")(x)
        h, kv_cache = Attention(self.arch, self.dtype, self.attention, name="attn")(
            h, kv_cache, md, cos, sin
        )
        x = x + h
        h = RMSNorm(eps, self.dtype, name="post_attn_norm")(x)
        return x + MLP(self.arch, self.dtype, name="mlp")(h), kv_cache
