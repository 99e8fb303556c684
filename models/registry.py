"""Registry of supported HF architectures: config.json dict -> ModelArchConfig.

Each family is a small function reading the keys that distinguish it; everything else is shared.
Both RoPE spellings found in the wild are accepted:

    transformers < 5:  "rope_theta": 500000.0, "rope_scaling": {"rope_type"|"type": ..., ...}
    transformers >= 5: "rope_parameters": {"rope_type": ..., "rope_theta": 500000.0, ...}

A feature the shared decoder does not implement raises ValueError naming it, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxserve.models.arch_config import ModelArchConfig, normalize_rope_scaling

# model_type -> architecture, for configs written without an `architectures` list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, canonical rope_scaling) from either config form."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                f"config.json rope_parameters must be one flat dict (per-layer-type RoPE is "
                f"unsupported), got {params!r}"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return float(theta), normalize_rope_scaling(params)
    return float(cfg.get("rope_theta", 10000.0)), normalize_rope_scaling(cfg.get("rope_scaling"))


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"config.json eos_token_id must be an int or a list of ints, got {value!r}")


def _reject(cfg: dict[str, Any], key: str, ok: object, what: str) -> None:
    value = cfg.get(key, ok)
    if value not in (ok, None):
        raise ValueError(f"config.json {key}={value!r} is unsupported ({what})")


def _common(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    try:
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        out = dict(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
    theta, scaling = _rope(cfg)
    head_dim = cfg.get("head_dim") or hidden // num_heads
    out.update(
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )
    _reject(cfg, "mlp_bias", False, "bias on MLP projections")
    _reject(cfg, "attn_logit_softcapping", None, "attention logit soft-capping")
    return out


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg, "LlamaForCausalLM")
    bias = bool(cfg.get("attention_bias", False))  # HF Llama: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias)


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg, "MistralForCausalLM")
    return out | dict(sliding_window=cfg.get("sliding_window"))


def _qwen_sliding(cfg: dict[str, Any]) -> None:
    # Qwen2/3 slide only on layers >= max_window_layers when enabled: per-layer windows are not
    # implemented, so refuse rather than silently attend to everything.
    _reject(cfg, "use_sliding_window", False, "Qwen per-layer sliding-window attention")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.json layer_types={layer_types!r} is unsupported (not all full)")


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = _common(cfg, "Qwen2ForCausalLM")
    return out | dict(attention_bias=True, attention_out_bias=False)  # fixed by the family


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    _qwen_sliding(cfg)
    out = _common(cfg, "Qwen3ForCausalLM")
    bias = bool(cfg.get("attention_bias", False))  # HF Qwen3: on q, k, v and o
    return out | dict(attention_bias=bias, attention_out_bias=bias, qk_norm=True)


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}


def architecture_of(cfg: dict[str, Any]) -> str:
    """The HF architecture name of a config dict (`architectures[0]`, else from `model_type`)."""
    archs = cfg.get("architectures") or []
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

    Raises:
        ValueError: unsupported architecture or rope type (named), a missing required key, or a
            configured feature the decoder does not implement (named with its value).
    """
    arch = architecture_of(cfg)
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    return ModelArchConfig(**family(cfg))
