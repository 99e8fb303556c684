"""Flax Linen layers of the shared decoder: RMSNorm, paged attention, gated MLP, decoder layer.

Weights are stored in the model dtype with the einsum layouts below (one letter per glossary
axis), the linear projections optionally in 8 bits with per-output-channel scales (quant.py:
every projection goes through quant.matmul); norms, RoPE and softmax run in float32. Each
attention layer takes its KV pages and returns them updated, so the modules hold no state
between calls.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.moe import MoE
from jaxserve.models.quant import linear_weight, matmul
from jaxserve.models.rope import apply_rope
from jaxserve.pallas_kernels.ragged_paged_attention import AttentionImpl, write_kv

KVCache = tuple[jax.Array, jax.Array]  # (k_pages, v_pages), each [K, S, P, H]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """x / rms(x) * scale over the last axis, statistics in float32.

    Llama (unit_offset False): the scale is applied in x.dtype after rounding; Gemma (True):
    x / rms(x) * (1 + scale) all in float32, rounded once at the end. Both are the HF orders,
    which differ in bfloat16."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * normed.astype(x.dtype)


class RMSNorm(nn.Module):
    """Param scale f[D] (or f[H]): 1 at init, or 0 with unit_offset (the norm is then neutral
    either way)."""

    eps: float
    dtype: jnp.dtype
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        return rms_norm(x, scale, self.eps, self.unit_offset)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The gated MLP's activation by its HF name (arch_config.HIDDEN_ACTS)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unsupported hidden_act {name!r}")


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache.

    Params: q_proj f[D, N, H], k_proj/v_proj f[D, K, H], o_proj f[N, H, D]; with
    attention_bias q_bias f[N, H], k_bias/v_bias f[K, H]; with attention_out_bias o_bias f[D];
    with qk_norm q_norm/k_norm f[H]. The layer's index picks its sliding window and RoPE. With
    `quantization` the four projections are 8-bit with f32 {name}_scale leaves (quant.py).
    """

    arch: ModelArchConfig
    dtype: jnp.dtype
    attention: AttentionImpl  # the execution plan's choice
    layer_index: int  # i < L
    quantization: str | None = None  # quant.QUANTIZATIONS: the projections' storage

    def _weight(self, name: str, shape: tuple[int, ...], init: nn.initializers.Initializer):
        return self.param(name, init, shape, self.dtype)

    def _project(self, x: jax.Array, name: str, heads: int) -> jax.Array:  # [T, heads, H]
        a, init = self.arch, nn.initializers.normal(self.arch.initializer_range)
        shape = (a.hidden_size, heads, a.head_dim)
        w, scale = linear_weight(self, name + "_proj", shape, init, self.dtype, self.quantization)
        y = matmul("TD,DNH->TNH", x, w, scale)
        if a.attention_bias:
            y = y + self._weight(name + "_bias", (heads, a.head_dim), nn.initializers.zeros)
        if a.qk_norm and name in ("q", "k"):
            init = nn.initializers.zeros if a.norm_unit_offset else nn.initializers.ones
            scale = self._weight(name + "_norm", (a.head_dim,), init)
            y = rms_norm(y, scale, a.rms_norm_eps, a.norm_unit_offset)
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
        # An FP8 KV cache: this layer's f32[] scales, used to quantize and to dequantize.
        scales = {}
        if md.kv_scales is not None:
            scales = dict(k_scale=md.kv_scales[self.layer_index, 0])
            scales.update(v_scale=md.kv_scales[self.layer_index, 1])
        k_pages, v_pages = write_kv(*kv_cache, k, v, md.slot_mapping, **scales)
        out = self.attention(
            q,
            k_pages,
            v_pages,
            md.kv_lens,
            md.block_tables,
            md.cu_q_lens,
            md.num_seqs,
            sm_scale=a.sm_scale,
            sliding_window=a.layer_window(self.layer_index),
            soft_cap=a.attn_logit_softcap,
            **scales,
        )  # [T, N, H]
        init = nn.initializers.normal(a.initializer_range)
        shape = (a.num_heads, a.head_dim, a.hidden_size)
        w_o, scale = linear_weight(self, "o_proj", shape, init, self.dtype, self.quantization)
        # As one [T, N*H] x [N*H, D] GEMM (I = N*H): with the (N, H) contraction XLA:CPU copied
        # w_o into an H-major layout on every step (8 layers x 1 MiB at hidden 512).
        num_tokens = out.shape[0]
        flat = out.astype(self.dtype).reshape(num_tokens, -1)  # [T, I]
        y = matmul("TI,ID->TD", flat, w_o.reshape(-1, a.hidden_size), scale)
        if a.attention_out_bias:
            y = y + self._weight("o_bias", (a.hidden_size,), nn.initializers.zeros)
        return y, (k_pages, v_pages)


class MLP(nn.Module):
    """Gated MLP: down(act(x @ gate) * (x @ up)), act = silu (SwiGLU) or tanh-approximated gelu
    (GeGLU, Gemma). Params gate_proj/up_proj f[D, F], down_proj f[F, D]; with `quantization`
    8-bit, with f32 scales gate_proj_scale/up_proj_scale [F], down_proj_scale [D]."""

    arch: ModelArchConfig
    dtype: jnp.dtype
    quantization: str | None = None  # quant.QUANTIZATIONS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        d, f = self.arch.hidden_size, self.arch.intermediate_size
        init = nn.initializers.normal(self.arch.initializer_range)
        weight = lambda name, shape: linear_weight(
            self, name, shape, init, self.dtype, self.quantization
        )
        gate = matmul("TD,DF->TF", x, *weight("gate_proj", (d, f)))
        up = matmul("TD,DF->TF", x, *weight("up_proj", (d, f)))
        hidden = activation(self.arch.hidden_act)(gate) * up
        return matmul("TF,FD->TD", hidden, *weight("down_proj", (f, d)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). With sandwich_norms
    (Gemma 2/3) each branch's output is normed too before the residual add (attn_out_norm,
    mlp_out_norm)."""

    arch: ModelArchConfig
    dtype: jnp.dtype
    attention: AttentionImpl
    layer_index: int  # i < L
    quantization: str | None = None  # quant.QUANTIZATIONS: attention and dense MLP projections

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, D]
        kv_cache: KVCache,
        md: AttentionMetadata,
        cos: jax.Array,  # f32[T, H // 2]
        sin: jax.Array,  # f32[T, H // 2]
    ) -> tuple[jax.Array, KVCache]:
        a = self.arch
        norm = lambda name: RMSNorm(a.rms_norm_eps, self.dtype, a.norm_unit_offset, name=name)
        h = norm("input_norm")(x)
        attn = Attention(
            a, self.dtype, self.attention, self.layer_index, self.quantization, name="attn"
        )
        h, kv_cache = attn(h, kv_cache, md, cos, sin)
        if a.sandwich_norms:
            h = norm("attn_out_norm")(h)
        x = x + h
        if a.is_moe_layer(self.layer_index):  # Mixtral, Qwen3-MoE: routed experts
            mlp = MoE(a, self.dtype, self.quantization, name="moe")
        else:
            mlp = MLP(a, self.dtype, self.quantization, name="mlp")
        h = mlp(norm("post_attn_norm")(x))
        if a.sandwich_norms:
            h = norm("mlp_out_norm")(h)
        return x + h, kv_cache
