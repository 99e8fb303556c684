"""bench/_datasets.py and bench/_metrics.py: the request sets and the accounting (no jax)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _datasets  # noqa: E402
from _metrics import ModelShape, RequestTiming, RunResult  # noqa: E402

VOCAB = 32000


def test_sharegpt_like_lengths_are_clipped_and_near_the_means():
    ds = _datasets.sharegpt_like(2000, VOCAB, seed=1)
    ins = [r.prompt_len for r in ds.requests]
    outs = [r.output_len for r in ds.requests]
    assert min(ins) >= _datasets.MIN_LEN and max(ins) <= _datasets.MAX_PROMPT_LEN
    assert all(i + o <= _datasets.MAX_TOTAL_LEN for i, o in zip(ins, outs, strict=True))
    assert 140 < sum(ins) / len(ins) < 180
    assert 300 < sum(outs) / len(outs) < 380
    assert all(_datasets.FIRST_ID <= t < VOCAB for r in ds.requests for t in r.prompt_token_ids)
    assert ds.ideal_prefix_hit_tokens == 0


def test_sharegpt_like_is_seeded():
    a = _datasets.sharegpt_like(8, VOCAB, seed=3).requests
    b = _datasets.sharegpt_like(8, VOCAB, seed=3).requests
    assert a == b


def test_sharegpt_like_token_seed_keeps_the_lengths_and_draws_other_prompts():
    base = _datasets.sharegpt_like(16, VOCAB, seed=3).requests
    a = _datasets.sharegpt_like(16, VOCAB, seed=3, token_seed=11).requests
    b = _datasets.sharegpt_like(16, VOCAB, seed=3, token_seed=12).requests
    for x, y, z in zip(base, a, b, strict=True):
        assert x.prompt_len == y.prompt_len == z.prompt_len
        assert x.output_len == y.output_len == z.output_len
    # Other prompts: no request shares its first block-sized prefix with another set's.
    sets = (base, a, b)
    firsts = [{tuple(r.prompt_token_ids[:16]) for r in s if r.prompt_len >= 16} for s in sets]
    assert not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2]) and firsts[1]
    assert a == _datasets.sharegpt_like(16, VOCAB, seed=3, token_seed=11).requests


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_random_fixed_range_ratio(ratio):
    ds = _datasets.random_fixed(200, VOCAB, input_len=100, output_len=40, range_ratio=ratio)
    ins = {r.prompt_len for r in ds.requests}
    outs = {r.output_len for r in ds.requests}
    assert min(ins) >= 100 * (1 - ratio) and max(ins) <= 100 * (1 + ratio)
    assert min(outs) >= 40 * (1 - ratio) and max(outs) <= 40 * (1 + ratio)
    assert (len(ins) == 1) == (ratio == 0.0)


def test_random_fixed_rejects_a_bad_range_ratio():
    with pytest.raises(ValueError, match="range_ratio"):
        _datasets.random_fixed(4, VOCAB, range_ratio=1.0)


def test_prefix_repetition_shares_prefixes_and_knows_its_ideal():
    ds = _datasets.prefix_repetition(
        12, VOCAB, num_prefixes=3, prefix_len=40, suffix_len=8, output_len=5, block_size=16
    )
    prefixes = {tuple(r.prompt_token_ids[:40]) for r in ds.requests}
    assert len(prefixes) == 3
    assert all(r.prompt_len == 48 and r.output_len == 5 for r in ds.requests)
    # 3 prefixes x (4 - 1) later requests x 32 tokens (40 rounded down to blocks of 16).
    assert ds.ideal_prefix_hit_tokens == 3 * 3 * 32
    assert ds.ideal_prefix_hit_rate == pytest.approx(288 / (12 * 48))


def test_prefix_repetition_needs_a_request_per_prefix():
    with pytest.raises(ValueError, match="num_prefixes"):
        _datasets.prefix_repetition(2, VOCAB, num_prefixes=3)


def _shape() -> ModelShape:
    return ModelShape(
        num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=16, vocab=10
    )


def test_request_flops_counts_computed_tokens_and_attention():
    s = _shape()
    # Prompt 3, output 2: positions 0..3 computed (4 tokens), 2 sampled, contexts 1..4.
    attn = 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4)
    want = 2 * s.layer_matmul_params * 4 + 2 * s.lm_head_params * 2 + attn
    assert s.request_flops(3, 2) == pytest.approx(want)
    # A 2-token prefix hit skips positions 0 and 1.
    attn_cached = 4 * 2 * 2 * 4 * (3 + 4)
    want_cached = 2 * s.layer_matmul_params * 2 + 2 * s.lm_head_params * 2 + attn_cached
    assert s.request_flops(3, 2, cached=2) == pytest.approx(want_cached)


def test_run_result_summary():
    t = [RequestTiming(10, 5, 0.0, 0.1, 0.5, 0.5), RequestTiming(20, 1, 0.0, 0.2, 0.2, 0.6)]
    s = RunResult("x", 2.0, t).summary()
    assert s["requests_per_s"] == 1.0
    assert s["output_tokens_per_s"] == 3.0
    assert s["total_tokens_per_s"] == 18.0
    assert s["ttft_ms_p50"] == pytest.approx(150.0)
    assert s["tpot_ms_p50"] == pytest.approx(100.0)  # only the request with > 1 output
    assert s["e2e_ms_p99"] == pytest.approx(599.0, rel=1e-3)
