"""Hugging Face tensor names -> jaxserve params: where each tensor goes and how it is reshaped.

HF stores nn.Linear weights as [out, in]; our einsum layouts put the input axis first and split
the head axes (q_proj f[D, N, H], o_proj f[N, H, D], ...; see models/causal_lm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxserve.models import ModelArchConfig

# Tensors that carry no weights of ours: old Llama checkpoints saved the RoPE table.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorSpec:
    param_path: tuple[str, ...]  # key path into the params pytree
    hf_shape: tuple[int, ...]  # shape in the checkpoint
    convert: Callable[[np.ndarray], np.ndarray]  # HF layout -> param layout


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _linear_in_heads(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    def convert(w: np.ndarray) -> np.ndarray:  # [heads * H, D] -> [D, heads, H]
        return w.T.reshape(w.shape[1], heads, head_dim)

    return convert


def _linear_out_of_heads(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    def convert(w: np.ndarray) -> np.ndarray:  # [D, N * H] -> [N, H, D]
        return w.T.reshape(heads, head_dim, w.shape[0])

    return convert


def _bias_heads(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda b: b.reshape(heads, head_dim)  # [heads * H] -> [heads, H]


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def _attention_specs(a: ModelArchConfig, i: int) -> dict[str, TensorSpec]:
    hf, ours = f"model.layers.{i}.self_attn.", (f"layers_{i}", "attn")
    d, h = a.hidden_size, a.head_dim
    specs = {}
    for name, heads in (("q", a.num_heads), ("k", a.num_kv_heads), ("v", a.num_kv_heads)):
        specs[f"{hf}{name}_proj.weight"] = TensorSpec(
            (*ours, f"{name}_proj"), (heads * h, d), _linear_in_heads(heads, h)
        )
        if a.attention_bias:
            specs[f"{hf}{name}_proj.bias"] = TensorSpec(
                (*ours, f"{name}_bias"), (heads * h,), _bias_heads(heads, h)
            )
    specs[f"{hf}o_proj.weight"] = TensorSpec(
        (*ours, "o_proj"), (d, a.num_heads * h), _linear_out_of_heads(a.num_heads, h)
    )
    if a.attention_out_bias:
        specs[f"{hf}o_proj.bias"] = TensorSpec((*ours, "o_bias"), (d,), _identity)
    if a.qk_norm:
        for name in ("q", "k"):
            specs[f"{hf}{name}_norm.weight"] = TensorSpec((*ours, f"{name}_norm"), (h,), _identity)
    return specs


def _layer_specs(a: ModelArchConfig, i: int) -> dict[str, TensorSpec]:
    hf, layer = f"model.layers.{i}.", f"layers_{i}"
    d, f = a.hidden_size, a.intermediate_size
    specs = _attention_specs(a, i)
    specs[f"{hf}input_layernorm.weight"] = TensorSpec(
        (layer, "input_norm", "scale"), (d,), _identity
    )
    specs[f"{hf}post_attention_layernorm.weight"] = TensorSpec(
        (layer, "post_attn_norm", "scale"), (d,), _identity
    )
    for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
        specs[f"{hf}mlp.{name}.weight"] = TensorSpec((layer, "mlp", name), shape, _transpose)
    return specs


def hf_tensor_specs(a: ModelArchConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `a` must hold, by HF name (lm_head only when untied)."""
    specs = {
        "model.embed_tokens.weight": TensorSpec(
            ("embed",), (a.vocab_size, a.hidden_size), _identity
        ),
        "model.norm.weight": TensorSpec(("final_norm", "scale"), (a.hidden_size,), _identity),
    }
    if not a.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec(("lm_head",), (a.vocab_size, a.hidden_size), _identity)
    for i in range(a.num_layers):
        specs.update(_layer_specs(a, i))
    return specs


def is_ignorable(name: str, a: ModelArchConfig) -> bool:
    """True for tensors that are known to carry nothing we need.

    A tied model's checkpoint may still hold lm_head.weight (a copy of the embedding, as HF
    itself ties it over at load); anything else unexpected is an error for the caller.
    """
    if name.endswith(IGNORABLE_SUFFIXES):
        return True
    return a.tie_word_embeddings and name == "lm_head.weight"
