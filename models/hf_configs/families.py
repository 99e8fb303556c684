"""Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and Phi-3: config.json -> ModelArchConfig
fields, each the keys that distinguish it on top of readers.common_fields."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.models.hf_configs.readers import (
    bool_key,
    common_fields,
    int_key,
    positive_float,
    read_rope_dict,
    reject_key,
)


def llama(cfg: dict[str, Any]) -> dict[str, Any]:
    out = common_fields(cfg, "LlamaForCausalLM")
    bias = bool_key(cfg, "attention_bias")  # HF Llama: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias)


def mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    out = common_fields(cfg, "MistralForCausalLM")
    window = cfg.get("sliding_window")  # null: full attention
    return out | dict(sliding_window=None if window is None else int_key(cfg, "sliding_window"))


def _qwen_sliding(cfg: dict[str, Any]) -> None:
    # Qwen2/3 slide only on layers >= max_window_layers when enabled: per-layer windows are not
    # implemented, so refuse rather than silently attend to everything.
    reject_key(cfg, "use_sliding_window", False, "Qwen per-layer sliding-window attention")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json layer_types={layer_types!r} is unsupported (not all full)")


def qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = common_fields(cfg, "Qwen2ForCausalLM")
    return out | dict(attention_bias=True, attention_out_bias=False)  # fixed by the family


def qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = common_fields(cfg, "Qwen3ForCausalLM")
    bias = bool_key(cfg, "attention_bias")  # HF Qwen3: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias, qk_norm=True)


# --- Mixtral, Qwen3-MoE, Phi-3 ---------------------------------------------------------------
# Phi3Config's class default, which transformers applies when config.json omits the key.
_PHI3_ORIGINAL_MAX_POSITIONS = 4096


def _num_experts(cfg: dict[str, Any]) -> int:
    """E, from either spelling: num_local_experts (Mixtral; what transformers 5 writes for
    both families) or num_experts (Qwen3-MoE on the Hub). Both given and different: refused."""
    given = {k: int_key(cfg, k) for k in ("num_local_experts", "num_experts") if k in cfg}
    if not given:
        raise ValueError("config.json lacks required key 'num_local_experts' (or 'num_experts')")
    if len(set(given.values())) > 1:
        raise ValueError(f"config.json gives different expert counts: {given}")
    return next(iter(given.values()))


def _router_jitter(cfg: dict[str, Any]) -> None:
    """router_jitter_noise multiplies the MoE input by noise in training only (transformers
    skips it in eval mode): accepted and without effect at inference, once checked."""
    value = cfg.get("router_jitter_noise")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"config.json router_jitter_noise must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"config.json router_jitter_noise must be >= 0, got {value!r}")


def mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    _router_jitter(cfg)
    out = mistral(cfg) | dict(architecture="MixtralForCausalLM")
    return out | dict(  # every layer is MoE; each expert has the config's intermediate_size
        num_experts=_num_experts(cfg),
        num_experts_per_tok=int_key(cfg, "num_experts_per_tok"),
        moe_intermediate_size=out["intermediate_size"],
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        moe_layers=tuple(range(out["num_layers"])),
    )


def _qwen3_moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers whose MLP is MoE: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0,
    as transformers decides; the others are dense (intermediate_size)."""
    step = int_key(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in dense
    ):
        raise ValueError(
            f"config.json mlp_only_layers must be a list of layer indices in [0, {num_layers}), "
            f"got {dense!r}"
        )
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    out = qwen3(cfg) | dict(architecture="Qwen3MoeForCausalLM")
    return out | dict(
        num_experts=_num_experts(cfg),
        num_experts_per_tok=int_key(cfg, "num_experts_per_tok"),
        moe_intermediate_size=int_key(cfg, "moe_intermediate_size"),
        norm_topk_prob=bool_key(cfg, "norm_topk_prob"),
        moe_layers=_qwen3_moe_layers(cfg, out["num_layers"]),
    )


def _phi3_rope_dict(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """cfg[key] (rope_parameters or rope_scaling) in the form normalize_rope_scaling reads.

    partial_rotary_factor 1 is dropped (transformers 5 writes it), any other value refused.
    A LongRoPE dict ("longrope", or its old name "su") gets what transformers derives:
    original_max_position_embeddings from the top-level key (which wins over the dict's in
    transformers: a different value in the dict is refused), and attention_factor, when not
    given, sqrt(1 + ln(factor) / ln(original)) for factor > 1, else 1, with factor defaulting
    to max_position_embeddings / original_max_position_embeddings.
    """
    d = dict(read_rope_dict(cfg, key))
    partial = d.pop("partial_rotary_factor", None)
    if partial is not None and partial != 1:
        raise ValueError(f"config.json {key} partial_rotary_factor={partial!r} is unsupported")
    if d.get("type", d.get("rope_type")) not in ("longrope", "su"):
        return d
    d.pop("type", None)
    d["rope_type"] = "longrope"
    original = int_key(cfg, "original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS)
    if d.get("original_max_position_embeddings", original) != original:
        raise ValueError(
            f"config.json {key} original_max_position_embeddings="
            f"{d['original_max_position_embeddings']!r} differs from the top-level "
            f"original_max_position_embeddings={original} (which transformers uses)"
        )
    d["original_max_position_embeddings"] = original
    factor = d.pop("factor", None)
    if d.get("attention_factor") is None:
        factor = positive_float(f"{key} factor", factor) if factor is not None else None
        factor = factor or int_key(cfg, "max_position_embeddings", 2048) / original
        scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        d["attention_factor"] = scale
    return d


def phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: the Mistral decoder (sliding_window may be null) with fused qkv_proj and
    gate_up_proj tensors (split at load, checkpoints_tools/hf_names.py) and LongRoPE."""
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is unsupported")
    reject_key(cfg, "attention_bias", False, "bias on Phi-3 projections")
    rope = {k: _phi3_rope_dict(cfg, k) for k in ("rope_parameters", "rope_scaling") if k in cfg}
    return mistral(cfg | rope) | dict(architecture="Phi3ForCausalLM")


# --- Gemma, Gemma 2, Gemma 3 (text) ---------------------------------------------------------
# transformers' class defaults for the keys that change the math (and the special tokens),
# applied where config.json omits them (published configs do, e.g. Gemma 1 never writes
# tie_word_embeddings); a key present as null keeps its null.
