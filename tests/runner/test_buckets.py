"""Padding buckets: every batch size maps to the smallest bucket that holds it, and the bucket
set is small and closed (what warm-up compiles is all the step ever sees)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.runner.buckets import MIN_TOKEN_BUCKET, BucketSpec, pow2_buckets, round_up


def test_pow2_buckets() -> None:
    assert pow2_buckets(4, 2048) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert pow2_buckets(3, 100) == (4, 8, 16, 32, 64, 100)
    assert pow2_buckets(1, 1) == (1,)
    with pytest.raises(ValueError, match="bucket bounds must be >= 1, got lo=0"):
        pow2_buckets(0, 8)


def test_round_up_past_the_largest_raises() -> None:
    assert round_up(5, (4, 8)) == 8
    with pytest.raises(ValueError, match="value 9 exceeds the largest bucket 8"):
        round_up(9, (4, 8))


@given(
    budget=st.integers(1, 4096),
    max_num_seqs=st.integers(1, 1024),
    max_blocks=st.integers(1, 512),
    bucket_width=st.booleans(),
    data=st.data(),
)
def test_every_batch_lands_in_a_compiled_shape(
    budget: int, max_num_seqs: int, max_blocks: int, bucket_width: bool, data
) -> None:
    spec = BucketSpec.create(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=max_blocks,
        bucket_width=bucket_width,
    )
    assert spec.token_buckets[0] == min(MIN_TOKEN_BUCKET, budget)
    assert spec.token_buckets[-1] == budget
    tokens = data.draw(st.integers(1, budget))
    rows = data.draw(st.integers(1, min(tokens, max_num_seqs)))  # every row has a token
    blocks = data.draw(st.integers(0, max_blocks))
    t = spec.padded_tokens(tokens)
    r = spec.padded_rows(t)
    b = spec.padded_width(blocks)
    assert (t, r, b) in spec.all_shapes()
    assert tokens <= t < 2 * tokens or t == spec.token_buckets[0]  # pow2: under 2x padding
    assert rows <= r <= t and blocks <= b <= max_blocks
    if not bucket_width:
        assert b == max_blocks
