"""Smoke test of bench/attention_cpu.py on two small cases (no time asserted): every variant
runs and agrees with the reference (the script asserts it), and the JSON has a row per case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import attention_cpu  # noqa: E402


def test_attention_cpu_smoke(tmp_path):
    out = tmp_path / "a.json"
    report = attention_cpu.main(["--reps", "1", "--cases", "5 decodes,40-token", "--out", str(out)])
    assert [r["case"] for r in report["rows"]] == [
        "5 decodes, ShareGPT contexts",
        "40-token chunk at 600 + 24 decodes",
    ]
    for row in report["rows"]:
        assert set(row["ms"]) == {"reference", *attention_cpu.VARIANTS}
        assert all(v > 0 for v in row["ms"].values())
    assert json.loads(out.read_text())["rows"] == report["rows"]
