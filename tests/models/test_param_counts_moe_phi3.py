"""Full-size Mixtral-8x7B, Qwen3-30B-A3B and Phi-3-mini parameter counts: ours from shapes alone
(jax.eval_shape inside CausalLM.num_params, nothing allocated) against transformers' own model
built on the meta device from the same config.json values (also nothing allocated)."""

from __future__ import annotations

import pytest

from jaxserve.models import arch_config_from_hf, get_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# mistralai/Mixtral-8x7B-v0.1's config.json, as published.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

# Qwen/Qwen3-30B-A3B's config.json, as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# microsoft/Phi-3-mini-4k-instruct's config.json, as published (auto_map dropped: it names
# the repository's own modeling code, which transformers' built-in Phi3 replaces).
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2",
    "use_cache": True,
    "vocab_size": 32064,
}

CONFIGS = {"mixtral_8x7b": MIXTRAL_8X7B, "qwen3_30b_a3b": QWEN3_30B_A3B, "phi3_mini": PHI3_MINI_4K}


def _hf_count(cfg: dict) -> int:
    config = transformers.AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_count_matches_transformers(name: str) -> None:
    cfg = CONFIGS[name]
    ours = get_model(arch_config_from_hf(cfg)).num_params()
    assert ours == _hf_count(cfg)
