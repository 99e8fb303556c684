"""The mixture-of-experts block (models/moe.py): routing, the ragged_dot grouped matmul against a
plain per-(token, expert) jnp reference, and the same greedy tokens at tp 1, 2 and 4."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.models import ModelArchConfig
from jaxserve.models.moe import GROUPED_IMPLS, MoE, grouped_swiglu, route, tile_rows
from jaxserve.runner.xla_flags import CPU_YNN_FUSION_FLAG

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
D, F, E = 16, 8, 4


def _reference(x, experts, weights, gate, up, down):  # [T, D]: sum_j w[t, j] * expert_e(x[t])
    g = jnp.einsum("TD,TkDF->TkF", x, gate[experts])  # each row's own expert, gathered
    u = jnp.einsum("TD,TkDF->TkF", x, up[experts])
    y = jnp.einsum("TkF,TkFD->TkD", jax.nn.silu(g) * u, down[experts])
    return jnp.einsum("TkD,Tk->TD", y, weights)


def _weights(seed: int):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (E, D, F)),
        jax.random.normal(keys[1], (E, D, F)),
        jax.random.normal(keys[2], (E, F, D)),
    )


# 37 tokens x top-2 = 74 rows: groups of several tiles (TILE_ROWS = 16), partial last tiles.
MANY = np.random.default_rng(0).integers(0, E, (37, 2)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("impl", GROUPED_IMPLS)  # the MoE block tests the default (None)
@pytest.mark.parametrize(
    "experts",
    [
        [[3, 3], [3, 3], [3, 3]],  # all rows to the last expert, the others empty
        [[0], [0], [2]],  # k = 1, experts 1 and 3 empty
        [[0, 1], [0, 2], [0, 3], [1, 0]],  # decode tiles of 2 rows: expert 0 spans two
        MANY,  # every expert, in both slots
    ],
    ids=["one", "k1", "small", "many"],
)
def test_grouped_swiglu_matches_reference(experts, impl):
    experts = jnp.asarray(experts, jnp.int32)
    num_tokens, k = experts.shape
    x = jax.random.normal(jax.random.key(1), (num_tokens, D))
    weights = jax.random.uniform(jax.random.key(2), (num_tokens, k))
    gate, up, down = _weights(0)
    out = jax.jit(grouped_swiglu, static_argnames="impl")(x, experts, gate, up, down, impl=impl)
    ours = jnp.einsum("TkD,Tk->TD", out, weights)
    ref = _reference(x, experts, weights, gate, up, down)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4)


def test_tile_rows_small_decodes_get_matrix_vector_tiles():
    assert [tile_rows(m, 8) for m in (1, 2, 8, 9, 16)] == [1, 1, 1, 2, 2]  # M / E <= 2
    assert [tile_rows(m, 8) for m in (17, 64, 256, 257)] == [16, 16, 32, 48]


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_swiglu(jnp.zeros((1, D)), jnp.zeros((1, 1), jnp.int32), *_weights(0), impl="x")


def test_route_top_k_and_renormalisation():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[1, 2], [0, 3]]
    np.testing.assert_allclose(weights, jnp.take_along_axis(probs, experts, axis=1), rtol=1e-6)
    renormed, same = route(logits, 2, renormalize=True)
    assert same.tolist() == experts.tolist()
    np.testing.assert_allclose(renormed.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(renormed, weights / weights.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_matches_reference(norm_topk_prob):
    arch = ModelArchConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=32,
        hidden_size=D,
        intermediate_size=24,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        initializer_range=0.5,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=F,
        norm_topk_prob=norm_topk_prob,
        moe_layers=(0,),
    )
    module = MoE(arch, jnp.float32)
    x = jax.random.normal(jax.random.key(3), (12, D))
    params = module.init(jax.random.key(4), x)["params"]
    assert {k: v.shape for k, v in params.items()} == {
        "router": (D, E),
        "experts_gate": (E, D, F),
        "experts_up": (E, D, F),
        "experts_down": (E, F, D),
    }
    weights, experts = route(x @ params["router"], 2, norm_topk_prob)
    assert len(set(experts.reshape(-1).tolist())) > 1  # the tokens do not all agree
    ref = _reference(
        x, experts, weights, params["experts_gate"], params["experts_up"], params["experts_down"]
    )
    np.testing.assert_allclose(module.apply({"params": params}, x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_moe_tokens_match_one_device(tmp_path):
    """tp 1, 2, 4 on simulated CPU devices: the experts' F axis sharded, the router replicated,
    the same greedy tokens; int8 experts' logits at tp 2 as at tp 1, scales sharded with F."""
    pytest.importorskip("torch")  # the checkpoint is written with transformers
    folder = write_tiny_hf_checkpoint(tmp_path / "mixtral", "mixtral", with_tokenizer=False)
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} {CPU_YNN_FUSION_FLAG} --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "moe_tp_cases.py"), str(folder), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    assert runs["1"]["tokens"] == runs["2"]["tokens"] == runs["4"]["tokens"]
    assert all(len(t) == 6 for t in runs["1"]["tokens"])
    for tp in (1, 2, 4):
        layout = runs[str(tp)]["layout"]
        assert layout["experts_gate"]["shard_shape"] == [E, 64, 32 // tp]  # tiny: D 64, F 32
        assert layout["experts_down"]["shard_shape"] == [E, 32 // tp, 64]
        assert layout["router"]["shard_shape"] == [64, E]
    assert runs["2"]["layout"]["experts_gate"]["spec"] == [None, None, "tp"]
    # 8-bit experts (int8 on load): one prefill's logits at tp 2 as at tp 1 (f32, up to the
    # all-reduce's summation order); the gate scales [E, F] sharded on F, [E, D] replicated.
    quantized = runs["int8"]
    assert quantized["max_abs_diff"] < 1e-4 * quantized["max_abs"], quantized
    assert quantized["same_argmax"]
    layout = quantized["layout"]
    assert layout["experts_gate"]["shard_shape"] == [E, 64, 32 // 2]
    assert layout["experts_gate_scale"]["spec"] == [None, "tp"]
    assert layout["experts_gate_scale"]["shard_shape"] == [E, 32 // 2]
    assert layout["experts_down_scale"]["shard_shape"] == [E, 64]
