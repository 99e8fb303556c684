"""CausalLM at full size (jax.eval_shape: shapes only, nothing allocated) and at tiny size."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.models import AttentionMetadata, ModelArchConfig, arch_config_from_hf, get_model

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 40960,
}
# Published parameter counts (safetensors totals of the HF checkpoints).
FULL_SIZE = {"llama3_8b": (LLAMA3_8B, 8_030_261_248), "qwen3_8b": (QWEN3_8B, 8_190_735_360)}


def _abstract_md(t: int, r: int, b: int) -> AttentionMetadata:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return AttentionMetadata(
        positions=i32(t),
        slot_mapping=i32(t),
        block_tables=i32(r, b),
        kv_lens=i32(r),
        cu_q_lens=i32(r + 1),
        num_seqs=i32(1),
    )


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_shapes_without_allocating(name: str) -> None:
    cfg, expected_count = FULL_SIZE[name]
    arch = arch_config_from_hf(cfg)
    model = get_model(arch, dtype=jnp.bfloat16)
    shapes = model.param_shapes()
    d, h, n, k = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    attn = shapes["layers_0"]["attn"]
    assert attn["q_proj"].shape == (d, n, h) and attn["k_proj"].shape == (d, k, h)
    assert attn["o_proj"].shape == (n, h, d)
    assert shapes["layers_0"]["mlp"]["down_proj"].shape == (arch.intermediate_size, d)
    assert shapes["embed"].shape == shapes["lm_head"].shape == (arch.vocab_size, d)
    assert ("q_norm" in attn) == (name == "qwen3_8b")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(shapes))
    assert model.num_params() == expected_count

    num_tokens, num_seqs, width, num_blocks, block_size = 256, 8, 64, 512, 16
    cache = jax.ShapeDtypeStruct(model.kv_cache_shape(num_blocks, block_size), jnp.bfloat16)
    kv = [(cache, cache)] * arch.num_layers
    ids = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    kv_out, hidden = jax.eval_shape(
        model.forward, shapes, kv, ids, _abstract_md(num_tokens, num_seqs, width)
    )
    assert hidden.shape == (num_tokens, d) and hidden.dtype == jnp.bfloat16
    assert len(kv_out) == arch.num_layers
    assert kv_out[0][0].shape == (k, num_blocks, block_size, h)
    logits = jax.eval_shape(model.compute_logits, shapes, hidden)
    assert logits.shape == (num_tokens, arch.vocab_size) and logits.dtype == jnp.float32
    per_block = 2 * arch.num_layers * k * block_size * h * 2
    assert model.kv_cache_bytes_per_block(block_size, jnp.bfloat16) == per_block


def test_partition_specs_follow_megatron_layout() -> None:
    model = get_model(arch_config_from_hf(QWEN3_8B | {"attention_bias": True}))
    specs, shapes = model.param_partition_specs(), model.param_shapes()
    flat_specs = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(flat_specs) == len(jax.tree_util.tree_leaves(shapes))
    for path, spec in flat_specs:
        leaf = shapes
        for key in path:
            leaf = leaf[key.key]
        assert len(spec) == leaf.ndim, path
    attn, mlp = specs["layers_3"]["attn"], specs["layers_3"]["mlp"]
    assert attn["q_proj"] == attn["k_proj"] == attn["v_proj"] == P(None, "tp", None)
    assert attn["q_bias"] == P("tp", None) and attn["o_bias"] == P(None)
    assert attn["o_proj"] == P("tp", None, None)
    assert mlp["gate_proj"] == mlp["up_proj"] == P(None, "tp")
    assert mlp["down_proj"] == P("tp", None)
    assert attn["q_norm"] == P(None) and specs["final_norm"]["scale"] == P(None)
    assert specs["embed"] == specs["lm_head"] == P("tp", None)


TINY = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    initializer_range=0.1,
)


def _tiny_step(model, params):
    """A 5-token prefill of one sequence in pages [3, 1]."""
    shape = model.kv_cache_shape(4, 4)
    kv = [(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))] * 2
    md = AttentionMetadata(
        positions=jnp.array([0, 1, 2, 3, 4, 0, 0, 0], jnp.int32),
        slot_mapping=jnp.array([12, 13, 14, 15, 4, 0, 0, 0], jnp.int32),
        block_tables=jnp.array([[3, 1], [0, 0]], jnp.int32),
        kv_lens=jnp.array([5, 0], jnp.int32),
        cu_q_lens=jnp.array([0, 5, 5], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    ids = jnp.array([1, 20, 30, 40, 50, 0, 0, 0], jnp.int32)
    kv, hidden = jax.jit(model.forward)(params, kv, ids, md)
    return kv, model.compute_logits(params, hidden[:5])


def test_bfloat16_params_close_to_float32() -> None:
    f32 = get_model(TINY, dtype=jnp.float32)
    params = f32.init_params(jax.random.key(1))
    bf16 = get_model(TINY, dtype=jnp.bfloat16)
    params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    assert jax.tree_util.tree_structure(params16) == jax.tree_util.tree_structure(
        bf16.param_shapes()
    )
    kv, logits = _tiny_step(f32, params)
    kv16, logits16 = _tiny_step(bf16, params16)
    assert logits16.dtype == jnp.float32 and kv16[0][0].dtype == jnp.bfloat16
    # bfloat16 keeps ~3 significant digits; logits here are O(1).
    np.testing.assert_allclose(logits16, logits, atol=0.1)
    # The new keys landed in the scheduled slots (page 3 offsets 0-3, page 1 offset 0) only.
    written = np.abs(np.asarray(kv[0][0])).sum(axis=(0, 3))  # [S, P]
    assert (written[3] > 0).all() and written[1, 0] > 0
    assert written[1, 1:].sum() == 0 and written[2].sum() == 0


def test_init_is_seeded_and_rejects_bad_dtype() -> None:
    model = get_model(TINY)
    a, b = model.init_params(jax.random.key(0)), model.init_params(jax.random.key(0))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, a, b))
    c = model.init_params(jax.random.key(1))
    assert not np.array_equal(a["embed"], c["embed"])
    assert not np.array_equal(a["layers_0"]["attn"]["q_proj"], a["layers_1"]["attn"]["q_proj"])
    assert np.all(a["layers_1"]["input_norm"]["scale"] == 1.0)
    assert float(jnp.std(a["embed"])) == pytest.approx(0.1, rel=0.1)
    assert "lm_head" not in a  # tied
    with pytest.raises(ValueError, match="dtype"):
        get_model(TINY, dtype=jnp.int32)


_TP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxserve.models import AttentionMetadata, ModelArchConfig, get_model
assert jax.device_count() == 2
arch = ModelArchConfig(
    architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True,
    attention_out_bias=True, qk_norm=True, initializer_range=0.1,
)
model = get_model(arch)
params = model.init_params(jax.random.key(0))
mesh = Mesh(np.array(jax.devices()), ("tp",))
specs = model.param_partition_specs()
sharded = jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                 params, specs)
assert sharded["layers_0"]["attn"]["q_proj"].addressable_shards[0].data.shape == (64, 2, 32)
kv_sharding = NamedSharding(mesh, P("tp", None, None, None))  # pages sharded by KV head
kv = [(jnp.zeros(model.kv_cache_shape(4, 4)),) * 2] * 2
md = AttentionMetadata(
    positions=jnp.array([0, 1, 2, 3, 4, 0, 0, 0], jnp.int32),
    slot_mapping=jnp.array([12, 13, 14, 15, 4, 0, 0, 0], jnp.int32),
    block_tables=jnp.array([[3, 1], [0, 0]], jnp.int32),
    kv_lens=jnp.array([5, 0], jnp.int32),
    cu_q_lens=jnp.array([0, 5, 5], jnp.int32),
    num_seqs=jnp.array([1], jnp.int32),
)
ids = jnp.array([1, 20, 30, 40, 50, 0, 0, 0], jnp.int32)
step = jax.jit(lambda p, kv: model.compute_logits(p, model.forward(p, kv, ids, md)[1][:5]))
ref = step(params, kv)
out = step(sharded, jax.device_put(kv, kv_sharding))
np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)
print("TP_OK")
"""


