"""Gemma, Gemma 2 and Gemma 3 (text, and the text tower of the multimodal checkpoint):
config.json -> ModelArchConfig fields."""

from __future__ import annotations

from typing import Any

from jaxserve.models.arch_config import (
    HIDDEN_ACTS,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    normalize_rope_scaling,
)
from jaxserve.models.hf_configs.readers import (
    bool_key,
    common_fields,
    int_key,
    positive_float,
    read_rope_dict,
    reject_key,
)

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
    return None if value is None else positive_float(key, value)


def _gemma_common(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """What every Gemma shares: (1 + w) norms, sqrt(D)-scaled embeddings, tied head by default,
    causal attention only."""
    reject_key(cfg, "use_bidirectional_attention", False, "bidirectional attention")
    cache = cfg.get("cache_implementation")
    if cache is not None and cache not in _EXACT_HF_CACHES:
        raise ValueError(
            f"config.json cache_implementation={cache!r} is unsupported; supported: "
            f"{_EXACT_HF_CACHES} (all served by the paged KV cache)"
        )
    # sliding_window_size: the duplicate some Gemma 2 configs carry; it must not disagree.
    reject_key(cfg, "sliding_window_size", cfg.get("sliding_window"), "must equal sliding_window")
    # Soft-capping is read by the Gemma functions themselves, not refused as in common.
    rest = {k: v for k, v in cfg.items() if k != "attn_logit_softcapping"}
    bias = bool_key(cfg, "attention_bias")  # HF Gemma: on q, k, v and o
    return common_fields(rest, architecture) | dict(
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
    pattern = int_key(cfg, "sliding_window_pattern", default_pattern)
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
    return dict(sliding_window=int_key(cfg, "sliding_window"), layer_types=layer_types)


def gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA_DEFAULTS | cfg
    reject_key(cfg, "attn_logit_softcapping", None, "not part of Gemma 1")
    reject_key(cfg, "final_logit_softcapping", None, "not part of Gemma 1")
    out = _gemma_common(cfg, "GemmaForCausalLM")
    return out | dict(hidden_act=_gemma_activation(cfg, "gelu_pytorch_tanh", legacy_gelu=True))


def gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA2_DEFAULTS | cfg
    out = _gemma_common(cfg, "Gemma2ForCausalLM")
    layer_types = _gemma_layer_types(cfg, out["num_layers"], default_pattern=2)
    return (
        out
        | _gemma_window(cfg, layer_types)
        | dict(
            hidden_act=_gemma_activation(cfg, "gelu_pytorch_tanh", legacy_gelu=False),
            sandwich_norms=True,
            query_pre_attn_scalar=positive_float(
                "query_pre_attn_scalar", cfg["query_pre_attn_scalar"]
            ),
            attn_logit_softcap=_optional_float(cfg, "attn_logit_softcapping"),
            final_logit_softcap=_optional_float(cfg, "final_logit_softcapping"),
        )
    )


def _gemma3_rope_of(cfg: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, canonical scaling) of one layer kind, from every place that may give it."""
    new = cfg.get("rope_parameters") or {}
    if kind == "full_attention":  # rope_theta and rope_scaling describe the global layers
        theta_key, old = "rope_theta", read_rope_dict(cfg, "rope_scaling")
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
            thetas[where] = positive_float(f"{where} rope_theta", d["rope_theta"])
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


def gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = _GEMMA3_DEFAULTS | cfg
    # transformers' Gemma 3 attention never applies it: refused rather than guessed.
    reject_key(cfg, "attn_logit_softcapping", None, "Gemma 3 attention has no soft-capping")
    rope = _gemma3_rope(cfg)
    # common's own RoPE reading knows one flat dict: hand it the global RoPE only.
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
        query_pre_attn_scalar=positive_float("query_pre_attn_scalar", cfg["query_pre_attn_scalar"]),
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


def gemma3_multimodal(cfg: dict[str, Any]) -> dict[str, Any]:
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
    return gemma3(merged) | dict(architecture="Gemma3ForConditionalGeneration")
