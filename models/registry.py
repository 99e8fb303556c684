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

from jaxserve.models.arch_config import ModelArchConfig, normalize_rope_scaling

# model_type -> architecture, for configs written without an `architectures` list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
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
