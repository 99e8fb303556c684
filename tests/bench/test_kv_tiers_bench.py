"""Smoke test of bench/kv_tiers.py's capacity workload on a tiny budget and batch.

Asserts what is deterministic: the pools the two engines get at one budget (fp8 pages hold
about four times the f32 tokens), the JSON written, and no compilation in the timed runs.
Never a time or a ratio of times.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import kv_tiers  # noqa: E402

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow


def test_capacity_workload_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "kv_tiers.json"
    # 8 MiB: the workspace reserves a 256-row chunk of prompt-logprob logits (max_num_batched_
    # tokens 256 > max_num_seqs 64), so this leaves the KV cache about the 1 MiB 6.5 MiB did.
    argv = ["--workloads", "capacity", "--budget-mib", "8", "--num-requests", "6"]
    argv += ["--prompt-len", "24", "--output-len", "8", "--max-model-len", "64"]
    argv += ["--output", str(out)]
    report = kv_tiers.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    capacity = report["workloads"]["capacity"]
    auto, fp8 = capacity["runs"]["auto"], capacity["runs"]["fp8"]
    assert auto["plan_kv_cache_dtype"] == "float32"
    assert fp8["plan_kv_cache_dtype"] == "float8_e4m3fn"
    assert auto["attention"] == fp8["attention"] == "xla"
    # Same budget, same weights and workspace: 4x the tokens (one block less of rounding).
    assert fp8["num_kv_blocks"] >= 4 * auto["num_kv_blocks"] - 4
    assert capacity["fp8_over_auto"]["kv_tokens"] >= 3.8
    for run in (auto, fp8):
        assert run["output_tokens"] == 6 * 8 and run["compilations_timed"] == 0
    assert 0 <= capacity["requests_with_identical_greedy_tokens"] <= 6
    assert 0 <= capacity["mean_greedy_tokens_before_first_difference"] <= 8
    with pytest.raises(SystemExit):
        kv_tiers.parse_args(["--workloads", "nope"])


def test_host_tier_and_preemption_workloads_on_tiny_sizes() -> None:
    """(b) and (c) of bench/kv_tiers.py (bench/_kv_tier_workloads.py), tiny: the deterministic
    parts only (same outputs everywhere, the tier serves prefix hits, swaps happen)."""
    from _kv_tier_workloads import host_tier_workload, preemption_workload

    # Steps of 32 tokens: fewer buckets to compile in each of the six engines than 64 (the
    # 64-token first turns still take two chunks).
    host = host_tier_workload(
        num_conversations=3, num_turns=2, first_turn_tokens=64, turn_tokens=16,
        output_tokens=4, max_num_batched_tokens=32, warmup=False,
    )  # fmt: skip
    assert host["same_outputs"]
    assert host["with"]["prefix_hit_rate"] > host["without"]["prefix_hit_rate"]
    # 16 output tokens, not 48: still 3x the pool, so every mode preempts (swap and auto swap).
    swap = preemption_workload(
        num_requests=8, prompt_tokens=32, output_tokens=16, max_num_batched_tokens=32, warmup=False
    )
    assert swap["same_outputs"] and "auto_vs_best_fixed" in swap
    assert swap["swap"]["num_preemptions"] > 0 and swap["swap"]["num_swap_preemptions"] > 0
