"""The sampler's C++ draw (pallas_kernels/sampling/cpu_draw.cc) against the float64 CDF it
inverts, at the edges of the uniform and against the sampler's XLA draw. The sampler's own
exact-distribution tests (tests/runner/test_sampler.py) run through it on the CPU too."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.sampling import cpu_draw
from jaxserve.runner.draw import xla_draw


@pytest.fixture(autouse=True)
def _needs_kernel() -> None:
    # Built on first use, at run time: collecting the tests builds nothing.
    if not cpu_draw.available():
        pytest.skip(f"C++ kernel unavailable: {cpu_draw.KERNEL.load()}")


def _random_problem(rows: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4, (rows, 1))).astype(np.float32)
    x[rng.random((rows, vocab)) < 0.05] = -np.inf  # banned tokens
    x[np.arange(rows), rng.integers(0, vocab, rows)] = 5.0  # every row keeps its maximum
    uniform = rng.random(rows).astype(np.float32)
    inv_t = (1 / rng.uniform(0.3, 2.0, rows)).astype(np.float32)
    offset = np.where(rng.random(rows) < 0.5, -np.inf, np.log(rng.uniform(0.001, 0.2, rows)))
    threshold = np.where(rng.random(rows) < 0.5, -np.inf, rng.uniform(-2, 2, rows))
    return x, uniform, inv_t, offset.astype(np.float32), threshold.astype(np.float32)


def _cdf(x, inv_t, offset, threshold):
    """float64 CDF of softmax(x * inv_t) over x >= max(max(x) + offset, threshold), per row."""
    x = x.astype(np.float64)
    floor = np.maximum(x.max(-1) + offset, threshold)[:, None]
    p = np.where(x >= floor, np.exp((x - x.max(-1, keepdims=True)) * inv_t[:, None]), 0.0)
    return np.cumsum(p, -1) / p.sum(-1, keepdims=True), x >= floor


@pytest.mark.parametrize("vocab", [1, 7, 256, 1000, 32000])
def test_the_draw_inverts_the_cdf(vocab: int) -> None:
    """Each drawn token's CDF interval holds the row's uniform (to f32 rounding), and it is
    never a masked token; a vocabulary not a multiple of the chunk (256) included."""
    x, u, inv_t, offset, threshold = _random_problem(64, vocab, seed=vocab)
    tokens = np.asarray(cpu_draw.cpu_draw(*map(jnp.asarray, (x, u, inv_t, offset, threshold))))
    cdf, kept = _cdf(x, inv_t, offset, threshold)
    rows = np.arange(len(x))
    assert tokens.dtype == np.int32 and ((0 <= tokens) & (tokens < vocab)).all()
    assert kept[rows, tokens].all()
    below = np.where(tokens > 0, cdf[rows, np.maximum(tokens - 1, 0)], 0.0)
    assert (below <= u + 1e-5).all() and (u <= cdf[rows, tokens] + 1e-5).all()


def test_edges_of_the_uniform_never_pick_masked_tokens() -> None:
    vocab = 600  # chunks of 256: 256, 256, 88
    x = np.full((3, vocab), -np.inf, np.float32)
    x[:, [10, 300, 550]] = [0.0, 1.0, 0.5]
    u = np.array([0.0, 0.999999, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    ones = np.ones(3, np.float32)
    none = np.full(3, -np.inf, np.float32)
    tokens = np.asarray(cpu_draw.cpu_draw(*map(jnp.asarray, (x, u, ones, none, none))))
    assert tokens.tolist() == [10, 550, 550]


def test_agrees_with_the_xla_draw() -> None:
    """Same inputs, same tokens, but for rows whose uniform falls within rounding of a CDF
    step (the exps differ in the last bits)."""
    args = tuple(map(jnp.asarray, _random_problem(512, 3000, seed=7)))
    got = np.asarray(cpu_draw.cpu_draw(*args))
    want = np.asarray(xla_draw(*args))
    assert np.mean(got == want) >= 0.99
