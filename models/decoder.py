"""The shared decoder-only transformer (Llama, Mistral, Qwen2, Qwen3 and the Gemmas differ only
by config)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.layers import DecoderLayer, KVCache, RMSNorm
from jaxserve.models.rope import model_inv_freq, rope_cos_sin, rope_variant_slice
from jaxserve.pallas_kernels.ragged_paged_attention import AttentionImpl


class Decoder(nn.Module):
    """embed -> L decoder layers -> final norm; `logits` applies the (tied or own) LM head.

    Params: embed f[V, D]; layers_{i} (see DecoderLayer) for i < L; final_norm {scale f[D]};
    lm_head f[V, D] unless tie_word_embeddings: HF's layout and the embedding's, so the logits
    are one einsum either way; XLA:CPU's GEMM for a decode step's few rows is also faster with
    it than with [D, V] (docs/benchmarks.md, "Design measurements").
    With final_logit_softcap the float32 logits are soft-capped, cap * tanh(logits / cap).
    """

    arch: ModelArchConfig
    dtype: jnp.dtype
    attention: AttentionImpl  # the execution plan's choice
    max_model_len: int | None = None  # the engine's; picks LongRoPE's factors (rope.py)
    quantization: str | None = None  # quant.QUANTIZATIONS: the layers' projections, not embed/head

    def setup(self) -> None:
        a = self.arch
        init = nn.initializers.normal(a.initializer_range)
        self.embed = self.param("embed", init, (a.vocab_size, a.hidden_size), self.dtype)
        self.layers = [
            DecoderLayer(a, self.dtype, self.attention, i, self.quantization, name=f"layers_{i}")
            for i in range(a.num_layers)
        ]
        self.final_norm = RMSNorm(a.rms_norm_eps, self.dtype, a.norm_unit_offset)
        if not a.tie_word_embeddings:
            self.lm_head = self.param("lm_head", init, (a.vocab_size, a.hidden_size), self.dtype)
        # A host constant: baked into the compiled step, never a parameter. f32[Q * H // 2]:
        # every RoPE variant side by side (rope.model_inv_freq).
        self.inv_freq = model_inv_freq(a, self.max_model_len)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        kv_caches: list[KVCache],  # L x (k_pages, v_pages), each [K, S, P, H]
        md: AttentionMetadata,
    ) -> tuple[list[KVCache], jax.Array]:  # updated caches, f[T, D] after the final norm
        if len(kv_caches) != self.arch.num_layers:
            raise ValueError(
                f"kv_caches must hold one (k, v) pair per layer ({self.arch.num_layers}), "
                f"got {len(kv_caches)}"
            )
        if md.rope_cos is not None and md.rope_sin is not None:
            cos, sin = md.rope_cos, md.rope_sin  # f32[T, Q * H // 2] each, from the host
        else:
            cos, sin = rope_cos_sin(md.positions, self.inv_freq)
        x = jnp.take(self.embed, input_ids, axis=0)  # [T, D]
        if self.arch.scale_embeddings:
            # sqrt(D) rounded to the model dtype first, as HF does (bf16 sqrt(3072) is 55.5).
            x = x * jnp.asarray(self.arch.hidden_size**0.5, self.dtype)
        new_caches = []
        # A Python loop, not a scan: each layer's pages stay separate donated buffers, updated
        # in place, with no stacking copy.
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cols = rope_variant_slice(self.arch, i)  # this layer's RoPE: f32[T, H // 2] each
            x, kv_cache = layer(x, kv_cache, md, cos[:, cols], sin[:, cols])
            new_caches.append(kv_cache)
        return new_caches, self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:  # f[R, D] -> f32[R, V]
        head = self.embed if self.arch.tie_word_embeddings else self.lm_head  # [V, D]
        logits = jnp.einsum("RD,VD->RV", hidden, head, preferred_element_type=jnp.float32)
        cap = self.arch.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
