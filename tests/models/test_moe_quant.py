"""8-bit MoE experts (models/moe.py, models/quant.py): the params and their TP layout, the
grouped matmul of both implementations on 8-bit stacks, and the step's temporaries (no
full-precision copy of every expert). Loading, logits and bytes: test_quantized_checkpoints.py."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxserve.models import AttentionMetadata, ModelArchConfig, get_model
from jaxserve.models.moe import GROUPED_IMPLS, grouped_swiglu
from jaxserve.models.quant import INPUT_AXES, QUANTIZATIONS, STORAGE_DTYPES, dequantize, quantize

D, F, E = 16, 8, 4
STACKS = ("experts_gate", "experts_up", "experts_down")


def _arch(num_layers: int = 2, d: int = 32, f: int = 16, e: int = E) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=64,
        hidden_size=d,
        intermediate_size=48,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        initializer_range=0.2,
        num_experts=e,
        num_experts_per_tok=2,
        moe_intermediate_size=f,
        moe_layers=tuple(range(num_layers - 1)),  # the last layer dense (mlp_only_layers)
    )


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_expert_params_shapes_and_tp_specs(quantization):
    arch = _arch()  # D 32, F 16, E 4; layer 0 MoE, layer 1 dense
    model = get_model(arch, dtype=jnp.bfloat16, quantization=quantization)
    shapes = model.param_shapes()
    moe = shapes["layers_0"]["moe"]
    storage = STORAGE_DTYPES[quantization]
    assert {n: (moe[n].shape, moe[n].dtype) for n in STACKS} == {
        "experts_gate": ((E, 32, 16), storage),
        "experts_up": ((E, 32, 16), storage),
        "experts_down": ((E, 16, 32), storage),
    }
    assert moe["experts_gate_scale"].shape == moe["experts_up_scale"].shape == (E, 16)
    assert moe["experts_down_scale"].shape == (E, 32)
    assert {moe[n + "_scale"].dtype for n in STACKS} == {jnp.dtype(jnp.float32)}
    assert moe["router"].dtype == jnp.bfloat16  # the router stays in the model dtype
    assert shapes["layers_0"]["attn"]["q_proj"].dtype == storage  # dense layers as usual
    assert shapes["layers_1"]["mlp"]["gate_proj"].dtype == storage
    specs = model.param_partition_specs(2)["layers_0"]["moe"]
    assert specs["experts_gate"] == PartitionSpec(None, None, "tp")
    assert specs["experts_gate_scale"] == specs["experts_up_scale"] == PartitionSpec(None, "tp")
    assert specs["experts_down"] == PartitionSpec(None, "tp", None)
    assert specs["experts_down_scale"] == PartitionSpec(None, None)  # [E, D] replicated
    assert specs["router"] == PartitionSpec(None, None)
    # tp = 32 does not divide F = 16: the experts and their scales are replicated together.
    wide = model.param_partition_specs(32)["layers_0"]["moe"]
    assert wide["experts_gate"] == PartitionSpec(None, None, None)
    assert wide["experts_gate_scale"] == PartitionSpec(None, None)


@pytest.mark.slow
def test_init_params_quantizes_each_expert():
    """Bit for bit, so under XLA:CPU's default emitters: with the classic ones at optimization
    level 0, as the suite compiles (tests/conftest.py), the two programs differ in the last bit
    of some scales (jaxlib 0.10.2), so the check runs in a fresh process without that flag."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith(_CLASSIC_EMITTERS))
    code = f"import {__name__} as t; t.check_init_params_quantizes_each_expert()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=pathlib.Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters"


def check_init_params_quantizes_each_expert():
    arch = _arch()
    rng = jax.random.key(5)
    full = get_model(arch).init_params(rng)["layers_0"]["moe"]
    ours = get_model(arch, quantization="int8").init_params(rng)["layers_0"]["moe"]
    for name in STACKS:
        want, scale = quantize(full[name], INPUT_AXES[name], "int8")
        np.testing.assert_array_equal(ours[name], want)
        np.testing.assert_array_equal(ours[name + "_scale"], scale)
        for e in range(E):  # per expert: the scale of expert e is its own slice's
            _, own = quantize(full[name][e], (0,), "int8")
            np.testing.assert_allclose(ours[name + "_scale"][e], own, rtol=1e-6)
    np.testing.assert_array_equal(ours["router"], full["router"])


def _stacks(quantization: str):
    keys = jax.random.split(jax.random.key(0), 3)
    floats = [
        jax.random.normal(keys[0], (E, D, F)),
        jax.random.normal(keys[1], (E, D, F)),
        jax.random.normal(keys[2], (E, F, D)),
    ]
    quantized = [quantize(w, (1,), quantization) for w in floats]
    return [q for q, _ in quantized], tuple(s for _, s in quantized)


# 37 tokens x top-2 = 74 rows: groups of several tiles (TILE_ROWS = 16), partial last tiles.
MANY = np.random.default_rng(0).integers(0, E, (37, 2))


