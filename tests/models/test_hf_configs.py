"""arch_config_from_hf: both RoPE config forms, derived head_dim, family quirks, refusals."""

from __future__ import annotations

import dataclasses

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


# --- Gemma, Gemma 2, Gemma 3 ---------------------------------------------------------------
GEMMA_SIZES = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
)
GEMMA3_OLD = dict(  # transformers < 5 spelling, as on the Hub
    model_type="gemma3_text",
    rope_theta=1000000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    rope_local_base_freq=10000.0,
    sliding_window=512,
    sliding_window_pattern=2,
)
GEMMA3_NEW = dict(  # what transformers 5's Gemma3TextConfig.to_dict() writes for the same
    model_type="gemma3_text",
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=512,
)


def _gemma(arch: str, **kw) -> dict:
    return {"architectures": [arch], **GEMMA_SIZES, **kw}


def test_gemma1_legacy_gelu_and_family_defaults() -> None:
    arch = arch_config_from_hf(_gemma("GemmaForCausalLM", hidden_act="gelu", head_dim=None))
    assert arch.hidden_act == "gelu_pytorch_tanh"  # transformers reads Gemma's "gelu" so
    assert arch.tie_word_embeddings and arch.norm_unit_offset and arch.scale_embeddings
    assert arch.head_dim == 2304 // 8 and not arch.sandwich_norms and arch.sliding_window is None
    cfg = _gemma("GemmaForCausalLM", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")
    assert arch_config_from_hf(cfg).hidden_act == "gelu_pytorch_tanh"


def test_gemma2_spellings_and_layer_rule() -> None:
    old = arch_config_from_hf(
        _gemma("Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh", rope_theta=10000.0)
    )
    new = arch_config_from_hf(
        _gemma(
            "Gemma2ForCausalLM",
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window_size=4096,
            cache_implementation="hybrid",
        )
    )
    assert old == new
    # transformers' Gemma2Config defaults: even layers slide, window 4096, caps 50 and 30.
    assert [old.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (old.attn_logit_softcap, old.final_logit_softcap) == (50.0, 30.0)
    assert old.sm_scale == 256**-0.5 and old.sandwich_norms and old.local_rope_theta is None


def test_gemma3_rope_spellings_agree() -> None:
    old = arch_config_from_hf(_gemma("Gemma3ForCausalLM", **GEMMA3_OLD))
    new = arch_config_from_hf({**GEMMA_SIZES, **GEMMA3_NEW})  # model_type only
    both = arch_config_from_hf(_gemma("Gemma3ForCausalLM", **(GEMMA3_OLD | GEMMA3_NEW)))
    assert old == new == both
    assert old.architecture == "Gemma3ForCausalLM" and old.qk_norm
    assert (old.rope_theta, old.local_rope_theta) == (1000000.0, 10000.0)
    assert old.rope_scaling == {"type": "linear", "factor": 8.0}
    assert [old.uses_local_rope(i) for i in range(4)] == [True, False, True, False]
    assert old.attn_logit_softcap is None and old.final_logit_softcap is None
    # Without a pattern: transformers' default of 6, so four layers all slide.
    default = arch_config_from_hf(_gemma("Gemma3ForCausalLM", sliding_window=512))
    assert all(default.is_sliding(i) for i in range(4))


@pytest.mark.parametrize(
    "arch, extra, named",
    [
        ("Gemma3ForCausalLM", dict(GEMMA3_NEW, rope_theta=500000.0), "different RoPE thetas"),
        ("Gemma3ForCausalLM", dict(GEMMA3_NEW, rope_local_base_freq=1.0), "different RoPE thetas"),
        ("Gemma3ForCausalLM", dict(GEMMA3_NEW, rope_scaling={"rope_type": "default"}), "scalings"),
        (
            "Gemma3ForCausalLM",
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            "sliding layers a RoPE scaling",
        ),
        ("Gemma3ForCausalLM", dict(rope_parameters={"rope_theta": 1e6}), "by layer type"),
        ("Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (
            "Gemma3ForCausalLM",
            dict(GEMMA3_OLD, layer_types=["full_attention"] * 4),
            "sliding_window_pattern",
        ),
        ("Gemma2ForCausalLM", dict(layer_types=["chunked_attention"] * 4), "layer_types"),
        ("Gemma2ForCausalLM", dict(layer_types=["full_attention"] * 3), "layer_types"),
        ("Gemma2ForCausalLM", dict(use_bidirectional_attention=True), "bidirectional"),
        ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        ("Gemma2ForCausalLM", dict(hidden_act="silu"), "different activations"),
        ("Gemma2ForCausalLM", dict(sliding_window_size=1024), "sliding_window_size"),
        ("Gemma2ForCausalLM", dict(sliding_window=None), "sliding_window is null"),
        ("Gemma2ForCausalLM", dict(cache_implementation="quantized"), "cache_implementation"),
        ("GemmaForCausalLM", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        ("Gemma3ForConditionalGeneration", {}, "text_config must be a dict"),
        (
            "Gemma3ForConditionalGeneration",
            dict(text_config={"tie_word_embeddings": True}, tie_word_embeddings=False),
            "tie_word_embeddings",
        ),
        (
            "Gemma3ForConditionalGeneration",
            dict(text_config={"model_type": "gemma2"}),
            "model_type='gemma2'",
        ),
        ("LlamaForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ],
)
def test_gemma_refusals_name_the_key(arch: str, extra: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        arch_config_from_hf(_gemma(arch, **extra))


def test_gemma3_multimodal_reads_its_text_tower() -> None:
    # google/gemma-3-12b-it's config.json (vision_config left out): text_config lists only
    # what differs from Gemma3TextConfig's defaults.
    text = dict(
        hidden_size=3840,
        intermediate_size=15360,
        model_type="gemma3_text",
        num_attention_heads=16,
        num_hidden_layers=48,
        num_key_value_heads=8,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024,
    )
    cfg = dict(
        model_type="gemma3", eos_token_id=[1, 106], text_config=text, mm_tokens_per_image=256
    )
    arch = arch_config_from_hf(cfg)
    text_only = arch_config_from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            **text,
            "vocab_size": 262208,
            "eos_token_id": [1, 106],
        }
    )
    assert arch == dataclasses.replace(text_only, architecture="Gemma3ForConditionalGeneration")
    assert (arch.vocab_size, arch.head_dim, arch.query_pre_attn_scalar) == (262208, 256, 256.0)
    assert arch.eos_token_ids == (1, 106) and arch.tie_word_embeddings
    assert sum(arch.is_sliding(i) for i in range(48)) == 40  # every 6th layer is global


def test_arch_config_checks_the_gemma_fields() -> None:
    kw = dict(
        architecture="Gemma2ForCausalLM",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
    )
    ModelArchConfig(**kw)
    for bad, named in [
        (dict(layer_types=("sliding_attention",)), "layer_types must name all 2 layers"),
        (dict(layer_types=("local", "global")), "layer_types must be a tuple"),
        (dict(sliding_window=None), "sliding layers but no sliding_window"),
        (dict(layer_types=("full_attention",) * 2, local_rope_theta=10.0), "local_rope_theta"),
        (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
        (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
    ]:
        with pytest.raises(ValueError, match=named):
            ModelArchConfig(**{**kw, **bad})
