"""The config.json readers every family shares: checked ints, floats and flags, RoPE in both
spellings, token ids, the sizes, and the fields common to all families. Each error names the
key and its value."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.models.arch_config import (
    normalize_rope_scaling,
)

# A config.json value that is present but None is treated as absent only for these keys, where
# transformers itself documents None as "derive it" (head_dim = hidden // heads; no GQA).
_NULL_MEANS_DERIVED = ("head_dim", "num_key_value_heads")


def int_key(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
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


def positive_float(where: str, value: object) -> float:
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


def bool_key(cfg: dict[str, Any], key: str) -> bool:
    """config.json's boolean `key`; absent or null means False (transformers' default for every
    flag read here). A string such as "false" would be truthy: refused, not guessed."""
    value = cfg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"config.json {key} must be true or false, got {value!r}")
    return value


def read_rope_theta(cfg: dict[str, Any], params: dict[str, Any], scaling: dict[str, Any]) -> float:
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
    thetas = {where: positive_float(where, value) for where, value in given.items()}
    if len(set(thetas.values())) > 1:
        raise ValueError(f"config.json gives different RoPE thetas: {thetas}")
    return next(iter(thetas.values()), 10000.0)


def read_rope_dict(cfg: dict[str, Any], key: str) -> dict[str, Any]:
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


def read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, canonical rope_scaling) from either config form, or both when they agree.

    Raises:
        ValueError: rope_parameters and rope_scaling both given and describing different
            scalings, or different thetas given; an unsupported or malformed scaling.
    """
    params, scaling = read_rope_dict(cfg, "rope_parameters"), read_rope_dict(cfg, "rope_scaling")
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
    return read_rope_theta(cfg, params, scaling), from_params if params else from_scaling


def read_eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(f"config.json eos_token_id must be an int or a list of ints, got {value!r}")


def read_token_id(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"config.json {key} must be an int >= 0 or null, got {value!r}")
    return value


def reject_key(cfg: dict[str, Any], key: str, ok: object, what: str) -> None:
    value = cfg.get(key, ok)
    if value not in (ok, None):
        raise ValueError(f"config.json {key}={value!r} is unsupported ({what})")


def read_sizes(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's sizes, each read and checked (int >= 1) before any arithmetic uses it."""
    num_heads = int_key(cfg, "num_attention_heads")
    hidden = int_key(cfg, "hidden_size")
    # Floor division, as transformers: the projections are sized by head_dim, not hidden.
    derived_head_dim = hidden // num_heads
    if derived_head_dim < 1 and cfg.get("head_dim") is None:
        raise ValueError(
            f"config.json hidden_size={hidden} is smaller than num_attention_heads={num_heads} "
            "and no head_dim is given"
        )
    return dict(
        vocab_size=int_key(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=int_key(cfg, "intermediate_size"),
        num_layers=int_key(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=int_key(cfg, "num_key_value_heads", num_heads),
        head_dim=int_key(cfg, "head_dim", derived_head_dim),
        max_position_embeddings=int_key(cfg, "max_position_embeddings", 2048),
    )


def common_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    theta, scaling = read_rope(cfg)
    hidden_act = cfg.get("hidden_act", "silu")
    if not isinstance(hidden_act, str):
        raise TypeError(f"config.json hidden_act must be a string, got {hidden_act!r}")
    out = dict(
        architecture=architecture,
        **read_sizes(cfg),
        rms_norm_eps=positive_float("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool_key(cfg, "tie_word_embeddings"),
        hidden_act=hidden_act,
        bos_token_id=read_token_id(cfg, "bos_token_id"),
        eos_token_ids=read_eos_ids(cfg.get("eos_token_id")),
        initializer_range=positive_float("initializer_range", cfg.get("initializer_range", 0.02)),
    )
    reject_key(cfg, "mlp_bias", False, "bias on MLP projections")
    reject_key(cfg, "attn_logit_softcapping", None, "attention logit soft-capping")
    return out
