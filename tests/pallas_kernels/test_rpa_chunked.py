"""The xla backend's two passes (row blocks sorted by context, or the C++ row kernel; tiles of
prefill rows) against the reference on random ragged batches: any mix of decodes and
multi-token chunks, any tunables."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_chunked,
    ragged_paged_attention_reference,
)
from jaxserve.pallas_kernels.ragged_paged_attention.testing import random_batch

T, R, B, P, K, G, H = 48, 8, 6, 4, 2, 2, 16  # tokens, slots, table width, page, kv heads, group
S = R * B + 1  # pages; page 0 is the null page
SCALE = H**-0.5
# A few tunable sets (each compiles once): one-row blocks and tiles, ragged sizes, defaults.
TUNABLES = [
    dict(rows_per_block=1, tile_rows=1, pages_per_chunk=1, tile_pages_per_chunk=1),
    dict(rows_per_block=3, tile_rows=5, pages_per_chunk=2, tile_pages_per_chunk=1),
    dict(rows_per_block=4, tile_rows=8, pages_per_chunk=1, tile_pages_per_chunk=4),
    dict(),
    # The C++ row kernel in place of the XLA row pass, beside small and default tiles.
    dict(row_kernel="cpu", tile_rows=5, tile_pages_per_chunk=1),
    dict(row_kernel="cpu"),
]


@functools.cache
def _compiled(index: int, sliding_window: int | None):
    return jax.jit(
        functools.partial(
            ragged_paged_attention_chunked,
            sm_scale=SCALE,
            sliding_window=sliding_window,
            **TUNABLES[index],
        )
    )


@functools.cache
def _reference(sliding_window: int | None):
    return jax.jit(
        functools.partial(
            ragged_paged_attention_reference, sm_scale=SCALE, sliding_window=sliding_window
        )
    )


def _inputs(seqs: list[tuple[int, int]], seed: int):
    return random_batch(
        seqs,
        num_tokens=T,
        num_slots=R,
        table_width=B,
        num_q_heads=K * G,
        num_kv_heads=K,
        head_dim=H,
        page_size=P,
        num_pages=S,
        rng=np.random.default_rng(seed),
    )


@st.composite
def _batches(draw):
    """Up to R - 1 sequences whose query rows fit in T: decodes and chunks, contexts up to B*P."""
    seqs, rows = [], 0
    for _ in range(draw(st.integers(1, R - 1))):
        kv_len = draw(st.integers(1, B * P))
        q_len = draw(st.sampled_from([1, 1, kv_len, draw(st.integers(1, kv_len))]))
        q_len = min(q_len, T - rows)
        if q_len == 0:
            break
        seqs.append((q_len, kv_len))
        rows += q_len
    return seqs


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=_batches(),
    tunables=st.integers(0, len(TUNABLES) - 1),
    window=st.sampled_from([None, 5]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_on_random_batches(seqs, tunables: int, window, seed: int) -> None:
    args = _inputs(seqs, seed)
    want = np.asarray(_reference(window)(*args))
    got = np.asarray(_compiled(tunables, window)(*args))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not got[int(args[5][-1]) :].any(), "padding rows must be zero"


def test_a_prompt_longer_than_many_tiles_with_decodes_around_it() -> None:
    """One 22-token chunk (tiles of 4: six tiles, the last partial) between decodes of very
    different lengths (row blocks of 2: the sort decides which block each lands in)."""
    seqs = [(1, 24), (22, 22), (1, 1), (1, 13), (1, 24), (1, 2)]
    args = _inputs(seqs, 7)
    want = ragged_paged_attention_reference(*args, sm_scale=SCALE)
    got = ragged_paged_attention_chunked(
        *args, sm_scale=SCALE, rows_per_block=2, tile_rows=4, pages_per_chunk=1
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "name", ["pages_per_chunk", "rows_per_block", "tile_rows", "tile_pages_per_chunk"]
)
@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_bad_tunables_raise(name: str, value) -> None:
    args = _inputs([(1, 3)], 0)
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got {value}"):
        ragged_paged_attention_chunked(*args, sm_scale=SCALE, **{name: value})
