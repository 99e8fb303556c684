"""Real, tiny Hugging Face checkpoints written by transformers itself, for tests and benchmarks.

torch and transformers are test/bench extras: they are imported inside the function, so
importing this module costs nothing and the engine never needs them.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxserve.checkpoints_tools.tiny_random import (
    BOS_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    build_tiny_tokenizer,
)

FAMILIES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "phi3": "Phi3Config",
}

# Family-specific tiny settings, under the caller's overrides. The Gemmas' class defaults are
# full-size (head_dim 256, window 4096): head_dim stays D / N; a window of 4 matters within a
# dozen tokens; query_pre_attn_scalar differs from head_dim; the soft caps are small enough to
# bend the tiny model's scores and logits; Gemma 3 alternates local and global layers, the
# global ones with a linear RoPE scaling.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(head_dim=16),
    "gemma2": dict(
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    ),
    "gemma3": dict(
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        sliding_window_pattern=2,
        rope_theta=10000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    # MoE: 4 experts, top-2, narrow experts. Qwen3-MoE: layer 1 dense (mlp_only_layers), so
    # both MLP kinds are exercised; norm_topk_prob is transformers' default (False).
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]
    ),
    # LongRoPE with an original context of 8 tokens, so sequences of a dozen tokens are past it
    # (long factors; max_position_embeddings 256 > 8 gives an attention factor > 1 too).
    "phi3": dict(
        original_max_position_embeddings=8,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 20.0],
        ),
    ),
}

# Multimodal checkpoints whose text tower jaxserve runs: family -> (transformers config class,
# the text family whose tiny settings its text_config takes). Kept out of FAMILIES, which the
# text-model tests run through.
MULTIMODAL_FAMILIES = {"gemma3_multimodal": ("Gemma3Config", "gemma3")}
_TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28
)

# Tiny and fast, yet every axis distinct enough to catch a transposed or mis-split weight.
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)


def _write_tokenizer(folder: pathlib.Path, vocab_size: int) -> None:
    build_tiny_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    pad, bos, eos = SPECIAL_TOKENS
    tok_cfg = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "chat_template": TINY_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def _randomize_norms_and_biases(model: Any, std: float) -> None:
    # HF initialises norm scales to 1 and biases to 0, which would hide a misplaced or
    # transposed one; perturb them so every tensor matters to the parity tests.
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * std)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * std)


def write_tiny_hf_checkpoint(
    dirname: str | pathlib.Path,
    family: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> pathlib.Path:
    """Write a random-weight HF checkpoint folder with transformers' own save_pretrained.

    Writes config.json, model.safetensors (or shards + index when max_shard_size is set),
    generation_config.json and, with_tokenizer, tokenizer.json + tokenizer_config.json (the
    tiny byte-level BPE, trained to the config's vocab_size, which must then be >= 259).
    Weights are normal(0, initializer_range) as transformers draws them (seeded), and norm
    scales and biases are perturbed too, so no tensor is left at a neutral 1 or 0.

    Args:
        family: a key of FAMILIES ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
            "gemma3", "mixtral", "qwen3_moe", "phi3") or of MULTIMODAL_FAMILIES (a tiny
            vision tower around the text family's model).
        overrides: config fields over TINY_DEFAULTS and FAMILY_DEFAULTS (e.g.
            rope_scaling=..., head_dim=..., tie_word_embeddings=True, sliding_window=4); for a
            multimodal family, fields of its text_config.

    Returns:
        The folder.
    """
    import torch
    import transformers

    if family not in FAMILIES and family not in MULTIMODAL_FAMILIES:
        known = sorted(FAMILIES) + sorted(MULTIMODAL_FAMILIES)
        raise ValueError(f"family must be one of {known}, got {family!r}")
    folder = pathlib.Path(dirname)
    folder.mkdir(parents=True, exist_ok=True)
    if family in MULTIMODAL_FAMILIES:
        config_class, text_family = MULTIMODAL_FAMILIES[family]
        text = TINY_DEFAULTS | FAMILY_DEFAULTS.get(text_family, {}) | overrides
        config = getattr(transformers, config_class)(text_config=text, vision_config=_TINY_VISION)
    else:
        fields = TINY_DEFAULTS | FAMILY_DEFAULTS.get(family, {}) | overrides
        config = getattr(transformers, FAMILIES[family])(**fields)
    text_config = config.get_text_config()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model, text_config.initializer_range)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    if with_tokenizer:
        _write_tokenizer(folder, text_config.vocab_size)
    return folder
