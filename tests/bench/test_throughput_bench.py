"""Smoke test of bench/throughput.py's whole code path on its tiny "smoke" preset.

Runs jaxserve (continuous, prefix caching off, static batching) and transformers generate on a
one-layer checkpoint; vLLM is not run here (it needs its own venv). Asserts the shape and the
internal consistency of the results, never a time.
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

pytest.importorskip("torch")
pytest.importorskip("transformers")

import throughput  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One checkpoint and one XLA compile cache for the module's runs."""
    return tmp_path_factory.mktemp("bench-cache")


def test_smoke_preset_end_to_end(tmp_path, cache):
    out = tmp_path / "smoke.json"
    report = throughput.main(
        [
            "--preset",
            "smoke",
            "--cache",
            str(cache),
            "--output",
            str(out),
            "--no-bracket",
            "--async-scheduling",
            "off",
        ]
    )
    assert json.loads(out.read_text())["preset"] == "smoke"

    sg = report["datasets"]["sharegpt"]
    assert set(sg["engines"]) == {"jaxserve", "jaxserve-async-off", "static", "hf-transformers"}
    px = report["datasets"]["prefix"]
    assert set(px["engines"]) == {
        "jaxserve", "jaxserve-async-off", "jaxserve-nocache", "static", "hf-transformers"
    }  # fmt: skip
    for d in (sg, px):
        num_out = d["dataset"]["num_output_tokens"]
        for s in d["engines"].values():
            assert s["num_requests"] == 4
            assert s["num_output_tokens"] == num_out  # every engine generated the same
            assert s["output_tokens_per_s"] > 0
            assert s["ttft_ms_p50"] is not None
        assert d["ratios"]["jaxserve/static"] > 0
        # Static batching pads outputs to the batch's longest: it generates at least as much.
        assert d["engines"]["static"]["num_generated_tokens"] >= num_out

    js = px["engines"]["jaxserve"]
    assert js["prefix_cache_hits"] > 0
    assert js["prefix_hit_rate"] <= js["ideal_prefix_hit_rate"] + 1e-9
    assert px["engines"]["jaxserve-nocache"]["prefix_cache_hits"] == 0
    on_off = px["cache_on_off"]
    nocache = px["engines"]["jaxserve-nocache"]
    assert on_off["jaxserve"] == pytest.approx(
        js["output_tokens_per_s"] / nocache["output_tokens_per_s"]
    )
    # Cached prompt tokens skip their prefill: less work with caching on.
    assert on_off["work_ratio"] == pytest.approx(nocache["model_flops"] / js["model_flops"])
    assert on_off["work_ratio"] > 1
    assert "cache_on_off" in sg and "work_ratio" not in sg["cache_on_off"]
    assert px["engines"]["static"]["prefix_cache_hits"] == 0
    assert 0 < js["peak_kv_slot_utilization"] <= 1
    assert js["mfu_vs_matmul"] > 0 and js["bandwidth_vs_copy"] > 0
    assert report["info"]["jaxserve"]["warmup_compilations"] > 0
    assert all(
        s.get("compilations_during_run", 0) == 0 for d in (sg, px) for s in d["engines"].values()
    )
    assert {g["goal"] for g in report["goals"]}  # evaluated, whatever they say


def test_poisson_arrivals(tmp_path, cache):
    report = throughput.main(
        [
            "--preset",
            "smoke",
            "--cache",
            str(cache),
            "--output",
            str(tmp_path / "p.json"),
            "--baselines",
            "none",
            "--datasets",
            "sharegpt",
            "--request-rate",
            "100",
            "--no-bracket",
        ]
    )
    assert report["request_rate"] == 100
    (runs,) = report["datasets"]["sharegpt"]["timings"]["jaxserve"]
    arrivals = [t["arrival"] for t in runs]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(t["first_token"] >= t["arrival"] for t in runs)
    assert report["datasets"]["sharegpt"]["engines"]["jaxserve"]["mode"] == "poisson"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import plot

    report = {
        "model": {"name": "m", "num_params": 1e6},
        "machine": {"cpus": 2, "loadavg": {"start": [1.0], "end": [1.0]}},
        "time": "now",
        "datasets": {
            "sharegpt": {
                "engines": {
                    "jaxserve": {"output_tokens_per_s": 10.0},
                    "static": {"output_tokens_per_s": 4.0},
                },
                "ratios": {"jaxserve/static": 2.5},
            }
        },
    }
    png = plot.plot(report, tmp_path / "x.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