@pytest.mark.slow
def test_partition_specs_run_sharded_on_two_cpu_devices() -> None:
    """The specs are valid shardings and GSPMD over them reproduces the unsharded logits."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "TP_OK" in result.stdout, result.stderr[-3000:]


def test_host_rope_tables_match_the_in_step_angles() -> None:
    """The runner's host cos / sin tables (llama3 scaling, positions up to 8k) equal what the
    step computes from positions, and a forward given them equals one without."""
    from jaxserve.models.rope import rope_cos_sin, rope_inv_freq, rope_tables

    scaling = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=1024)  # fmt: skip
    inv_freq = rope_inv_freq(64, 500000.0, scaling)
    cos, sin = rope_tables(inv_freq, 8192)
    positions = jnp.asarray([0, 1, 5, 1023, 4097, 8191], jnp.int32)
    want_cos, want_sin = jax.jit(lambda p: rope_cos_sin(p, inv_freq))(positions)
    np.testing.assert_allclose(cos[np.asarray(positions)], want_cos, atol=2e-6)
    np.testing.assert_allclose(sin[np.asarray(positions)], want_sin, atol=2e-6)

    model = get_model(TINY)
    params = model.init_params(jax.random.key(0))
    shape = model.kv_cache_shape(4, 4)
    kv = [(jnp.zeros(shape), jnp.zeros(shape))] * 2
    pos = jnp.array([0, 1, 2, 3, 4, 0, 0, 0], jnp.int32)
    md = AttentionMetadata(
        positions=pos,
        slot_mapping=jnp.array([12, 13, 14, 15, 4, 0, 0, 0], jnp.int32),
        block_tables=jnp.array([[3, 1], [0, 0]], jnp.int32),
        kv_lens=jnp.array([5, 0], jnp.int32),
        cu_q_lens=jnp.array([0, 5, 5], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    cos_t, sin_t = model.rope_tables(16)
    md_host = dataclasses.replace(
        md, rope_cos=cos_t[np.asarray(pos)], rope_sin=sin_t[np.asarray(pos)]
    )
    ids = jnp.array([1, 20, 30, 40, 50, 0, 0, 0], jnp.int32)
    _, hidden = jax.jit(model.forward)(params, kv, ids, md)
    _, hidden_host = jax.jit(model.forward)(params, kv, ids, md_host)
    np.testing.assert_allclose(hidden_host, hidden, atol=1e-5)
