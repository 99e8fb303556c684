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
from hypothesis import given, settings
from hypothesis import strategies as st

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

    # Every run its own prompts (no prefix cache carried over): offline and served saturation
    # ran the same set, the rate another.
    assert runs["inf"]["request_set"] == "saturation-0"
    assert runs[8.0]["request_set"] == "rate-8"
    assert not any(r.get("search") for r in runs.values())  # the tiny preset does not search
    assert s["search_steps"] == 0

    off = report["offline"]
    assert off["request_set"] == "saturation-0"
    assert off["num_requests"] == off["tokens_match"] == n
    assert off["num_output_tokens"] == s["dataset"]["num_output_tokens"]
    ratio = report["comparison"]["served_saturation_over_offline"]
    assert ratio == pytest.approx(runs["inf"]["output_tokens_per_s"] / off["output_tokens_per_s"])

    # vLLM off: recorded as skipped, and its goals are "not measured" (pass None).
    assert report["comparison"]["per_rate"] == []
    assert set(report["comparison"]["sustained_rate"]) == {"jaxserve"}
    goals = {g["goal"]: g for g in report["goals"]}
    for g in goals.values():
        assert set(g) == {"goal", "value", "threshold", "direction", "pass"}
    served = next(g for name, g in goals.items() if "offline" in name)
    assert served["value"] == pytest.approx(ratio) and served["threshold"] == 0.9
    assert served["pass"] is (ratio >= 0.9)
    rate_goal = next(g for name, g in goals.items() if "sustained rate" in name)
    assert rate_goal["value"] is None and rate_goal["pass"] is None


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    png = serve.plot(report, tmp_path / "serve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run(rate, ttft_p99, itl_p99=20.0, failed=0):
    """A run's summary as far as the goal logic reads it."""
    return {
        "rate": rate,
        "failed": failed,
        "ttft_ms_p99": ttft_p99,
        "itl_ms_p99": itl_p99,
        "ttft_ms_p50": ttft_p99 / 2,
        "itl_ms_p50": itl_p99 / 2,
        "output_tokens_per_s": 100.0,
    }


def test_goals_and_rates_from_numbers():
    """The goal logic on hand-made numbers: the sustained rate, the ratio, the per-rate
    comparisons."""
    inf = math.inf
    report = {
        "servers": {
            "jaxserve": {"runs": [_run(inf, 9000, 50), _run(1.0, 100, 20), _run(2.0, 1500, 30)]},
            "vllm": {"runs": [_run(inf, 9000, 80), _run(1.0, 300, 30), _run(2.0, 4000, 25)]},
        },
        "offline": {"output_tokens_per_s": 110.0},
    }
    report["comparison"] = serve.compare(report)
    c = report["comparison"]
    assert c["sustained_rate"] == {"jaxserve": 2.0, "vllm": 1.0}
    assert c["served_saturation_over_offline"] == pytest.approx(100 / 110)
    by_rate = {row["rate"]: row for row in c["per_rate"]}
    assert by_rate[2.0]["jaxserve_ttft_p99_no_worse"] is True
    assert by_rate[2.0]["jaxserve_itl_p99_no_worse"] is False
    g = {x["goal"]: x for x in serve.goals(report)}
    rate_goal = g["sustained rate (p99 TTFT <= 2 s there and below): jaxserve / vLLM"]
    assert rate_goal["value"] == 2.0 and rate_goal["pass"] is True
    assert g["rate 2: jaxserve p99 ITL / vLLM's"]["pass"] is False
    assert g["rate inf: jaxserve p99 TTFT / vLLM's"]["pass"] is True  # equal: no worse
    assert (
        json.loads(json.dumps(serve._json_safe(report)))["comparison"]["per_rate"][-1]["rate"]
        == "inf"
    )


def test_async_over_sync_side_by_side():
    """--servers jaxserve,jaxserve-sync: per rate both ran, async scheduling's numbers over
    the synchronous server's; each server's sustained rate; nothing when one is missing."""
    inf = math.inf
    report = {
        "servers": {
            "jaxserve": {"runs": [_run(inf, 900, 40), _run(1.0, 100, 20)]},
            "jaxserve-sync": {"runs": [_run(inf, 1800, 50), _run(2.0, 100, 20)]},
        },
    }
    c = serve.compare(report)
    (row,) = c["async_over_sync"]
    assert row["rate"] == inf
    assert row["ttft_ms_p99"] == pytest.approx(0.5)
    assert row["itl_ms_p99"] == pytest.approx(0.8) and row["output_tokens_per_s"] == 1.0
    assert set(c["sustained_rate"]) == {"jaxserve", "jaxserve-sync"}
    del report["servers"]["jaxserve-sync"]
    assert serve.compare(report)["async_over_sync"] == []


def test_sustained_rate_and_the_next_search_rate():
    inf = math.inf
    ok, miss = 500.0, 5000.0
    runs = {1.0: _run(1.0, ok), 2.0: _run(2.0, ok), 4.0: _run(4.0, miss), inf: _run(inf, miss)}
    assert serve.slo_bracket(runs) == (2.0, 4.0)
    assert serve.next_search_rate(runs) == 3.0
    runs[3.0] = _run(3.0, ok)
    assert serve.next_search_rate(runs) == 3.5
    runs[3.5] = _run(3.5, miss)
    assert serve.sustained_rate(runs) == 3.0 and serve.next_search_rate(runs) == 3.25
    # A pass above the first miss does not count; failed requests are a miss.
    noisy = {1.0: _run(1.0, ok), 2.0: _run(2.0, ok, failed=1), 3.0: _run(3.0, ok)}
    assert serve.sustained_rate(noisy) == 1.0 and serve.next_search_rate(noisy) == 1.5
    # Only all-at-once missed: double; nothing met: halve; met everywhere: nothing to find.
    assert serve.next_search_rate({1.0: _run(1.0, ok), inf: _run(inf, miss)}) == 2.0
    assert serve.next_search_rate({2.0: _run(2.0, miss), inf: _run(inf, miss)}) == 1.0
    assert serve.next_search_rate({1.0: _run(1.0, ok), inf: _run(inf, ok)}) is None
    assert serve.next_search_rate({inf: _run(inf, miss)}) is None
    assert serve.sustained_rate({}) is None
    # A bracket narrower than the tolerance ends the search.
    assert serve.next_search_rate({3.0: _run(3.0, ok), 3.05: _run(3.05, miss)}) is None


@given(
    threshold=st.floats(0.2, 50.0),
    grid=st.lists(st.floats(0.1, 80.0), min_size=1, max_size=6, unique=True),
)
@settings(max_examples=200, deadline=None)
def test_the_search_brackets_a_server_s_threshold(threshold, grid):
    """Against a server that meets the SLO exactly below `threshold`, the grid and then the
    search end with sustained <= threshold < the lowest miss, the two within the tolerance
    (or one rounding step) of each other, in a bounded number of runs."""
    inf = math.inf

    def measure(rate):
        return _run(rate, 500.0 if rate <= threshold else 5000.0)

    runs = {r: measure(r) for r in [*grid, inf]}
    for _ in range(39):
        rate = serve.next_search_rate(runs)
        if rate is None:
            break
        assert rate not in runs
        runs[rate] = measure(rate)
    else:
        pytest.fail("the search did not end within 39 steps")
    lo, hi = serve.slo_bracket(runs)
    assert hi is not None and threshold < hi
    if lo is not None:
        assert lo <= threshold
        assert hi / lo - 1 <= serve.SEARCH_REL_TOL or hi - lo <= 0.01 * hi
    else:  # halving stopped only by rounding: the lowest miss is tiny
        assert hi <= 0.01
