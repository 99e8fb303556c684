"""Smoke test of bench/startup.py on its "tiny" preset (tiny-random-llama, a small engine).

Asserts the structure of the results and what is deterministic: the processes that share a
cache folder load what the first compiled, and no SamplingParams feature compiles anything
after warm-up. Never a time or a ratio of times.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import startup  # noqa: E402


@pytest.mark.slow  # 60-95 s on the shared 2-core machine: ten processes, six compile
def test_tiny_preset_end_to_end(tmp_path):
    out = tmp_path / "startup.json"
    report = startup.main(["--preset", "tiny", "--output", str(out), "--workers", "2"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    demo = report["demo"]
    first, second = demo["runs"]
    assert first["engine"]["fresh"] > 0 and first["engine"]["cache_hits"] == 0
    total = [r["engine"]["fresh"] + r["engine"]["cache_hits"] for r in demo["runs"]]
    assert total[0] == total[1]  # the same step shapes, compiled or loaded
    assert "compilations" in second["summary_line"]
    for run in demo["runs"]:
        assert run["wall_s"] > run["import_s"] > 0 and run["warmup"]["warmup_s"] > 0

    construct = report["construct"]
    first, second = construct["runs"]
    assert first["warmup"]["fresh"] > 0 and second["warmup"]["cache_hits"] > 0
    for run in construct["runs"]:
        assert run["construct_s"] > run["warmup"]["warmup_s"] > 0

    workers = report["workers"]
    assert workers["workers"] == 2 and workers["cpu_count"] >= 1
    assert set(workers["runs"]) == {"1", "2"} and workers["speedup"] > 0
    counts = {r["engine"]["compilations"] for rs in workers["runs"].values() for r in rs}
    assert len(counts) == 1 and counts.pop() > 0  # the same shapes, however many at a time
    for rs in workers["runs"].values():
        assert all(r["engine"]["cache_hits"] == 0 for r in rs)  # each its own empty cache

    features = report["features"]
    rows = features["features"]
    assert set(startup.FEATURES) < set(rows) and startup.MIXED in rows
    assert features["warmup"]["fresh"] > 0
    for name, row in rows.items():
        assert row["fresh"] == 0 and row["cache_hits"] == 0, (name, row["recompilations"])
        assert row["process"]["fresh"] == 0, (name, row["process"]["fresh_names"])
        assert row["output_tokens"] > 0, name
    assert rows["n=3"]["completions"] == 3 * len(features["prompts"])
    assert features["total_after_warmup"] == 0

    goals = report["goals"]
    phases = report["phases"]
    assert set(phases["models"]) == {"demo"} and "installed" in phases["vllm"]
    first, second = phases["models"]["demo"]["runs"]
    assert first["first"]["fresh"] > 0 and first["first"]["trace_s"] > 0
    # The second process loads every executable the first compiled (from jax's persistent
    # cache: the executable store is off on the CPU by default).
    assert second["first"]["fresh"] == 0
    assert second["first"]["cache_hits"] == first["first"]["fresh"] + first["first"]["cache_hits"]
    assert second["rebuild"]["fresh"] == 0  # a notebook's rebuild: loaded too

    assert set(goals) == {
        "demo_first_wall",
        "demo_second_wall",
        "demo_second_wall_ratio",
        "demo_second_fresh_compilations",
        "construct_second_ratio",
        "concurrent_warmup_speedup",
        "feature_compilations_after_warmup",
    }
    for goal in goals.values():
        assert {"goal", "value", "threshold", "op", "passed"} <= set(goal)
        assert isinstance(goal["passed"], bool)
    assert goals["feature_compilations_after_warmup"]["passed"]
