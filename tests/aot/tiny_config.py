"""A tiny dense Llama-like config.json (no weights: `jaxserve compile` reads the config only)."""

from __future__ import annotations

import json
import pathlib

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


# A tiny Mixtral: 4 experts, 2 per token, a sliding window of 128 tokens.
TINY_MIXTRAL = {
    **TINY_LLAMA,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
}


def write_tiny_llama(folder: pathlib.Path, config: dict | None = None) -> str:
    """``folder`` with the tiny config.json (``config``, default TINY_LLAMA); its path as a
    string (the --model value)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or TINY_LLAMA))
    return str(folder)
