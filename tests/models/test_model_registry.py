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


@pytest.mark.parametrize(
    "key, value, error, named",
    [
        ("num_attention_heads", 0, ValueError, "num_attention_heads must be >= 1, got 0"),
        ("num_attention_heads", -4, ValueError, "num_attention_heads must be >= 1, got -4"),
        ("num_attention_heads", None, TypeError, "num_attention_heads must be an int, got None"),
        ("num_attention_heads", "32", TypeError, "num_attention_heads must be an int, got '32'"),
        ("num_attention_heads", 32.0, TypeError, "num_attention_heads must be an int, got 32.0"),
        ("hidden_size", 0, ValueError, "hidden_size must be >= 1, got 0"),
        ("hidden_size", True, TypeError, "hidden_size must be an int, got True"),
        ("vocab_size", None, TypeError, "vocab_size must be an int, got None"),
        ("num_hidden_layers", -1, ValueError, "num_hidden_layers must be >= 1, got -1"),
        ("intermediate_size", [1], TypeError, r"intermediate_size must be an int, got \[1\]"),
        ("num_key_value_heads", 0, ValueError, "num_key_value_heads must be >= 1, got 0"),
        ("head_dim", 0, ValueError, "head_dim must be >= 1, got 0"),
        ("head_dim", "128", TypeError, "head_dim must be an int, got '128'"),
        ("max_position_embeddings", None, TypeError, "max_position_embeddings must be an int"),
        ("rms_norm_eps", None, TypeError, "rms_norm_eps must be a number, got None"),
        ("rms_norm_eps", "1e-5", TypeError, "rms_norm_eps must be a number, got '1e-5'"),
        ("rms_norm_eps", 0.0, ValueError, "rms_norm_eps must be a finite number > 0, got 0.0"),
        ("rope_theta", float("nan"), ValueError, "rope_theta must be a finite number > 0, got nan"),
        ("initializer_range", None, TypeError, "initializer_range must be a number, got None"),
        ("tie_word_embeddings", "false", TypeError, "tie_word_embeddings must be true or false"),
        ("attention_bias", 1, TypeError, "attention_bias must be true or false, got 1"),
        ("hidden_act", None, TypeError, "hidden_act must be a string, got None"),
        ("bos_token_id", -1, ValueError, "bos_token_id must be an int >= 0 or null, got -1"),
        ("eos_token_id", True, ValueError, "eos_token_id must be an int or a list of ints"),
        ("architectures", "LlamaForCausalLM", TypeError, "architectures must be a list of names"),
    ],
)
def test_bad_values_name_the_key_and_value(key: str, value, error: type, named: str) -> None:
    """A zero head count used to raise ZeroDivisionError, a null float() TypeError, a string
    "false" to be taken as True: each value is checked before it is used, and named."""
    with pytest.raises(error, match=named):
        arch_config_from_hf(_cfg(**{key: value}))


def test_missing_head_count_and_derived_sizes() -> None:
    cfg = _cfg()
    del cfg["num_attention_heads"]
    with pytest.raises(ValueError, match="lacks required key 'num_attention_heads'"):
        arch_config_from_hf(cfg)
    # null means "derive" for these two, as in transformers.
    arch = arch_config_from_hf(_cfg(head_dim=None, num_key_value_heads=None))
    assert arch.head_dim == 128 and arch.num_kv_heads == 32
    with pytest.raises(ValueError, match="hidden_size=16 is smaller than num_attention_heads=32"):
        arch_config_from_hf(_cfg(hidden_size=16))
    assert arch_config_from_hf(_cfg(hidden_size=16, head_dim=2)).head_dim == 2


def test_qwen_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match="layer_types='full_attention'"):
        arch_config_from_hf(_cfg("Qwen3ForCausalLM", layer_types="full_attention"))
    with pytest.raises(TypeError, match="sliding_window must be an int, got '4096'"):
        arch_config_from_hf(_cfg("MistralForCausalLM", sliding_window="4096"))


def test_rope_scaling_and_rope_parameters_must_agree() -> None:
    """Both present used to mean rope_scaling silently ignored (transformers 5 itself would take
    rope_scaling's factors): now they must describe the same scaling."""
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"rope_parameters=.*factor': 2\.0.*rope_scaling=.*4\.0"):
        arch_config_from_hf(
            _cfg(rope_parameters=params, rope_scaling={"type": "linear", "factor": 4})
        )
    llama3 = {"rope_type": "llama3", **LLAMA3_SCALING}
    with pytest.raises(ValueError, match="describe different RoPE scalings"):
        arch_config_from_hf(_cfg(rope_parameters=params, rope_scaling=llama3))
    with pytest.raises(ValueError, match="describe different RoPE scalings"):
        arch_config_from_hf(_cfg(rope_parameters={"rope_type": "default"}, rope_scaling=llama3))
    # The same scaling in both spellings, or a null rope_scaling: accepted.
    same = arch_config_from_hf(
        _cfg(rope_parameters=params, rope_scaling={"type": "linear", "factor": 2})
    )
    assert same.rope_scaling == {"type": "linear", "factor": 2.0}
    assert arch_config_from_hf(_cfg(rope_parameters=params, rope_scaling=None)) == same


def test_rope_theta_given_twice_must_agree() -> None:
    params = {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(ValueError, match="different RoPE thetas.*500000.0.*1000000.0"):
        arch_config_from_hf(_cfg(rope_theta=500000.0, rope_parameters=params))
    assert arch_config_from_hf(_cfg(rope_theta=1e6, rope_parameters=params)).rope_theta == 1e6
    with pytest.raises(TypeError, match=r"rope_parameters\['rope_theta'\] must be a number"):
        arch_config_from_hf(_cfg(rope_parameters={"rope_type": "default", "rope_theta": "1e6"}))


def test_original_max_position_embeddings_must_be_whole() -> None:
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING, "original_max_position_embeddings": 8.5}
    with pytest.raises(ValueError, match="original_max_position_embeddings.*whole.*8.5"):
        arch_config_from_hf(_cfg(rope_scaling=scaling))
