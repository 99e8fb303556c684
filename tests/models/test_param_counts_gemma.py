"""Full-size Gemma 2 and Gemma 3 parameter counts: ours from shapes alone (jax.eval_shape inside
CausalLM.num_params, nothing allocated) against transformers' own model built on the meta
device from the same config.json values (also nothing allocated)."""

from __future__ import annotations

import pytest

from jaxserve.models import arch_config_from_hf, get_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# google/gemma-2-9b's config.json, as published.
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "vocab_size": 256000,
}
# google/gemma-3-12b-it's text tower: its config.json's text_config, with the Gemma3TextConfig
# defaults it relies on written out, as a text-only Gemma3ForCausalLM config.
GEMMA3_12B_TEXT = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "max_position_embeddings": 131072,
    "num_attention_heads": 16,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "vocab_size": 262208,
}

# google/gemma-3-12b-it's config.json as published (its vision_config left at transformers'
# defaults: only the text tower is counted). text_config lists only what differs from
# Gemma3TextConfig's defaults, which both sides fill in.
GEMMA3_12B_MULTIMODAL = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}
CONFIGS = {
    "gemma2_9b": GEMMA2_9B,
    "gemma3_12b_text": GEMMA3_12B_TEXT,
    "gemma3_12b_multimodal": GEMMA3_12B_MULTIMODAL,
}


def _transformers_count(cfg: dict) -> int:
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == cfg["architectures"][0]
    if cfg["model_type"] == "gemma3":  # the text tower (its lm_head is tied to the embedding)
        model = model.model.language_model
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_size_param_count_matches_transformers(name: str) -> None:
    model = get_model(arch_config_from_hf(CONFIGS[name]))
    assert model.num_params() == _transformers_count(CONFIGS[name])
