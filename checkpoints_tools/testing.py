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
}

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
        family: "llama", "mistral", "qwen2" or "qwen3".
        overrides: config fields over TINY_DEFAULTS (e.g. rope_scaling=..., head_dim=...,
            tie_word_embeddings=True, sliding_window=4).

    Returns:
        The folder.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    folder = pathlib.Path(dirname)
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, FAMILIES[family])(**(TINY_DEFAULTS | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model, config.initializer_range)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    if with_tokenizer:
        _write_tokenizer(folder, config.vocab_size)
    return folder
