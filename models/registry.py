"""Registry of supported HF architectures: config.json dict -> ModelArchConfig.

Each family is a small function reading the keys that distinguish it; everything else is shared.
Both RoPE spellings found in the wild are accepted:

    transformers < 5:  "rope_theta": 500000.0, "rope_scaling": {"rope_type"|"type": ..., ...}
    transformers >= 5: "rope_parameters": {"rope_type": ..., "rope_theta": 500000.0, ...}

Both may be present when they describe the same scaling; when they differ, the config is
refused rather than one silently preferred. A feature the shared
decoder does not implement raises ValueError naming it, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jaxserve.models.arch_config import (
    HIDDEN_ACTS,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    ModelArchConfig,
    normalize_rope_scaling,
)

# model_type -> architecture, for configs written without an `architectures` list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


# A config.json value that is present but None is treated as absent only for these keys, where
# transformers itself documents None as "derive it" (head_dim = hidden // heads; no GQA).
_NULL_MEANS_DERIVED = ("head_dim", "num_key_value_heads")


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """config.json's `key` as an int >= 1, or `default` when the key is absent.

    Raises:
        ValueError: the key is absent and has no default, or its value is < 1 (named).
        TypeError: the value is not an int (bool, float, string and null included), named.
    """
    if key not in cfg or (cfg[key] is None and key in _NULL_MEANS_DERIVED):
        if default is None:
            raise ValueError(f"config.json lacks required key {key!r}")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"config.json {key} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"config.json {key} must be >= 1, got {value}")
    return value


def _float(where: str, value: object) -> float:
    """A positive, finite float from a config value; `where` names it in errors.

    Raises:
        TypeError: not a number (bool, string and null included).
        ValueError: not finite or <= 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"config.json {where} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"config.json {where} must be a finite number > 0, got {value!r}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str) -> bool:
    """config.json's boolean `key`; absent or null means False (transformers' default for every
    flag read here). A string such as "false" would be truthy: refused, not guessed."""
    value = cfg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"config.json {key} must be true or false, got {value!r}")
    return value


def _rope_theta(cfg: dict[str, Any], params: dict[str, Any], scaling: dict[str, Any]) -> float:
    """rope_theta, which may be written at the top level and inside either RoPE dict; every
    place that gives it must agree (transformers would silently take one of them)."""
    given = {
        where: value
        for where, value in (
            ("rope_theta", cfg.get("rope_theta")),
            ("rope_parameters['rope_theta']", params.get("rope_theta")),
            ("rope_scaling['rope_theta']", scaling.get("rope_theta")),
        )
        if value is not None
    }
    thetas = {where: _float(where, value) for where, value in given.items()}
    if len(set(thetas.values())) > 1:
        raise ValueError(f"config.json gives different RoPE thetas: {thetas}")
    return next(iter(thetas.values()), 10000.0)


