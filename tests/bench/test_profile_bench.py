"""Smoke test of bench/profile_throughput.py on the tiny "smoke" preset (no time asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import profile_throughput  # noqa: E402


def test_profile_smoke(tmp_path):
    report = profile_throughput.main(
        [
            "--preset",
            "smoke",
            "--concurrency",
            "4",
            "--decode-steps",
            "2",
            "--num-requests",
            "3",
            "--reps",
            "1",
            "--cache",
            str(tmp_path / "cache"),
            "--output",
            str(tmp_path / "p.json"),
        ]
    )
    assert report["warmup"]["compilations"] > 0
    assert report["steps"] and all(r["greedy_ms"] > 0 for r in report["steps"])
    sg = report["sharegpt"]
    assert sg["num_steps"] > 0 and sg["compilations_during_run"] == 0
    assert 0 <= sg["host_share"] <= 1 and sg["token_padding_waste"] >= 0
    assert sum(b["steps"] for b in sg["bucket_histogram"].values()) == sg["num_steps"]
    dec = report["decode"]
    assert dec["num_steps"] == 2 and dec["mean_rows"] == 4  # all 4 decoding
    assert dec["host_profile_top"]
