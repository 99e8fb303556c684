"""Padding buckets: every batch size maps to the smallest bucket that holds it, and the bucket
set is small and closed (what warm-up compiles is all the step ever sees)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.runner.buckets import (
    MIN_TOKEN_BUCKET,
    BucketSpec,
    pow2_buckets,
    round_up,
    token_bucket_sizes,
)


def test_pow2_buckets() -> None:
    assert pow2_buckets(4, 2048) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert pow2_buckets(3, 100) == (4, 8, 16, 32, 64, 100)
    assert pow2_buckets(1, 1) == (1,)
    with pytest.raises(ValueError, match="bucket bounds must be >= 1, got lo=0"):
        pow2_buckets(0, 8)


def test_token_bucket_sizes() -> None:
    assert token_bucket_sizes(4, 2048) == (
        4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048
    )  # fmt: skip
    assert token_bucket_sizes(4, 2048, midpoints=False) == pow2_buckets(4, 2048)
    assert token_bucket_sizes(1, 100) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert token_bucket_sizes(3, 7) == (4, 6, 7)
    assert token_bucket_sizes(4, 5) == (4, 5)
    assert max(token_bucket_sizes(4, 1 << 20)) == 1 << 20
    assert token_bucket_sizes(4, 300) == (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300)
    assert token_bucket_sizes(4, 384)[-2:] == (256, 384)  # a midpoint at the budget: once


def test_round_up_past_the_largest_raises() -> None:
    assert round_up(5, (4, 8)) == 8
    with pytest.raises(ValueError, match="value 9 exceeds the largest bucket 8"):
        round_up(9, (4, 8))


@given(
    budget=st.integers(1, 4096),
    max_num_seqs=st.integers(1, 1024),
    max_blocks=st.integers(1, 512),
    bucket_width=st.booleans(),
    mid_token_buckets=st.booleans(),
    single_token_bucket=st.booleans(),
    data=st.data(),
)
def test_every_batch_lands_in_a_compiled_shape(
    budget: int,
    max_num_seqs: int,
    max_blocks: int,
    bucket_width: bool,
    mid_token_buckets: bool,
    single_token_bucket: bool,
    data,
) -> None:
    spec = BucketSpec.create(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=max_blocks,
        bucket_width=bucket_width,
        mid_token_buckets=mid_token_buckets,
        single_token_bucket=single_token_bucket,
    )
    smallest = min(MIN_TOKEN_BUCKET, budget)  # the smallest power-of-two bucket
    assert spec.token_buckets[0] == (1 if single_token_bucket else smallest)
    assert spec.padded_tokens(1) == (1 if single_token_bucket else smallest)
    assert spec.token_buckets[-1] == budget
    tokens = data.draw(st.integers(1, budget))
    rows = data.draw(st.integers(1, min(tokens, max_num_seqs)))  # every row has a token
    blocks = data.draw(st.integers(0, max_blocks))
    t = spec.padded_tokens(tokens)
    r = spec.padded_rows(t)
    b = spec.padded_width(blocks)
    assert (t, r, b) in spec.all_shapes()
    assert tokens <= t and (t < 2 * tokens or t == smallest)  # pow2: under 2x padding
    if mid_token_buckets and t > smallest:
        assert t < 1.5 * tokens  # with the midpoints: under 1.5x
    assert rows <= r <= t and blocks <= b <= max_blocks
    if not bucket_width:
        assert b == max_blocks


@given(
    max_blocks=st.integers(1, 4096),
    max_tokens=st.integers(1, 8192),
    max_shapes=st.integers(1, 200),
)
def test_the_shape_budget_thins_widths_but_keeps_the_full_table(
    max_blocks, max_tokens, max_shapes
) -> None:
    """map_budget.py: a CPU engine holds at most so many executables; the widths give way."""
    full = BucketSpec.create(
        max_num_batched_tokens=max_tokens, max_num_seqs=8, max_blocks_per_seq=max_blocks
    )
    spec = BucketSpec.create(
        max_num_batched_tokens=max_tokens,
        max_num_seqs=8,
        max_blocks_per_seq=max_blocks,
        max_shapes=max_shapes,
    )
    assert spec.token_buckets == full.token_buckets  # only widths give way
    assert spec.width_buckets[-1] == max_blocks  # every table still fits
    assert set(spec.width_buckets) <= set(full.width_buckets)
    assert len(spec.all_shapes()) <= max(max_shapes, len(spec.token_buckets))
    if len(full.all_shapes()) <= max_shapes:
        assert spec == full
    for num_blocks in range(1, max_blocks + 1, max(1, max_blocks // 50)):
        assert spec.padded_width(num_blocks) >= num_blocks


def test_the_map_budget_follows_the_process_limit() -> None:
    from jaxserve.runner.map_budget import MAPS_PER_EXECUTABLE, max_executables, max_step_shapes

    assert max_executables(65_530) == 65_530 // 2 // MAPS_PER_EXECUTABLE == 63
    assert max_executables(1_048_576) == 1024
    assert max_executables(100) == 8  # never below a handful
    assert max_step_shapes(63, 2, 3) == 30 and max_step_shapes(None, 2, 3) is None
    assert max_step_shapes(8, 2, 9) == 1
