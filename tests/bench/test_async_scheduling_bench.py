"""Smoke test of bench/async_scheduling.py on the demo model, one small batch (no time
asserted): both modes ran, their greedy tokens are the same, the tracer's shares are shares."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import async_scheduling  # noqa: E402


def test_demo_model_one_batch(tmp_path):
    out = tmp_path / "async.json"
    args = ["--models", "demo", "--batches", "2", "--max-tokens", "4", "--prompt-len", "4",
            "--max-num-batched-tokens", "4"]  # fmt: skip
    results = async_scheduling.main([*args, "--cache", str(tmp_path), "--output", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row == json.loads(json.dumps(results[0]))
    assert row["same_tokens"] and row["tok_s_on"] > 0 and row["tok_s_off"] > 0
    for key in ("idle_on", "idle_off"):
        assert math.isnan(row[key]) or 0.0 <= row[key] <= 1.0