def _rope_dict(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """cfg[key] as a flat dict ({} when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
        raise ValueError(
            f"config.json {key} must be one flat dict (per-layer-type RoPE is unsupported), "
            f"got {value!r}"
        )
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, canonical rope_scaling) from either config form, or both when they agree.

    Raises:
        ValueError: rope_parameters and rope_scaling both given and describing different
            scalings, or different thetas given; an unsupported or malformed scaling.
    """
    params, scaling = _rope_dict(cfg, "rope_parameters"), _rope_dict(cfg, "rope_scaling")
    try:
        from_params = normalize_rope_scaling(params or None)
        from_scaling = normalize_rope_scaling(scaling or None)
    except ValueError as e:
        raise ValueError(f"config.json {e}") from None
    if params and scaling and from_params != from_scaling:
        # transformers 5 takes rope_scaling's type and factors and rope_parameters' theta; older
        # versions read rope_scaling only: no reading is safe, so ask for one consistent file.
        raise ValueError(
            f"config.json rope_parameters={params!r} and rope_scaling={scaling!r} describe "
            f"different RoPE scalings ({from_params} vs {from_scaling}); keep one of them"
        )
    return _rope_theta(cfg, params, scaling), from_params if params else from_scaling


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(f"config.json eos_token_id must be an int or a list of ints, got {value!r}")


def _token_id(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"config.json {key} must be an int >= 0 or null, got {value!r}")
    return value


def _reject(cfg: dict[str, Any], key: str, ok: object, what: str) -> None:
    value = cfg.get(key, ok)
    if value not in (ok, None):
        raise ValueError(f"config.json {key}={value!r} is unsupported ({what})")


def _sizes(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's sizes, each read and checked (int >= 1) before any arithmetic uses it."""
    num_heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    # Floor division, as transformers: the projections are sized by head_dim, not hidden.
    derived_head_dim = hidden // num_heads
    if derived_head_dim < 1 and cfg.get("head_dim") is None:
        raise ValueError(
            f"config.json hidden_size={hidden} is smaller than num_attention_heads={num_heads} "
            "and no head_dim is given"
        )
    return dict(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=_int(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", num_heads),
        head_dim=_int(cfg, "head_dim", derived_head_dim),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
    )


def _common(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    theta, scaling = _rope(cfg)
    hidden_act = cfg.get("hidden_act", "silu")
    if not isinstance(hidden_act, str):
        raise TypeError(f"config.json hidden_act must be a string, got {hidden_act!r}")
    out = dict(
        architecture=architecture,
        **_sizes(cfg),
        rms_norm_eps=_float("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
        hidden_act=hidden_act,
        bos_token_id=_token_id(cfg, "bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        initializer_range=_float("initializer_range", cfg.get("initializer_range", 0.02)),
    )
    _reject(cfg, "mlp_bias", False, "bias on MLP projections")
    _reject(cfg, "attn_logit_softcapping", None, "attention logit soft-capping")
    return out


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg, "LlamaForCausalLM")
    bias = _bool(cfg, "attention_bias")  # HF Llama: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias)


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg, "MistralForCausalLM")
    window = cfg.get("sliding_window")  # null: full attention
    return out | dict(sliding_window=None if window is None else _int(cfg, "sliding_window"))


def _qwen_sliding(cfg: dict[str, Any]) -> None:
    # Qwen2/3 slide only on layers >= max_window_layers when enabled: per-layer windows are not
    # implemented, so refuse rather than silently attend to everything.
    _reject(cfg, "use_sliding_window", False, "Qwen per-layer sliding-window attention")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json layer_types={layer_types!r} is unsupported (not all full)")


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = _common(cfg, "Qwen2ForCausalLM")
    return out | dict(attention_bias=True, attention_out_bias=False)  # fixed by the family


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = _common(cfg, "Qwen3ForCausalLM")
    bias = _bool(cfg, "attention_bias")  # HF Qwen3: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias, qk_norm=True)


# --- Mixtral, Qwen3-MoE, Phi-3 ---------------------------------------------------------------
# Phi3Config's class default, which transformers applies when config.json omits the key.
_PHI3_ORIGINAL_MAX_POSITIONS = 4096


def _num_experts(cfg: dict[str, Any]) -> int:
    """E, from either spelling: num_local_experts (Mixtral; what transformers 5 writes for
    both families) or num_experts (Qwen3-MoE on the Hub). Both given and different: refused."""
    given = {k: _int(cfg, k) for k in ("num_local_experts", "num_experts") if k in cfg}
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


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    _router_jitter(cfg)
    out = _mistral(cfg) | dict(architecture="MixtralForCausalLM")
    return out | dict(  # every layer is MoE; each expert has the config's intermediate_size
        num_experts=_num_experts(cfg),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
        moe_intermediate_size=out["intermediate_size"],
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        moe_layers=tuple(range(out["num_layers"])),
    )


def _qwen3_moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers whose MLP is MoE: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0,
    as transformers decides; the others are dense (intermediate_size)."""
    step = _int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in dense
    ):
        raise ValueError(
            f"config.json mlp_only_layers must be a list of layer indices in [0, {num_layers}), "
            f"got {dense!r}"
        )
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _qwen3(cfg) | dict(architecture="Qwen3MoeForCausalLM")
    return out | dict(
        num_experts=_num_experts(cfg),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
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
    d = dict(_rope_dict(cfg, key))
    partial = d.pop("partial_rotary_factor", None)
    if partial is not None and partial != 1:
        raise ValueError(f"config.json {key} partial_rotary_factor={partial!r} is unsupported")
    if d.get("type", d.get("rope_type")) not in ("longrope", "su"):
        return d
    d.pop("type", None)
    d["rope_type"] = "longrope"
    original = _int(cfg, "original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS)
    if d.get("original_max_position_embeddings", original) != original:
        raise ValueError(
            f"config.json {key} original_max_position_embeddings="
            f"{d['original_max_position_embeddings']!r} differs from the top-level "
            f"original_max_position_embeddings={original} (which transformers uses)"
        )
    d["original_max_position_embeddings"] = original
    factor = d.pop("factor", None)
    if d.get("attention_factor") is None:
        factor = _float(f"{key} factor", factor) if factor is not None else None
        factor = factor or _int(cfg, "max_position_embeddings", 2048) / original
        scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        d["attention_factor"] = scale
    return d


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: the Mistral decoder (sliding_window may be null) with fused qkv_proj and
    gate_up_proj tensors (split at load, checkpoints_tools/hf_names.py) and LongRoPE."""
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ValueError(f"config.json partial_rotary_factor={partial!r} is unsupported")
    _reject(cfg, "attention_bias", False, "bias on Phi-3 projections")
    rope = {k: _phi3_rope_dict(cfg, k) for k in ("rope_parameters", "rope_scaling") if k in cfg}
    return _mistral(cfg | rope) | dict(architecture="Phi3ForCausalLM")


# --- Gemma, Gemma 2, Gemma 3 (text) ---------------------------------------------------------
# transformers' class defaults for the keys that change the math (and the special tokens),
# applied where config.json omits them (published configs do, e.g. Gemma 1 never writes
# tie_word_embeddings); a key present as null keeps its null.
_GEMMA_DEFAULTS: dict[str, Any] = dict(
    head_dim=256,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=2,
    eos_token_id=1,
)
_GEMMA2_DEFAULTS = _GEMMA_DEFAULTS | dict(
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
)
_GEMMA3_DEFAULTS = _GEMMA2_DEFAULTS | dict(
    attn_logit_softcapping=None, final_logit_softcapping=None, max_position_embeddings=131072
)
_GEMMA3_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# cache_implementation names transformers' KV cache class (Gemma 2/3 configs say "hybrid":
# windowed and full layers); jaxserve's paged cache stands in for any of these, which keep
# K and V exact. Another (e.g. "quantized") would change the numbers: refused.
_EXACT_HF_CACHES = ("dynamic", "static", "hybrid", "sliding_window", "offloaded")


def _optional_float(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    return None if value is None else _float(key, value)


def _gemma_common(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """What every Gemma shares: (1 + w) norms, sqrt(D)-scaled embeddings, tied head by default,
    causal attention only."""
    _reject(cfg, "use_bidirectional_attention", False, "bidirectional attention")
    cache = cfg.get("cache_implementation")
    if cache is not None and cache not in _EXACT_HF_CACHES:
        raise ValueError(
            f"config.json cache_implementation={cache!r} is unsupported; supported: "
            f"{_EXACT_HF_CACHES} (all served by the paged KV cache)"
        )
    # sliding_window_size: the duplicate some Gemma 2 configs carry; it must not disagree.
    _reject(cfg, "sliding_window_size", cfg.get("sliding_window"), "must equal sliding_window")
    # Soft-capping is read by the Gemma functions themselves, not refused as in _common.
    rest = {k: v for k, v in cfg.items() if k != "attn_logit_softcapping"}
    bias = _bool(cfg, "attention_bias")  # HF Gemma: on q, k, v and o
    return _common(rest, architecture) | dict(
        attention_bias=bias,
        attention_out_bias=bias,
        norm_unit_offset=True,
        scale_embeddings=True,
    )


def _gemma_activation(cfg: dict[str, Any], default: str, legacy_gelu: bool) -> str:
    """The MLP activation from hidden_activation and hidden_act (both spellings are found).

    legacy_gelu (Gemma 1): hidden_act "gelu" means the tanh approximation, as transformers
    reads it. Both given and meaning different functions: refused, since transformers versions
    disagree on which one wins."""
    acts = {k: cfg[k] for k in ("hidden_activation", "hidden_act") if cfg.get(k) is not None}
    for key, value in acts.items():
        if not isinstance(value, str):
            raise TypeError(f"config.json {key} must be a string, got {value!r}")
    if legacy_gelu and acts.get("hidden_act") == "gelu":
        acts["hidden_act"] = "gelu_pytorch_tanh"
    if len(set(acts.values())) > 1:
        raise ValueError(f"config.json gives different activations: {acts}")
    for key, value in acts.items():
        if value not in HIDDEN_ACTS:
            raise ValueError(
                f"config.json {key}={value!r} is unsupported; supported: {HIDDEN_ACTS}"
            )
    return next(iter(acts.values()), default)


def _gemma_layer_types(
    cfg: dict[str, Any], num_layers: int, default_pattern: int
) -> tuple[str, ...]:
    """Each layer's attention kind: `layer_types` when given, else every `pattern`-th layer
    (1-based) is global and the others slide (sliding_window_pattern, or the family's default:
    2 for Gemma 2, 6 for Gemma 3). Both given and disagreeing: refused."""
    pattern = _int(cfg, "sliding_window_pattern", default_pattern)
    from_pattern = tuple(
        "full_attention" if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )
    types = cfg.get("layer_types")
    if types is None:
        return from_pattern
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json layer_types must be a list of {LAYER_TYPES}, got {types!r}")
    if len(types) != num_layers:
        raise ValueError(
            f"config.json layer_types has {len(types)} entries, num_hidden_layers={num_layers}"
        )
    if "sliding_window_pattern" in cfg and tuple(types) != from_pattern:
        raise ValueError(
            f"config.json layer_types={types!r} disagrees with sliding_window_pattern={pattern}"
        )
    return tuple(types)


def _gemma_window(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """sliding_window and layer_types; sliding layers with a null window are refused."""
    if cfg.get("sliding_window") is None:
        if SLIDING_ATTENTION in layer_types:
            raise ValueError("config.json sliding_window is null but some layers slide")
        return dict(sliding_window=None, layer_types=layer_types)
    return dict(sliding_window=_int(cfg, "sliding_window"), layer_types=layer_types)


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA_DEFAULTS | cfg
    _reject(cfg, "attn_logit_softcapping", None, "not part of Gemma 1")
    _reject(cfg, "final_logit_softcapping", None, "not part of Gemma 1")
    out = _gemma_common(cfg, "GemmaForCausalLM")
    return out | dict(hidden_act=_gemma_activation(cfg, "gelu_pytorch_tanh", legacy_gelu=True))


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA2_DEFAULTS | cfg
    out = _gemma_common(cfg, "Gemma2ForCausalLM")
    layer_types = _gemma_layer_types(cfg, out["num_layers"], default_pattern=2)
    return (
        out
        | _gemma_window(cfg, layer_types)
        | dict(
            hidden_act=_gemma_activation(cfg, "gelu_pytorch_tanh", legacy_gelu=False),
            sandwich_norms=True,
            query_pre_attn_scalar=_float("query_pre_attn_scalar", cfg["query_pre_attn_scalar"]),
            attn_logit_softcap=_optional_float(cfg, "attn_logit_softcapping"),
            final_logit_softcap=_optional_float(cfg, "final_logit_softcapping"),
        )
    )


def _gemma3_rope_of(cfg: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, canonical scaling) of one layer kind, from every place that may give it."""
    new = cfg.get("rope_parameters") or {}
    if kind == "full_attention":  # rope_theta and rope_scaling describe the global layers
        theta_key, old = "rope_theta", _rope_dict(cfg, "rope_scaling")
    else:
        theta_key, old = "rope_local_base_freq", {}
    sources = {
        f"rope_parameters[{kind!r}]": new.get(kind) or {},
        theta_key: {} if cfg.get(theta_key) is None else {"rope_theta": cfg[theta_key]},
        "rope_scaling": old,
    }
    thetas = {}
    for where, d in sources.items():
        if not isinstance(d, dict):
            raise ValueError(f"config.json {where} must be a dict, got {d!r}")
        if d.get("rope_theta") is not None:
            thetas[where] = _float(f"{where} rope_theta", d["rope_theta"])
    if len(set(thetas.values())) > 1:
        raise ValueError(f"config.json gives different RoPE thetas for {kind}: {thetas}")
    try:
        scalings = {
            w: normalize_rope_scaling(d) for w, d in sources.items() if set(d) - {"rope_theta"}
        }
    except ValueError as e:
        raise ValueError(f"config.json ({kind}) {e}") from None
    if len({repr(v) for v in scalings.values()}) > 1:
        raise ValueError(
            f"config.json describes different RoPE scalings for {kind}: {scalings}; keep one"
        )
    return next(iter(thetas.values()), _GEMMA3_THETAS[kind]), next(iter(scalings.values()), None)


def _gemma3_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Global and local RoPE of Gemma 3, from either spelling:

        transformers < 5:  rope_theta, rope_scaling (global layers), rope_local_base_freq
        transformers >= 5: rope_parameters = {"full_attention": {...},
                                              "sliding_attention": {...}}

    Both may be present when they agree. The sliding layers take no scaling (transformers < 5
    had no way to give them one): one there is refused.
    """
    params = cfg.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or set(params) - set(_GEMMA3_THETAS)):
        raise ValueError(
            f"config.json rope_parameters must be a dict by layer type "
            f"{sorted(_GEMMA3_THETAS)} for Gemma 3, got {params!r}"
        )
    theta, scaling = _gemma3_rope_of(cfg, "full_attention")
    local_theta, local_scaling = _gemma3_rope_of(cfg, "sliding_attention")
    if local_scaling is not None:
        raise ValueError(
            f"config.json gives the sliding layers a RoPE scaling {local_scaling}; only the "
            "global layers may be scaled"
        )
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA3_DEFAULTS | cfg
    # transformers' Gemma 3 attention never applies it: refused rather than guessed.
    _reject(cfg, "attn_logit_softcapping", None, "Gemma 3 attention has no soft-capping")
    rope = _gemma3_rope(cfg)
    # _common's own RoPE reading knows one flat dict: hand it the global RoPE only.
    flat = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    out = _gemma_common(flat | {"rope_theta": rope["rope_theta"]}, "Gemma3ForCausalLM")
    layer_types = _gemma_layer_types(cfg, out["num_layers"], default_pattern=6)
    out |= rope | _gemma_window(cfg, layer_types)
    if SLIDING_ATTENTION not in layer_types:
        out["local_rope_theta"] = None  # no layer would use it
    return out | dict(
        hidden_act=_gemma_activation(cfg, "gelu_pytorch_tanh", legacy_gelu=False),
        sandwich_norms=True,
        qk_norm=True,
        query_pre_attn_scalar=_float("query_pre_attn_scalar", cfg["query_pre_attn_scalar"]),
        final_logit_softcap=_optional_float(cfg, "final_logit_softcapping"),
    )


# Gemma3TextConfig's defaults for the sizes a published text_config omits (it lists only what
# differs, e.g. google/gemma-3-12b-it names no vocab_size or head_dim).
_GEMMA3_TEXT_SIZES: dict[str, Any] = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
)


def _gemma3_multimodal(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text tower of Gemma3ForConditionalGeneration: text_config read as a Gemma 3 config.
    The vision tower and projector are not run (hf_names.TEXT_TOWERS names their tensors as
    ignored); prompts are token ids or text only."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json text_config must be a dict, got {text!r}")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(
            f"config.json text_config model_type={text['model_type']!r} is unsupported "
            "(expected 'gemma3_text')"
        )
    # The wrapper's own copies of text keys: the outer eos (generation stops) wins, as in
    # transformers' generation config; a head tied in one place and not the other is refused.
    outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    ties = {
        where: c["tie_word_embeddings"]
        for where, c in (("config.json", cfg), ("text_config", text))
        if c.get("tie_word_embeddings") is not None
    }
    if len(set(ties.values())) > 1:
        raise ValueError(f"config.json and its text_config disagree on tie_word_embeddings: {ties}")
    merged = _GEMMA3_TEXT_SIZES | text | outer | dict(tie_word_embeddings=all(ties.values()))
    return _gemma3(merged) | dict(architecture="Gemma3ForConditionalGeneration")


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Phi3ForCausalLM": _phi3,
    "GemmaForCausalLM": _gemma,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Gemma3ForConditionalGeneration": _gemma3_multimodal,  # its text tower
}


def architecture_of(cfg: dict[str, Any]) -> str:
    """The HF architecture name of a config dict (`architectures[0]`, else from `model_type`)."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise TypeError(f"config.json architectures must be a list of names, got {archs!r}")
    if len(archs) > 1:
        raise ValueError(f"config.json lists several architectures {archs}; expected one")
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"config.json names no architecture (architectures=None, model_type={model_type!r}); "
        f"supported: {sorted(ARCHITECTURES)}"
    )


def arch_config_from_hf(cfg: dict[str, Any]) -> ModelArchConfig:
    """Build the ModelArchConfig of a Hugging Face config.json dict.

    Every value is checked before it is used (no ZeroDivisionError from a zero head count, no
    float() error from a null), and each error names the config.json key and its value.

    Args:
        cfg: the parsed config.json.

    Returns:
        The architecture.

    Raises:
        ValueError: unsupported architecture or rope type (named), a missing required key, a
            size < 1, rope_parameters and rope_scaling that disagree, or a configured feature
            the decoder does not implement (named with its value).
        TypeError: a value of the wrong type (e.g. null or a float where an int is needed).
    """
    arch = architecture_of(cfg)
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    return ModelArchConfig(**family(cfg))
