"""Hugging Face tensor names -> jaxserve params: where each tensor goes and how it is reshaped.

HF stores nn.Linear weights as [out, in]; our einsum layouts put the input axis first and split
the head axes (q_proj f[D, N, H], o_proj f[N, H, D], ...; see models/causal_lm.py).

Most tensors fill one param. Two generalisations, each still read once: per-expert MoE tensors
(Mixtral's block_sparse_moe.experts.{e}.w1, Qwen3-MoE's mlp.experts.{e}.gate_proj, ...) are
slice e of one stacked param (TensorSpec.stack), and Phi-3's fused qkv_proj / gate_up_proj are
split into our separate q/k/v and gate/up params (TensorSpec.more), so the decoder, its TP
specs and its init policy stay those of every other family.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from jaxserve.models import ModelArchConfig

# Tensors that are not weights of ours: old Llama checkpoints saved the RoPE table; FP8-KV
# checkpoints (llm-compressor) ship each layer's KV-cache scales, which the runner reads on its
# own for kv_cache_dtype="fp8" (jaxserve/runner/kv_scales.py) and which mean nothing otherwise.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq", ".self_attn.k_scale", ".self_attn.v_scale")


@dataclass(frozen=True)
class TextTower:
    """Where a multimodal checkpoint keeps the text decoder we run, and what else it holds.

    layouts: (prefix standing for the decoder's "model.", name prefix of lm_head), one per
        transformers layout (before and after its 4.52 refactor; 5.x saves the first again).
    ignored: name prefixes of the towers we do not run (vision encoder, projector).
    """

    layouts: tuple[tuple[str, str], ...]
    ignored: tuple[str, ...]


TEXT_TOWERS = {
    "Gemma3ForConditionalGeneration": TextTower(
        layouts=(
            ("language_model.model.", "language_model.lm_head."),
            ("model.language_model.", "lm_head."),
        ),
        ignored=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
    ),
}


@dataclass(frozen=True)
class ParamPart:
    """A param filled from (a part of) one HF tensor."""

    param_path: tuple[str, ...]  # key path into the params pytree
    convert: Callable[[np.ndarray], np.ndarray]  # the whole HF tensor -> this param's layout


@dataclass(frozen=True)
class TensorSpec:
    param_path: tuple[str, ...]  # key path into the params pytree
    hf_shape: tuple[int, ...]  # shape in the checkpoint
    convert: Callable[[np.ndarray], np.ndarray]  # HF layout -> param layout
    # (i, E): the converted tensor is slice [i] of param_path, which stacks E such tensors.
    stack: tuple[int, int] | None = None
    # Further params cut from the same tensor (fused projections); never with `stack`.
    more: tuple[ParamPart, ...] = ()

    def targets(self) -> tuple[ParamPart, ...]:
        """Every param this tensor fills: param_path first, then `more`."""
        return (ParamPart(self.param_path, self.convert), *self.more)


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
    fused = a.architecture in _FUSED_PROJECTIONS
    specs = _fused_attention_specs(a, i) if fused else _attention_specs(a, i)
    # Our post_attn_norm is the norm before the MLP. HF's post_attention_layernorm is that norm
    # in Llama-like layers; with sandwich norms (Gemma 2/3) it norms the attention output, and
    # pre_feedforward_layernorm is the one before the MLP.
    norms = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm"}
    if a.sandwich_norms:
        norms = {
            "input_layernorm": "input_norm",
            "post_attention_layernorm": "attn_out_norm",
            "pre_feedforward_layernorm": "post_attn_norm",
            "post_feedforward_layernorm": "mlp_out_norm",
        }
    for hf_name, ours in norms.items():
        specs[f"{hf}{hf_name}.weight"] = TensorSpec((layer, ours, "scale"), (d,), _identity)
    if a.is_moe_layer(i):
        specs.update(_moe_specs(a, i))
        return specs
    if fused:
        specs[f"{hf}mlp.gate_up_proj.weight"] = _split_rows(
            (2 * f, d), [((layer, "mlp", "gate_proj"), 0, f), ((layer, "mlp", "up_proj"), f, 2 * f)]
        )
        specs[f"{hf}mlp.down_proj.weight"] = TensorSpec(
            (layer, "mlp", "down_proj"), (d, f), _transpose
        )
        return specs
    for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
        specs[f"{hf}mlp.{name}.weight"] = TensorSpec((layer, "mlp", name), shape, _transpose)
    return specs


# --- Phi-3 (fused projections) and the MoE families ------------------------------------------
# Families whose checkpoints fuse q/k/v into qkv_proj [(N + 2K) * H, D] and gate/up into
# gate_up_proj [2F, D] (rows in that order).
_FUSED_PROJECTIONS = ("Phi3ForCausalLM",)

# MoE checkpoint names: the block's prefix in a layer, and each stacked param's per-expert name.
# transformers 5.24's save_pretrained writes these per-expert tensors too, as the Hub's files.
_MOE_NAMES = {
    "MixtralForCausalLM": (
        "block_sparse_moe",
        {"experts_gate": "w1", "experts_up": "w3", "experts_down": "w2"},
    ),
    "Qwen3MoeForCausalLM": (
        "mlp",
        {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"},
    ),
}


def _rows_then(
    start: int, stop: int, convert: Callable[[np.ndarray], np.ndarray]
) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: convert(w[start:stop])  # a view of the rows, converted (one copy)


def _split_rows(
    hf_shape: tuple[int, int],
    parts: list[tuple[tuple[str, ...], int, int]],
    converts: list[Callable[[np.ndarray], np.ndarray]] | None = None,
) -> TensorSpec:
    """A fused [out, in] tensor whose row ranges [start, stop) are separate params."""
    converts = converts or [_transpose] * len(parts)
    targets = [
        ParamPart(path, _rows_then(start, stop, convert))
        for (path, start, stop), convert in zip(parts, converts, strict=True)
    ]
    first, *rest = targets
    return TensorSpec(first.param_path, hf_shape, first.convert, more=tuple(rest))


def _fused_attention_specs(a: ModelArchConfig, i: int) -> dict[str, TensorSpec]:
    hf, ours = f"model.layers.{i}.self_attn.", (f"layers_{i}", "attn")
    d, h, q, kv = a.hidden_size, a.head_dim, a.q_size, a.kv_size
    heads = (("q", a.num_heads, 0, q), ("k", a.num_kv_heads, q, q + kv))
    heads += (("v", a.num_kv_heads, q + kv, q + 2 * kv),)
    return {
        f"{hf}qkv_proj.weight": _split_rows(
            (q + 2 * kv, d),
            [((*ours, f"{name}_proj"), start, stop) for name, _, start, stop in heads],
            [_linear_in_heads(n, h) for _, n, _, _ in heads],
        ),
        f"{hf}o_proj.weight": TensorSpec(
            (*ours, "o_proj"), (d, q), _linear_out_of_heads(a.num_heads, h)
        ),
    }


def _moe_specs(a: ModelArchConfig, i: int) -> dict[str, TensorSpec]:
    if a.architecture not in _MOE_NAMES:
        raise ValueError(f"no MoE checkpoint names known for {a.architecture!r}")
    block, expert_names = _MOE_NAMES[a.architecture]
    hf, ours = f"model.layers.{i}.{block}.", (f"layers_{i}", "moe")
    d, e, f = a.hidden_size, a.num_experts, a.moe_intermediate_size
    specs = {f"{hf}gate.weight": TensorSpec((*ours, "router"), (e, d), _transpose)}
    shapes = {"experts_gate": (f, d), "experts_up": (f, d), "experts_down": (d, f)}
    # Param by param, so that one stacked param is being filled at a time.
    for param, hf_name in expert_names.items():
        for j in range(e):
            specs[f"{hf}experts.{j}.{hf_name}.weight"] = TensorSpec(
                (*ours, param), shapes[param], _transpose, stack=(j, e)
            )
    return specs


def hf_tensor_specs(
    a: ModelArchConfig, present: Collection[str] | None = None
) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `a` must hold, by HF name (lm_head only when untied).

    Args:
        present: the names the checkpoint holds. For a multimodal architecture (TEXT_TOWERS)
            they tell which transformers layout it was saved in (default: the first).
    """
    specs = _decoder_specs(a)
    tower = TEXT_TOWERS.get(a.architecture)
    if tower is None:
        return specs
    names = present or ()
    saved = (lay for lay in tower.layouts if any(n.startswith(lay[0]) for n in names))
    model, head = next(saved, tower.layouts[0])
    return {_rename(name, model, head): spec for name, spec in specs.items()}


def _rename(name: str, model: str, head: str) -> str:
    if name.startswith("model."):
        return model + name.removeprefix("model.")
    return head + name.removeprefix("lm_head.")


def _decoder_specs(a: ModelArchConfig) -> dict[str, TensorSpec]:
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
    itself ties it over at load); a multimodal checkpoint holds the towers we do not run
    (TextTower.ignored); anything else unexpected is an error for the caller.
    """
    if name.endswith(IGNORABLE_SUFFIXES):
        return True
    tower = TEXT_TOWERS.get(a.architecture)
    if tower is not None and name.startswith(tower.ignored):
        return True  # named, never read: the towers jaxserve does not run
    heads = [head for _, head in tower.layouts] if tower else ["lm_head."]
    return a.tie_word_embeddings and name in [head + "weight" for head in heads]
