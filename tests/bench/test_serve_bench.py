"""Smoke test of bench/serve.py on its "tiny" preset: the built-in demo model served by
`jaxserve serve` in a subprocess, driven over HTTP (streaming completions) all at once and at one
Poisson rate, plus the offline LLM.generate reference. vLLM is asked for but off
(--vllm-python '', and a built-in model has no folder for it): skipped with a note. Asserts
the shape and the consistency of the results, never a time or a ratio of times.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
# On one xdist worker: the module's report fixture (a server and an offline run) is built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_bench")]

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import serve  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One tiny run for the module (the server and the offline run take most of a minute)."""
    tmp = tmp_path_factory.mktemp("serve-bench")
    out = tmp / "serve_tiny.json"
    serve.main(
        ["--preset", "tiny", "--servers", "jaxserve,vllm", "--vllm-python", "",
         "--cache", str(tmp / "cache"), "--output", str(out)]
    )  # fmt: skip
    return json.loads(out.read_text())  # what was written: strict JSON, inf as "inf"


def test_structure_and_sanity(report):
    assert report["preset"] == "tiny" and report["partial"] is False
    assert report["machine"]["cpus"] >= 1
    s = report["settings"]
    n = s["num_requests"]
    assert s["rates"] == [8.0]
    assert s["dataset"]["num_requests"] == n

    assert set(report["servers"]) == {"jaxserve", "vllm"}
    assert "skipped" in report["servers"]["vllm"]
    assert any(note.startswith("vllm skipped") for note in report["notes"])
    js = report["servers"]["jaxserve"]
    assert "error" not in js, js.get("error")
    assert js["startup_s"] > 0
    assert js["stop"]["returncode"] is not None  # the server process has ended
    runs = {r["rate"]: r for r in js["runs"]}
    assert set(runs) == {"inf", 8.0}
    for rate, r in runs.items():
        assert r["num_requests"] == r["completed"] == r["tokens_match"] == n, r.get("errors")
        assert r["failed"] == 0
        assert r["num_output_tokens"] == s["dataset"]["num_output_tokens"]
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"]
        assert r["tokens_per_chunk"] >= 1
        reqs = r["requests"]
        assert len(reqs) == n
        for q in reqs:
            assert q["error"] is None
            assert q["completion_tokens"] == q["output_len"]  # ignore_eos + max_tokens
            assert 0 < q["ttft"] <= q["e2e"]
            assert 1 <= q["num_chunks"] <= q["completion_tokens"]
            assert q["start"] >= q["arrival"] - 1e-3  # never sent early
        arrivals = [q["arrival"] for q in reqs]
        if rate == "inf":
            assert arrivals == [0.0] * n
        else:
            assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0

    off = report["offline"]
    assert off["num_requests"] == off["tokens_match"] == n
    assert off["num_output_tokens"] == s["dataset"]["num_output_tokens"]
    ratio = report["comparison"]["served_saturation_over_offline"]
    assert ratio == pytest.approx(runs["inf"]["output_tokens_per_s"] / off["output_tokens_per_s"])

    # vLLM off: recorded as skipped, and its goals are "not measured" (pass None).
    assert report["comparison"]["per_rate"] == []
    assert set(report["comparison"]["max_rate_p99_ttft_le_2s"]) == {"jaxserve"}
    goals = {g["goal"]: g for g in report["goals"]}
    for g in goals.values():
        assert set(g) == {"goal", "value", "threshold", "direction", "pass"}
    served = next(g for name, g in goals.items() if "offline" in name)
    assert served["value"] == pytest.approx(ratio) and served["threshold"] == 0.9
    assert served["pass"] is (ratio >= 0.9)
    rate_goal = next(g for name, g in goals.items() if "highest rate" in name)
    assert rate_goal["value"] is None and rate_goal["pass"] is None


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    png = serve.plot(report, tmp_path / "serve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goals_and_rates_from_numbers():
    """The goal logic on hand-made numbers: highest rate within the TTFT SLO, the ratio, the
    per-rate comparisons."""

    def run(rate, ttft_p99, itl_p99, failed=0):
        return {
            "rate": rate,
            "failed": failed,
            "ttft_ms_p99": ttft_p99,
            "itl_ms_p99": itl_p99,
            "ttft_ms_p50": ttft_p99 / 2,
            "itl_ms_p50": itl_p99 / 2,
            "output_tokens_per_s": 100.0,
        }

    inf = math.inf
    report = {
        "servers": {
            "jaxserve": {"runs": [run(inf, 9000, 50), run(1.0, 100, 20), run(2.0, 1500, 30)]},
            "vllm": {"runs": [run(inf, 9000, 80), run(1.0, 300, 30), run(2.0, 4000, 25)]},
        },
        "offline": {"output_tokens_per_s": 110.0},
    }
    report["comparison"] = serve.compare(report)
    c = report["comparison"]
    assert c["max_rate_p99_ttft_le_2s"] == {"jaxserve": 2.0, "vllm": 1.0}
    assert c["served_saturation_over_offline"] == pytest.approx(100 / 110)
    by_rate = {row["rate"]: row for row in c["per_rate"]}
    assert by_rate[2.0]["jaxserve_ttft_p99_no_worse"] is True
    assert by_rate[2.0]["jaxserve_itl_p99_no_worse"] is False
    g = {x["goal"]: x for x in serve.goals(report)}
    assert g["highest rate with p99 TTFT <= 2 s: jaxserve / vLLM"]["value"] == 2.0
    assert g["highest rate with p99 TTFT <= 2 s: jaxserve / vLLM"]["pass"] is True
    assert g["rate 2: jaxserve p99 ITL / vLLM's"]["pass"] is False
    assert g["rate inf: jaxserve p99 TTFT / vLLM's"]["pass"] is True  # equal: no worse
    assert serve.max_rate_within_slo({1.0: run(1.0, 100, 1, failed=1)}) is None
    assert (
        json.loads(json.dumps(serve._json_safe(report)))["comparison"]["per_rate"][-1]["rate"]
        == "inf"
    )
