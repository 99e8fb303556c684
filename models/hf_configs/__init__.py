"""Hugging Face config.json -> ModelArchConfig, for every supported architecture.

Each family is a small function reading the keys that distinguish it (families.py, gemma.py);
everything else is shared (readers.py).
Both RoPE spellings found in the wild are accepted:

    transformers < 5:  "rope_theta": 500000.0, "rope_scaling": {"rope_type"|"type": ..., ...}
    transformers >= 5: "rope_parameters": {"rope_type": ..., "rope_theta": 500000.0, ...}

Both may be present when they describe the same scaling; when they differ, the config is
refused rather than one silently preferred. A feature the shared
decoder does not implement raises ValueError naming it, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxserve.models.arch_config import ModelArchConfig
from jaxserve.models.hf_configs.families import (
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from jaxserve.models.hf_configs.gemma import gemma, gemma2, gemma3, gemma3_multimodal

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


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": mistral,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "MixtralForCausalLM": mixtral,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "Phi3ForCausalLM": phi3,
    "GemmaForCausalLM": gemma,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "Gemma3ForConditionalGeneration": gemma3_multimodal,  # its text tower
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