@pytest.mark.slow  # compiles both implementations: a few seconds each
@pytest.mark.parametrize(
    "quantization, dtype", [("int8", jnp.float32), ("fp8", jnp.bfloat16)], ids=["int8", "fp8"]
)
def test_both_impls_agree_on_8bit_experts(quantization, dtype):
    """ "tiles" and "ragged_dot" (both interpreted on the CPU) on 8-bit stacks equal the float
    grouped matmul of the dequantized stacks (f32: to rounding; bf16: one rounding per
    projection), and each other."""
    stacks, scales = _stacks(quantization)
    experts = jnp.asarray(MANY, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (37, D)).astype(dtype)
    run = jax.jit(grouped_swiglu, static_argnames="impl")
    outs = {impl: run(x, experts, *stacks, impl=impl, scales=scales) for impl in GROUPED_IMPLS}
    deq = [dequantize(q, s, (1,)).astype(dtype) for q, s in zip(stacks, scales, strict=True)]
    ref = np.asarray(run(x.astype(jnp.float32), experts, *[w.astype(jnp.float32) for w in deq]))
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for impl, out in outs.items():
        assert out.dtype == dtype and out.shape == (37, 2, D)
        err = float(np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max())
        assert err < tol, f"{impl}: relative error {err:.3g} against the dequantized experts"
    a, b = (np.asarray(outs[impl], np.float32) for impl in GROUPED_IMPLS)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(ref).max())


def test_8bit_experts_need_their_scales():
    stacks, scales = _stacks("int8")
    x, experts = jnp.zeros((2, D)), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="expert stack 'gate' is int8: 8-bit experts need"):
        grouped_swiglu(x, experts, *stacks)
    with pytest.raises(ValueError, match=r"scale of expert stack 'down' has shape \(4, 8\)"):
        grouped_swiglu(x, experts, *stacks, scales=(scales[0], scales[1], scales[0]))


def _step_inputs(model, arch, dtype, tokens):
    kv = [(jax.ShapeDtypeStruct(model.kv_cache_shape(8, 16), dtype),) * 2] * arch.num_layers
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    md = AttentionMetadata(
        positions=i32(tokens),
        slot_mapping=i32(tokens),
        block_tables=i32(1, 4),
        kv_lens=i32(1),
        cu_q_lens=i32(2),
        num_seqs=i32(1),
    )
    return kv, i32(tokens), md


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_step_never_holds_every_expert_converted(dtype):
    """A quantized MoE step (the CPU's "tiles") holds one tile's expert converted at a time,
    never every layer's experts: its temporaries are the float model's plus at most one
    projection's stack (XLA:CPU keeps the convert inside the tile's matmul)."""
    arch = _arch(num_layers=4, d=64, f=256, e=8)  # 3 MoE layers of 8 experts, D 64, F 256

    def temp(quantization: str | None) -> int:
        model = get_model(arch, dtype=dtype, quantization=quantization)
        inputs = _step_inputs(model, arch, dtype, 16)
        step = jax.jit(model.forward).lower(model.param_shapes(), *inputs).compile()
        return step.memory_analysis().temp_size_in_bytes

    shapes = get_model(arch, dtype=dtype).param_shapes()
    experts = sum(shapes[f"layers_{i}"]["moe"][n].size for i in arch.moe_layers for n in STACKS)
    converted = experts * 4  # every expert as f32, XLA:CPU's dot operand
    one_stack = 8 * 64 * 256 * 4
    ours, plain = temp("int8"), temp(None)
    assert ours < converted / 4, f"step temporaries {ours} bytes, the experts converted {converted}"
    assert ours <= plain + one_stack, f"int8 step {ours} bytes of temporaries, float {plain}"


@pytest.mark.slow
def test_ragged_dot_temporaries_do_not_grow_with_the_layers():
    """The "ragged_dot" implementation (interpreted on the CPU: jax's generic lowering) over
    1 and 4 layers' 8-bit stacks: the temporaries are those of one layer (about two stacks'
    worth in f32: one projection's stack converted plus the lowering's own), never every
    layer's stacks converted (measured without the tie to the rows: 4 x one layer's)."""
    e, d, f, tokens = 8, 64, 128, 8
    one_stack = e * d * f * 4  # one projection's stack as f32

    def temp(layers: int) -> int:
        keys = jax.random.split(jax.random.key(0), 3 * layers)
        shapes = ((e, d, f), (e, d, f), (e, f, d)) * layers
        stacks = [
            quantize(jax.random.normal(k, s), (1,), "int8")
            for k, s in zip(keys, shapes, strict=True)
        ]

        def run(x, experts, stacks):
            for i in range(layers):
                (g, gs), (u, us), (w, ws) = stacks[3 * i : 3 * i + 3]
                y = grouped_swiglu(x, experts, g, u, w, impl="ragged_dot", scales=(gs, us, ws))
                x = y.sum(axis=1)
            return x

        x = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
        experts = jax.ShapeDtypeStruct((tokens, 2), jnp.int32)
        compiled = jax.jit(run).lower(x, experts, stacks).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, four = temp(1), temp(4)
    assert four < one + one_stack / 2, f"temporaries: 1 layer {one} bytes, 4 layers {four}"
    assert four < 3 * one_stack, f"temporaries {four} bytes; one stack converted {one_stack}"
