"""Rotary position embeddings (half-split convention of HF Llama checkpoints), with the llama3
and linear frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> np.ndarray:  # f32[H // 2]
    """Inverse frequencies theta^(-2i/H) for i < H/2, after the configured scaling.

    Computed in float64 on the host (a compile-time constant), returned as float32.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        pass
    elif scaling["type"] == "linear":
        inv_freq = inv_freq / scaling["factor"]  # position / factor, folded into the frequency
    elif scaling["type"] == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    else:
        raise ValueError(f"unsupported rope scaling type {scaling['type']!r}")
    return inv_freq.astype(np.float32)


def rope_tables(inv_freq: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Host tables f32[length, H // 2] of cos and sin at positions 0 .. length - 1, rounded as
    rope_cos_sin rounds them (angle = f32 position x f32 frequency, then cos / sin in f32).

    The runner looks a step's rows up here and passes them in AttentionMetadata: computed in
    the step instead, XLA:CPU fuses the cos / sin into every layer's rotation and evaluates
    them once per element of q and k (heads x layers over), 2-4% of a step's time."""
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array,  # i32[T]
    inv_freq: np.ndarray,  # f32[H // 2]
) -> tuple[jax.Array, jax.Array]:  # f32[T, H // 2] each
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
