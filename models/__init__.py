"""Flax model families over the paged KV cache: one shared decoder, configured per family.

Public entry points (used by the runner and checkpoints_tools):
    ModelArchConfig, arch_config_from_hf, ARCHITECTURES, get_model, CausalLM, AttentionMetadata.
"""

from jaxserve.models.arch_config import ModelArchConfig, normalize_rope_scaling
from jaxserve.models.attention_metadata import AttentionMetadata
from jaxserve.models.causal_lm import TP_AXIS, CausalLM, get_model
from jaxserve.models.hf_configs import ARCHITECTURES, arch_config_from_hf, architecture_of

__all__ = [
    "ARCHITECTURES",
    "TP_AXIS",
    "AttentionMetadata",
    "CausalLM",
    "ModelArchConfig",
    "arch_config_from_hf",
    "architecture_of",
    "get_model",
    "normalize_rope_scaling",
]
