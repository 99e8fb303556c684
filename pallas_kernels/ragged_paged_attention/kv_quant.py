"""FP8 KV pages: the storage dtypes, the saturating quantization that write_kv applies, and the
dequantization every attention implementation does after it loads a page.

    pages = saturate(x / scale).astype(fp8)      write_kv, one token's K (or V) at a time
    x    ~= pages.astype(compute) * scale        inside every attention implementation

One float32 scale per layer for K (k_scale) and one for V (v_scale), vLLM's convention (the
scales a checkpoint ships as ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` mean the
same). They are traced f32[] scalars, never static: a new value never recompiles anything.
``None`` means 1.0, which is also the engine's scale when the checkpoint ships none.

The cast saturates: float8_e4m3fn has no infinity (an out-of-range cast gives NaN) and
float8_e5m2 would give inf, so values are first clipped to the dtype's finite range, as vLLM
does. A NaN stays NaN.

Why the scale is applied where it is: the attention of a query row is
``softmax(sm_scale * q . (k_scale * k8)) . (v_scale * v8)``, which equals
``softmax((sm_scale * k_scale) * (q . k8)) . v8 * v_scale``: implementations multiply the
scores by ``k_scale`` together with ``sm_scale`` (or the f32 queries, before their dot) and
their f32 output by ``v_scale``, so no scaled copy of K or V is ever made; the pages
themselves are cast from fp8 to the compute dtype right after they are loaded (or gathered).

GPUs below compute capability 8.9 (Ampere: sm_80, sm_86) have no float8_e4m3fn conversion
instruction, and Triton refuses to emit one there (float8_e5m2 it converts with a shift). On
them the Triton kernel reads e4m3 pages as their bytes and converts them with integer ops
(``e4m3fn_from_bits``), exactly: what CUDA's own fp8 types, which vLLM's kernels use, do
in software there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    """Whether pages of `dtype` are an FP8 KV cache."""
    return jnp.dtype(dtype) in FP8_DTYPES


def quantize(x: jax.Array, scale: jax.Array | float | None, dtype) -> jax.Array:
    """x / scale in `dtype`: saturated to its finite range first when `dtype` is FP8 (see the
    module docstring); scale None means 1."""
    dtype = jnp.dtype(dtype)
    if scale is None and not is_fp8(dtype):
        return x.astype(dtype)
    y = x.astype(jnp.float32)
    if scale is not None:
        y = y / scale
    if is_fp8(dtype):
        info = jnp.finfo(dtype)
        y = jnp.clip(y, float(info.min), float(info.max))
    return y.astype(dtype)


def dequantize(pages: jax.Array, scale: jax.Array | float | None) -> jax.Array:
    """f32 values of loaded (or gathered) pages: pages.astype(f32) * scale (None: 1)."""
    x = pages.astype(jnp.float32)
    return x if scale is None else x * scale


E4M3_BIAS = 7  # float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity
_F32_BIAS = 127


def e4m3fn_from_bits(bits: jax.Array) -> jax.Array:
    """f32 values of float8_e4m3fn bytes (uint8), with integer ops only: exactly
    ``bits.view(float8_e4m3fn).astype(float32)`` (normals, subnormals, signed zeros; S.1111.111
    is NaN, with its sign), for GPUs without an e4m3 conversion (module docstring).

    A normal (exponent e > 0) is re-biased into an f32's fields; a subnormal (e = 0) is its
    mantissa m times 2^-9 (exact in f32), so no f32 subnormal is ever formed (a GPU may flush
    those); the sign bit is OR-ed in last, so -0 stays -0."""
    b = bits.astype(jnp.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal_bits = ((exponent + (_F32_BIAS - E4M3_BIAS)) << 23) | (mantissa << 20)
    normal = jax.lax.bitcast_convert_type(normal_bits, jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** (1 - E4M3_BIAS - 3))
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    magnitude = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), magnitude)
    signed = jax.lax.bitcast_convert_type(magnitude, jnp.int32) | ((b & 0x80) << 24)
    return jax.lax.bitcast_convert_type(signed, jnp.float32)


def scales_or_ones(k_scale: jax.Array | None, v_scale: jax.Array | None) -> jax.Array:
    """f32[2] (k_scale, v_scale), ones for None: the kernels that take their scales as a small
    input array (multiplying by an exact 1.0 changes no result)."""
    one = jnp.float32(1.0)
    k = one if k_scale is None else jnp.asarray(k_scale, jnp.float32)
    v = one if v_scale is None else jnp.asarray(v_scale, jnp.float32)
    return jnp.stack([k.reshape(()), v.reshape(())])
