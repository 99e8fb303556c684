"""arch_config_from_hf: both RoPE config forms, derived head_dim, family quirks, refusals."""

from __future__ import annotations

import pytest

from jaxserve.models import ModelArchConfig, arch_config_from_hf, normalize_rope_scaling

BASE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)
LLAMA3_SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _cfg(arch: str = "LlamaForCausalLM", **kw) -> dict:
    return {"architectures": [arch], **BASE, **kw}


def test_llama31_old_and_new_rope_forms_agree() -> None:
    # transformers < 5 (Llama-3.1 config.json as published) ...
    old = arch_config_from_hf(
        _cfg(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    )
    # ... and transformers 5's config.to_dict(): theta moves inside rope_parameters.
    new = arch_config_from_hf(
        _cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    )
    assert old == new
    assert old.rope_theta == 500000.0
    assert old.rope_scaling == {"type": "llama3", **LLAMA3_SCALING}
    assert old.head_dim == 128  # derived: 4096 / 32
    assert old.eos_token_ids == (128001, 128008, 128009)
    assert hash(old) == hash(new)


def test_linear_scaling_spellings() -> None:
    a = arch_config_from_hf(_cfg(rope_scaling={"type": "linear", "factor": 2.0}))
    b = arch_config_from_hf(
        _cfg(rope_parameters={"rope_type": "linear", "factor": 2, "rope_theta": 10000.0})
    )
    assert a.rope_scaling == b.rope_scaling == {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_is_named(form: str, rope_type: str) -> None:
    with pytest.raises(ValueError, match=rope_type):
        arch_config_from_hf(_cfg(**{form: {"rope_type": rope_type, "factor": 4.0}}))


def test_default_rope_type_means_no_scaling() -> None:
    arch = arch_config_from_hf(_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert arch.rope_scaling is None and arch.rope_theta == 1e6


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        arch_config_from_hf(_cfg("GPT2LMHeadModel"))


def test_model_type_fallback_and_missing_key() -> None:
    cfg = {**BASE, "model_type": "mistral", "sliding_window": 4096}
    assert arch_config_from_hf(cfg).architecture == "MistralForCausalLM"
    cfg = _cfg()
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        arch_config_from_hf(cfg)


def test_family_quirks() -> None:
    qwen2 = arch_config_from_hf(_cfg("Qwen2ForCausalLM", use_sliding_window=False))
    assert qwen2.attention_bias and not qwen2.attention_out_bias and not qwen2.qk_norm
    qwen3 = arch_config_from_hf(_cfg("Qwen3ForCausalLM", head_dim=64))
    assert qwen3.qk_norm and qwen3.head_dim == 64 and not qwen3.attention_bias
    mistral = arch_config_from_hf(_cfg("MistralForCausalLM", sliding_window=4096, head_dim=None))
    assert mistral.sliding_window == 4096 and mistral.head_dim == 128
    llama_bias = arch_config_from_hf(_cfg(attention_bias=True))
    assert llama_bias.attention_bias and llama_bias.attention_out_bias


@pytest.mark.parametrize(
    "arch, extra, named",
    [
        ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias"),
        ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act"),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True), "use_sliding_window"),
        ("Qwen3ForCausalLM", dict(layer_types=["sliding_attention"] * 32), "layer_types"),
    ],
)
def test_unimplemented_features_raise(arch: str, extra: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        arch_config_from_hf(_cfg(arch, **extra))


def test_arch_config_validation_names_fields() -> None:
    kw = dict(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
    )
    ModelArchConfig(**kw)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelArchConfig(**{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelArchConfig(**{**kw, "vocab_size": 0})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelArchConfig(**{**kw, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelArchConfig(**{**kw, "sliding_window": 0})


def test_normalize_rope_scaling_requires_keys() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        normalize_rope_scaling({"rope_type": "llama3", "factor": 8.0})
    assert normalize_rope_scaling(None) is None
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        normalize_rope_scaling({"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="mscale"):
        normalize_rope_scaling({"rope_type": "linear", "factor": 2.0, "mscale": 1.0})
