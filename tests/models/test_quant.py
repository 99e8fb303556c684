"""models/quant.py: the 8-bit weight format, its matmul, and the quantized params pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxserve import config
from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch
from jaxserve.models import AttentionMetadata, get_model
from jaxserve.models.quant import (
    INPUT_AXES,
    QMAX,
    QUANTIZATIONS,
    dequantize,
    matmul,
    quantize,
    quantize_host,
)

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("name, shape", [("q_proj", (64, 4, 8)), ("o_proj", (4, 8, 64))])
def test_round_trip_error_is_within_half_a_step(quantization, name, shape):
    w = RNG.normal(0, 0.1, shape).astype(np.float32)
    w[..., 0] = 0.0 if name == "q_proj" else w[..., 0]  # an all-zero output channel
    axes = INPUT_AXES[name]
    q, scale = quantize_host(w, axes, quantization)
    assert scale.shape == tuple(n for i, n in enumerate(shape) if i not in axes)
    q_dev, scale_dev = quantize(jnp.asarray(w), axes, quantization)  # the same rule on device
    np.testing.assert_array_equal(np.asarray(q_dev).view(np.uint8), q.view(np.uint8))
    np.testing.assert_allclose(np.asarray(scale_dev), scale, rtol=1e-6)
    back = dequantize(q, scale, axes)
    step = np.expand_dims(scale, axes)
    if quantization == "int8":
        bound = step / 2  # round to nearest
    else:  # e4m3: 3 mantissa bits, half an ulp relative; subnormals below 2^-6 step 2^-9
        bound = np.maximum(np.abs(w) * 2.0**-4, step * 2.0**-10)
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    assert np.abs(np.asarray(q, np.float32)).max() <= QMAX[quantization]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_matches_the_dequantized_weight(quantization, dtype):
    x = jnp.asarray(RNG.normal(0, 1, (5, 64)), dtype)
    w = RNG.normal(0, 0.1, (64, 4, 8)).astype(np.float32)
    q, scale = quantize(jnp.asarray(w), (0,), quantization)
    y = matmul("TD,DNH->TNH", x, q, scale)
    assert y.dtype == dtype and y.shape == (5, 4, 8)
    ref = jnp.einsum("TD,DNH->TNH", x.astype(jnp.float32), dequantize(q, scale, (0,)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: the result is rounded once
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), rtol=tol, atol=tol)
    # An unquantized weight is a plain einsum.
    plain = matmul("TD,DNH->TNH", x, jnp.asarray(w, dtype), None)
    np.testing.assert_array_equal(plain, jnp.einsum("TD,DNH->TNH", x, jnp.asarray(w, dtype)))


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_params_shapes_and_tp_specs(quantization):
    arch = tiny_random_llama_arch()  # D 128, N 4, K 2, H 32, F 256
    model = get_model(arch, dtype=jnp.bfloat16, quantization=quantization)
    storage = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[quantization]
    layer = model.param_shapes()["layers_0"]
    assert layer["attn"]["q_proj"].dtype == storage and layer["mlp"]["down_proj"].dtype == storage
    assert layer["attn"]["q_proj_scale"].shape == (4, 32)
    assert layer["attn"]["o_proj_scale"].shape == (128,)
    assert layer["mlp"]["gate_proj_scale"].shape == (256,)
    assert layer["attn"]["q_proj_scale"].dtype == jnp.float32
    assert model.param_shapes()["embed"].dtype == jnp.bfloat16
    specs = model.param_partition_specs(2)["layers_0"]
    tp = PartitionSpec("tp")
    assert specs["attn"]["k_proj"] == PartitionSpec(None, "tp", None)
    assert specs["attn"]["k_proj_scale"] == PartitionSpec("tp", None)  # with its heads
    assert specs["mlp"]["up_proj_scale"] == tp  # with its F columns
    assert specs["attn"]["o_proj_scale"] == specs["mlp"]["down_proj_scale"] == PartitionSpec(None)
    # tp = 4 does not divide K = 2: the KV projections and their scales are replicated together.
    specs4 = model.param_partition_specs(4)["layers_0"]["attn"]
    assert specs4["k_proj"] == PartitionSpec(None, None, None)
    assert specs4["k_proj_scale"] == PartitionSpec(None, None)
    assert specs4["q_proj_scale"] == PartitionSpec("tp", None)


def test_init_params_quantizes_the_float_init():
    arch = tiny_random_llama_arch()
    rng = jax.random.key(3)
    full = get_model(arch).init_params(rng)
    ours = get_model(arch, quantization="int8").init_params(rng)
    want, scale = quantize(full["layers_1"]["mlp"]["down_proj"], (0,), "int8")
    np.testing.assert_array_equal(ours["layers_1"]["mlp"]["down_proj"], want)
    np.testing.assert_array_equal(ours["layers_1"]["mlp"]["down_proj_scale"], scale)
    np.testing.assert_array_equal(ours["embed"], full["embed"])
    shapes = jax.eval_shape(get_model(arch, quantization="fp8").init_params, rng)
    assert shapes["layers_0"]["attn"]["v_proj"].dtype == ml_dtypes.float8_e4m3fn


def test_bad_quantization_values_are_refused():
    arch = tiny_random_llama_arch()
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        get_model(arch, quantization="int4")
    with pytest.raises(ValueError, match="ModelConfig.quantization must be one of"):
        config.EngineConfig.from_kwargs(quantization="fp4")
    assert config.QUANTIZATIONS == (None, *QUANTIZATIONS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_step_never_holds_the_model_converted(dtype):
    """Only the weights of the matmuls in flight are held converted, never every layer's."""
    arch = tiny_random_llama_arch()  # 4 layers
    model = get_model(arch, dtype=dtype, quantization="int8")
    kv = [(jax.ShapeDtypeStruct(model.kv_cache_shape(8, 16), dtype),) * 2] * arch.num_layers
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    md = AttentionMetadata(
        positions=i32(4),
        slot_mapping=i32(4),
        block_tables=i32(1, 4),
        kv_lens=i32(1),
        cu_q_lens=i32(2),
        num_seqs=i32(1),
    )
    step = jax.jit(model.forward).lower(model.param_shapes(), kv, i32(4), md).compile()
    linear = sum(
        leaf.size
        for path, leaf in jax.tree_util.tree_flatten_with_path(model.param_shapes())[0]
        if path[-1].key in INPUT_AXES
    )
    converted = linear * 4  # every linear weight as f32, XLA:CPU's dot operand
    temp = step.memory_analysis().temp_size_in_bytes
    assert temp < converted / 4, f"step temporaries {temp} bytes, the model converted {converted}"
