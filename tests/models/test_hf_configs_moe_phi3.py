"""config.json -> ModelArchConfig for Mixtral, Qwen3-MoE and Phi-3: key spellings, the MoE layer
rule, LongRoPE against transformers' own computation, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.models import ModelArchConfig, arch_config_from_hf, get_model
from jaxserve.models.rope import model_inv_freq

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MIXTRAL = BASE | dict(architectures=["MixtralForCausalLM"], num_experts_per_tok=2)
QWEN3_MOE = BASE | dict(
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
SHORT = [1.0, 1.5, 2.0, 3.0]  # H / 2 = 4 factors
LONG = [1.0, 2.0, 4.0, 8.0]
PHI3 = BASE | dict(
    architectures=["Phi3ForCausalLM"],
    original_max_position_embeddings=16,
    rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
)


@pytest.mark.parametrize("key", ["num_local_experts", "num_experts"])
def test_mixtral_expert_count_spellings(key: str) -> None:
    arch = arch_config_from_hf(MIXTRAL | {key: 8, "router_jitter_noise": 0.1})
    assert (arch.num_experts, arch.num_experts_per_tok) == (8, 2)
    assert arch.moe_intermediate_size == 48 and arch.norm_topk_prob
    assert arch.moe_layers == (0, 1, 2, 3)


def test_qwen3_moe_layer_rule_and_spellings() -> None:
    arch = arch_config_from_hf(QWEN3_MOE | dict(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert arch.moe_layers == (1,)  # (i + 1) % 2 == 0 gives 1 and 3; 3 is dense
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert arch.qk_norm and not arch.norm_topk_prob
    # transformers 5 writes num_local_experts for Qwen3-MoE too; both given must agree.
    both = QWEN3_MOE | dict(num_local_experts=8, norm_topk_prob=True)
    assert arch_config_from_hf(both).norm_topk_prob


@pytest.mark.parametrize(
    ("cfg", "error", "named"),
    [
        (QWEN3_MOE | dict(num_local_experts=4), ValueError, "different expert counts"),
        (MIXTRAL, ValueError, "num_local_experts"),
        (MIXTRAL | dict(num_local_experts=2, num_experts_per_tok=3), ValueError, "<= num_expe"),
        (MIXTRAL | dict(num_local_experts=2, router_jitter_noise="0"), TypeError, "router_jit"),
        (MIXTRAL | dict(num_local_experts=2, router_jitter_noise=-1.0), ValueError, ">= 0"),
        (QWEN3_MOE | dict(mlp_only_layers=[4]), ValueError, "mlp_only_layers"),
        (QWEN3_MOE | dict(norm_topk_prob="true"), TypeError, "norm_topk_prob"),
        (QWEN3_MOE | dict(use_sliding_window=True), ValueError, "use_sliding_window"),
        (PHI3 | dict(partial_rotary_factor=0.75), ValueError, "partial_rotary_factor"),
        (
            PHI3 | dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
            ValueError,
            "partial_rotary_factor",
        ),
        (
            PHI3
            | dict(rope_scaling=PHI3["rope_scaling"] | dict(original_max_position_embeddings=8)),
            ValueError,
            "differs from the top-level",
        ),
        (
            PHI3 | dict(rope_scaling=PHI3["rope_scaling"] | dict(short_factor=[1.0])),
            ValueError,
            "head_dim / 2 = 4",
        ),
        (PHI3 | dict(attention_bias=True), ValueError, "attention_bias"),
    ],
)
def test_refusals_name_the_key(cfg: dict, error: type, named: str) -> None:
    with pytest.raises(error, match=named):
        arch_config_from_hf(cfg)


def test_moe_fields_validated() -> None:
    arch = arch_config_from_hf(QWEN3_MOE)
    with pytest.raises(ValueError, match="moe_layers"):
        dataclasses.replace(arch, moe_layers=(1, 0))
    with pytest.raises(ValueError, match="num_experts is 0"):
        dataclasses.replace(arch, num_experts=0)


def test_phi3_rope_spellings_agree() -> None:
    su = arch_config_from_hf(PHI3 | dict(rope_scaling=PHI3["rope_scaling"] | dict(type="su")))
    new = dict(PHI3, rope_scaling=None)
    new["rope_parameters"] = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        short_factor=SHORT,
        long_factor=LONG,
        original_max_position_embeddings=16,
    )
    assert su == arch_config_from_hf(PHI3) == arch_config_from_hf(new)
    plain = arch_config_from_hf(
        BASE | dict(architectures=["Phi3ForCausalLM"], rope_parameters={"rope_type": "default"})
    )
    assert plain.rope_scaling is None and plain.rope_attention_factor == 1.0


@pytest.mark.parametrize("max_positions", [16, 256])  # = original: short; beyond: long
@pytest.mark.parametrize("factor", [None, 4.0])
def test_longrope_matches_transformers(max_positions: int, factor: float | None) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(PHI3["rope_scaling"], **({} if factor is None else {"factor": factor}))
    cfg = PHI3 | dict(max_position_embeddings=max_positions, rope_scaling=scaling)
    hf_config = transformers.Phi3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    original = cfg["original_max_position_embeddings"]
    # transformers' choice for a sequence of max_positions tokens (its forward's rule).
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS["longrope"](
        hf_config, None, seq_len=max_positions if max_positions > original else None
    )
    arch = arch_config_from_hf(cfg)
    np.testing.assert_allclose(model_inv_freq(arch), hf_inv_freq.numpy(), rtol=1e-6)
    assert arch.rope_attention_factor == pytest.approx(hf_attention, rel=1e-12)
    assert arch.sm_scale == pytest.approx(8**-0.5 * hf_attention**2)
    if max_positions > original or factor is not None:
        assert arch.rope_attention_factor > 1.0


def test_max_model_len_picks_the_longrope_factors() -> None:
    """The engine's max_model_len, not the model's context, picks the factor set: short up to
    the original context (16 here), long beyond; the attention factor stays the model's."""
    arch = arch_config_from_hf(PHI3)  # max_position_embeddings 256: long by default
    inv = lambda length: 10000.0 ** -(np.arange(0, 8, 2) / 8) / np.asarray(length)
    np.testing.assert_allclose(model_inv_freq(arch), inv(LONG), rtol=1e-6)
    np.testing.assert_allclose(model_inv_freq(arch, 17), inv(LONG), rtol=1e-6)
    np.testing.assert_allclose(model_inv_freq(arch, 16), inv(SHORT), rtol=1e-6)
    cos, _ = get_model(arch, max_model_len=16).rope_tables(16)
    np.testing.assert_allclose(cos[5], np.cos(5 * inv(SHORT)), rtol=1e-5)
    assert get_model(arch, max_model_len=16).arch.sm_scale == arch.sm_scale


def test_longrope_factor_count_checked_by_arch() -> None:
    arch = arch_config_from_hf(PHI3)
    with pytest.raises(ValueError, match="head_dim / 2"):
        ModelArchConfig(**(dataclasses.asdict(arch) | dict(head_dim=16)))
