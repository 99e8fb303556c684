"""Rotary position embeddings (half-split convention of HF Llama checkpoints), with the llama3
and linear frequency scalings and Phi-3's LongRoPE.

A model has one RoPE, or two (Gemma 3: global layers with rope_theta and its scaling, sliding
layers with local_rope_theta unscaled). The model's frequency vector holds its variants side by
side, f32[Q * H // 2] (Q = 1 or 2, global first), so one cos / sin table, one host gather and
one in-step computation serve every variant; each layer slices out its own H // 2 columns
(rope_variant_slice).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch_config import ModelArchConfig


def _llama3_scale(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the band
    between interpolated linearly in (context / wavelength)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # smooth = 0 at wavelength context/low (fully scaled), 1 at context/high (untouched).
    smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _longrope_factors(scaling: dict[str, Any], context: int | None) -> np.ndarray:  # f64[H // 2]
    """The LongRoPE divisors one engine uses at every position: long_factor when its context
    (the longest sequence it serves: max_model_len, else the model's max_position_embeddings)
    exceeds original_max_position_embeddings, else short_factor.

    transformers picks the set per forward call, by that call's longest position: a sequence of
    at most the original length gets the short set, a longer one the long set at every
    position. A paged KV cache cannot follow that (keys written under the short set would
    have to be rotated again once the sequence grows past the original length; transformers'
    own cache keeps them as they were too), so the choice is made once per engine: the rotation
    is then a function of the position alone, as prefix caching, preemption and batching need.
    With max_model_len <= the original length every sequence matches transformers (short set);
    above it, sequences longer than the original length match it (long set), and shorter ones
    get the long set where transformers would use the short one."""
    if context is None:
        raise ValueError("LongRoPE needs the served context length to pick its factors")
    long = context > scaling["original_max_position_embeddings"]
    return np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    context: int | None = None,
) -> np.ndarray:  # f32[H // 2]
    """Inverse frequencies theta^(-2i/H) for i < H/2, after the configured scaling.

    Computed in float64 on the host (a compile-time constant), returned as float32.
    context (the served context length) is needed by LongRoPE only (see _longrope_factors);
    its attention factor is applied through ModelArchConfig.sm_scale, not here.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        pass
    elif scaling["type"] == "linear":
        inv_freq = inv_freq / scaling["factor"]  # position / factor, folded into the frequency
    elif scaling["type"] == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling["type"] == "longrope":
        inv_freq = inv_freq / _longrope_factors(scaling, context)
    else:
        raise ValueError(f"unsupported rope scaling type {scaling['type']!r}")
    return inv_freq.astype(np.float32)


def model_inv_freq(
    arch: ModelArchConfig, max_model_len: int | None = None
) -> np.ndarray:  # f32[Q * H // 2]
    """Every RoPE variant's frequencies of `arch`, side by side: the global one (rope_theta,
    rope_scaling), then, when sliding layers have their own base, the local one (unscaled).
    max_model_len (None: max_position_embeddings) picks LongRoPE's factors only."""
    a, context = arch, max_model_len or arch.max_position_embeddings
    freqs = [rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling, context)]
    if arch.local_rope_theta is not None:
        freqs.append(rope_inv_freq(arch.head_dim, arch.local_rope_theta, None))
    return np.concatenate(freqs)


def rope_variant_slice(arch: ModelArchConfig, layer: int) -> slice:
    """The columns of layer `layer`'s angles in a [T, Q * H // 2] cos / sin table."""
    half = arch.head_dim // 2
    start = half if arch.uses_local_rope(layer) else 0
    return slice(start, start + half)


def rope_tables(inv_freq: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Host tables of cos and sin at positions 0 .. length - 1, one column per frequency
    (f32[length, Q * H // 2] for model_inv_freq), rounded as rope_cos_sin rounds them
    (angle = f32 position x f32 frequency, then cos / sin in f32).

    The runner looks a step's rows up here and passes them in AttentionMetadata: computed in
    the step instead, XLA:CPU fuses the cos / sin into every layer's rotation and evaluates
    them once per element of q and k (heads x layers over; docs/benchmarks.md)."""
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array,  # i32[T]
    inv_freq: np.ndarray,  # f32[Q * H // 2]
) -> tuple[jax.Array, jax.Array]:  # f32[T, Q * H // 2] each
    """cos and sin of every (token, frequency) angle, in float32."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: jax.Array,  # [T, N, H] (or [T, K, H])
    cos: jax.Array,  # f32[T, H // 2]
    sin: jax.Array,  # f32[T, H // 2]
) -> jax.Array:  # [T, N, H], x.dtype
    """Rotate pairs (x[..., i], x[..., i + H/2]) by the token's angle i, in float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [T, N, H // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
