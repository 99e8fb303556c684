"""8-bit linear weights: int8 (weight-only) and FP8 e4m3, each with float32 per-output-channel
scales, and the one matmul every quantized linear goes through.

A linear weight of the params pytree is either a plain array in the model dtype, or, under a
quantization (QUANTIZATIONS), two leaves side by side:

    {name}        int8 or float8_e4m3fn, the weight's own layout (e.g. q_proj [D, N, H])
    {name}_scale  f32, the weight's output axes (q_proj_scale [N, H], o_proj_scale [D])

with w ~= {name} * {name}_scale broadcast over the input axes (INPUT_AXES). Symmetric, no zero
point. A per-tensor scale (an FP8 checkpoint's "tensor" strategy) is stored broadcast over the
output channels: one layout for both strategies, so the param shapes never depend on the
checkpoint, at 4 bytes per output channel (1/D of the weight). The scales shard with their
output axis under tensor parallelism (causal_lm._TP_SPECS).

The matmul (`matmul`) converts the 8-bit weight to the activations' dtype inside the dot and
applies the scale to the float32 result, x @ (q * s) == (x @ q) * s along the output axis:
int8 and e4m3 values are exact in bfloat16, float16 and float32, so the only rounding is the
dot's own. Nothing full-precision of the model is kept: the converted operand is the compiler's
temporary of one matmul (XLA:CPU materialises that one weight converted, freed after its dot;
_converted_after keeps XLA from converting every layer's weights up front). This is weight-only
quantization: activations stay in the model dtype, so an FP8 checkpoint made for FP8 x FP8
GEMMs (dynamic activation scales) runs at least as accurately as its W8A8 form. XLA:GPU's
native FP8 GEMM (cuBLASLt on Hopper) is matched for dots whose two operands are both FP8,
dequantized by scalar scales; an FP8 weight against bf16 activations is not that pattern, so
it runs as a converted operand like int8 (what the GPU compiler makes of it is not measured).

MoE experts (models/moe.py) are quantized the same way, per expert and per output channel:
the stacks experts_gate / experts_up [E, D, F] and experts_down [E, F, D] are 8-bit with
experts_gate_scale / experts_up_scale [E, F] and experts_down_scale [E, D] (the input axis is
axis 1). They do not go through `matmul`: the grouped matmul of moe.py converts one tile's
expert ("tiles") or hands the 8-bit stack to ragged_dot ("ragged_dot"), and scales the f32
result row by row with each row's expert's scales (see moe.py).

The LM head, the embedding, norms, biases and MoE routers stay in the model dtype (vLLM's
default too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models.arch_config import ModelArchConfig

QUANTIZATIONS = ("int8", "fp8")
# The storage dtype of each quantization, and its largest magnitude (the scale maps each output
# channel's max |w| onto it). int8 is symmetric: -128 is never used.
STORAGE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}  # 448
SCALE_SUFFIX = "_scale"

# The quantized linear weights by param leaf name, with their input (contracted) axes in our
# layout: a scale covers one output channel, so it has the weight's shape without these axes.
INPUT_AXES = {
    "q_proj": (0,),  # [D, N, H] -> scale [N, H]
    "k_proj": (0,),  # [D, K, H] -> scale [K, H]
    "v_proj": (0,),  # [D, K, H] -> scale [K, H]
    "o_proj": (0, 1),  # [N, H, D] -> scale [D]
    "gate_proj": (0,),  # [D, F] -> scale [F]
    "up_proj": (0,),  # [D, F] -> scale [F]
    "down_proj": (0,),  # [F, D] -> scale [D]
    # MoE expert stacks (moe.py): one scale per expert and output channel.
    "experts_gate": (1,),  # [E, D, F] -> scale [E, F]
    "experts_up": (1,),  # [E, D, F] -> scale [E, F]
    "experts_down": (1,),  # [E, F, D] -> scale [E, D]
}
# The stacked (per-expert) weights among INPUT_AXES: axis 0 is the expert, so one expert's
# slice has the input axes of slice_input_axes (a checkpoint stores each expert apart).
STACKED = ("experts_gate", "experts_up", "experts_down")


def slice_input_axes(name: str) -> tuple[int, ...]:
    """The input axes of one expert's slice of the stacked weight `name` (one axis less)."""
    if name not in STACKED:
        raise ValueError(f"{name!r} is not a stacked expert weight (one of {STACKED})")
    return tuple(i - 1 for i in INPUT_AXES[name])


def check_quantization(quantization: object) -> str | None:
    """`quantization` itself when it is None or one of QUANTIZATIONS.

    Raises:
        ValueError: anything else (the choices named).
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    return quantization


def check_quantizable(arch: ModelArchConfig, quantization: str | None) -> None:
    """Refuse a quantization this code cannot apply to all of `arch`'s big weights.

    Every family's linear weights are covered (dense projections and MoE experts alike), so
    this only checks the value; it stays the one place CausalLM and the loader ask.

    Raises:
        ValueError: an unknown quantization (the choices named).
    """
    del arch  # every architecture's linears and experts quantize
    check_quantization(quantization)


def scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape of the weight `name` of `shape`: its output axes."""
    return tuple(n for i, n in enumerate(shape) if i not in INPUT_AXES[name])


