"""The sampler's draw: one token per row from the processed distribution, by inverting its CDF
at one uniform per row (two levels, so the cumulative sums stay short and accurate in f32), in
XLA ops or, on the CPU, one C++ kernel (pallas_kernels/sampling/cpu_draw.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.sampling import cpu_draw

DRAWS = ("xla", "cpu")


def draw_tokens(
    x: jax.Array,
    uniform: jax.Array,
    inv_t: jax.Array,
    floor_offset: jax.Array,
    threshold: jax.Array,
    draw: str,
) -> jax.Array:
    """One token per row from softmax(x * inv_t) over x >= max(max(x) + floor_offset,
    threshold), by inverting its CDF at `uniform`. draw="cpu": the C++ kernel
    (pallas_kernels/sampling/cpu_draw.py: one pass from memory instead of XLA's four);
    draw="xla": XLA ops; the same draw either way, up to f32 rounding of the exps."""
    args = (x, uniform, inv_t, floor_offset, threshold)
    if draw == "cpu":
        return cpu_draw.cpu_draw(*args)
    if draw != "xla":
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    return xla_draw(*args)


def xla_draw(x, uniform, inv_t, floor_offset, threshold) -> jax.Array:
    """draw="xla" of ``draw_tokens``, in XLA ops: the reference the C++ draw is tested
    against (tests/pallas_kernels/test_cpu_draw.py)."""
    row_max = jnp.max(x, axis=-1)
    # min-p, top-k and top-p keep every row's maximum, so row_max is still the max.
    floor = jnp.maximum(row_max + floor_offset, threshold)
    return inverse_cdf_draw(x, uniform, row_max, inv_t, floor)


_DRAW_CHUNK = 256  # vocabulary entries per chunk of the two-level inverse-CDF draw


def inverse_cdf_draw(
    x: jax.Array,
    uniform: jax.Array,
    row_max: jax.Array,
    inv_t: jax.Array | None = None,
    threshold: jax.Array | None = None,
) -> jax.Array:
    """Draw one token per row from softmax(x * inv_t) (inv_t f32[R], default 1) restricted to
    x >= threshold (f32[R], default: all) by inverting its CDF at `uniform`.

    One uniform per row instead of V Gumbel variates: generating [R, V] threefry noise costs
    several times the whole draw (docs/benchmarks.md, "Design measurements"). Two levels keep
    the cumulative sums short (and so accurate in f32): pick a chunk of _DRAW_CHUNK tokens by
    the chunk masses, then a token in it.
    The first index whose cumulative mass exceeds the target always has positive probability;
    a clamp to the last positive entry guards the rounding case where the target reaches the
    total, so a masked token (-inf) is never drawn. row_max: x's max per row (any value >= the
    max that keeps exp finite would do; the max keeps the mass accurate). f32[R, V], f32[R],
    f32[R] -> i32[R].
    """
    num_rows, vocab = x.shape
    c = _DRAW_CHUNK
    num_chunks = -(-vocab // c)
    if num_chunks * c != vocab:
        x = jnp.pad(x, ((0, 0), (0, num_chunks * c - vocab)), constant_values=-jnp.inf)
    z = x - row_max[:, None]
    if inv_t is not None:
        z = z * inv_t[:, None]
    if threshold is not None:  # masked before the exp: one fused pass writes p
        z = jnp.where(x >= threshold[:, None], z, -jnp.inf)
    p = jnp.exp(z).reshape(num_rows, num_chunks, c)
    chunk_mass = p.sum(-1)  # f32[R, C']
    cum = jnp.cumsum(chunk_mass, axis=-1)
    target = uniform * cum[:, -1]
    chunk = _first_above(cum, target, chunk_mass > 0)  # i32[R]
    before = jnp.where(chunk > 0, jnp.take_along_axis(cum, (chunk - 1)[:, None], 1)[:, 0], 0.0)
    inner = jnp.take_along_axis(p, chunk[:, None, None], axis=1)[:, 0]  # f32[R, c]
    j = _first_above(jnp.cumsum(inner, axis=-1), target - before, inner > 0)
    return (chunk * c + j).astype(jnp.int32)


def _first_above(cum: jax.Array, target: jax.Array, positive: jax.Array) -> jax.Array:
    """Index of the first cum > target per row, clamped to the last positive entry."""
    width = cum.shape[1]
    first = jnp.sum(cum <= target[:, None], axis=-1)
    last_positive = width - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.minimum(first, last_positive)