def quantize_host(
    w: np.ndarray, input_axes: tuple[int, ...], quantization: str
) -> tuple[np.ndarray, np.ndarray]:
    """(8-bit weight, f32 scale) of a host weight, per output channel: scale = max |w| over the
    input axes / QMAX (1 for an all-zero channel), q = w / scale rounded (int8: to nearest, ties
    to even; fp8: ml_dtypes' round to nearest even) within [-QMAX, QMAX].

    Computed in float32 (one f32 copy of this one tensor while it runs).
    """
    check_quantization(quantization)
    w32 = np.asarray(w, dtype=np.float32)
    amax = np.max(np.abs(w32), axis=input_axes, keepdims=True)
    scale = np.where(amax > 0, amax / QMAX[quantization], 1.0).astype(np.float32)
    q = np.clip(w32 / scale, -QMAX[quantization], QMAX[quantization])
    if quantization == "int8":
        q = np.rint(q)
    return q.astype(STORAGE_DTYPES[quantization]), np.squeeze(scale, axis=input_axes)


def quantize(
    w: jax.Array, input_axes: tuple[int, ...], quantization: str
) -> tuple[jax.Array, jax.Array]:
    """quantize_host on device (traceable): the same rule, for init_params of demo models."""
    check_quantization(quantization)
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=input_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX[quantization], 1.0)
    q = jnp.clip(w32 / scale, -QMAX[quantization], QMAX[quantization])
    if quantization == "int8":
        q = jnp.round(q)
    return q.astype(STORAGE_DTYPES[quantization]), jnp.squeeze(scale, axis=input_axes)


def dequantize(q: Any, scale: Any, input_axes: tuple[int, ...]) -> Any:
    """q * scale in float32, the scale broadcast over the input axes (host or device arrays;
    tests and checks only: the model never dequantizes a whole weight)."""
    xp = jnp if isinstance(q, jax.Array) else np
    return q.astype(xp.float32) * xp.expand_dims(scale.astype(xp.float32), input_axes)


def matmul(equation: str, x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """jnp.einsum(equation, x, w), the weight plain (scale None) or 8-bit with its per-output-
    channel scale: (x @ w.astype(x.dtype)) accumulated in float32, times the scale broadcast over
    the result's leading axes, rounded once to x.dtype.

    The scale's axes must be the trailing axes of the result (every dense layout of INPUT_AXES
    puts them last: "TD,DNH->TNH" with scale [N, H], "TD,DF->TF" with [F], ...; the MoE expert
    stacks are multiplied by moe.py's grouped matmul instead).
    """
    if scale is None:
        return jnp.einsum(equation, x, w)
    y = jnp.einsum(equation, x, _converted_after(w, x), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def _converted_after(w: jax.Array, x: jax.Array) -> jax.Array:
    """w.astype(x.dtype), computed only once x exists.

    The convert of a weight depends on parameters only, so XLA:CPU schedules every layer's
    convert at the start of the step, and the converted weights of all layers, a full-precision
    copy of the model, are live at once (measured with compiled.memory_analysis(): temporaries
    the size of every linear weight in f32). Multiplying by 1 derived from x's first element
    ties each convert to its matmul's input, so only the weights in use are held converted.
    The 1 comes from one bit of that element's pattern (0 or 1, so always finite): a NaN or
    Inf in x cannot leak into other rows, and XLA does not fold the float product away (an
    optimization_barrier does not survive XLA:CPU's pipeline).
    """
    bit = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.uint32) & 1
    one = 1.0 + 0.0 * bit.astype(x.dtype)  # exactly 1
    return w.astype(x.dtype) * one


def linear_weight(
    module: nn.Module,
    name: str,
    shape: tuple[int, ...],
    init: Callable[..., Any],
    dtype: jnp.dtype,
    quantization: str | None,
) -> tuple[jax.Array, jax.Array | None]:
    """Declare the linear weight `name` of `module` (a name of INPUT_AXES): (w in `dtype`, None)
    unquantized, else (w in the 8-bit storage dtype, f32 scale `{name}_scale`).

    Under quantization the initializers only give shapes (CausalLM.init_params draws the
    weights in float and quantizes them with `quantize`).
    """
    if quantization is None:
        return module.param(name, init, shape, dtype), None
    w = module.param(name, nn.initializers.zeros, shape, STORAGE_DTYPES[quantization])
    scale = module.param(
        name + SCALE_SUFFIX, nn.initializers.ones, scale_shape(name, shape), jnp.float32
    )
    return w, scale
