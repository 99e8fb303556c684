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

SMOKE_EXPERIMENTS = "demo,construct,features,phases"


# Four of the five experiments (eight processes, four compile): "workers" (two more processes,
# each compiling the whole set, to measure what the CPU already answered: ~1x) is checked below
# with its processes stood in for.
@pytest.mark.slow
def test_tiny_preset_end_to_end(tmp_path):
    out = tmp_path / "startup.json"
    argv = ["--preset", "tiny", "--output", str(out), "--experiments", SMOKE_EXPERIMENTS,
            "--restart-repeats", "0"]  # the restarted pairs: stood in for below  # fmt: skip
    report = startup.main(argv)
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
    assert set(phases["models"]) == {"demo"} and phases["vllm"]["same_run"] is False
    first, second = phases["models"]["demo"]["runs"]
    assert first["first"]["fresh"] > 0 and first["first"]["trace_s"] > 0
    # The second process loads every executable the first compiled (from jax's persistent
    # cache: tests/conftest.py turns the executable store off in the suite).
    assert second["first"]["fresh"] == 0
    assert second["first"]["cache_hits"] == first["first"]["fresh"] + first["first"]["cache_hits"]
    assert second["rebuild"]["fresh"] == 0  # a notebook's rebuild: loaded too

    assert set(goals) == {
        "demo_first_wall",
        "demo_second_wall",
        "demo_second_wall_ratio",
        "demo_second_fresh_compilations",
        "construct_second_ratio",
        "feature_compilations_after_warmup",
    }
    for goal in goals.values():
        assert {"goal", "value", "threshold", "op", "passed"} <= set(goal)
        assert isinstance(goal["passed"], bool)
    assert goals["feature_compilations_after_warmup"]["passed"]


def test_workers_experiment_alternates_and_compares(monkeypatch):
    """Experiment 3 without its processes: the 1-worker and N-worker runs alternate (1, N, N,
    1: a drift hits both alike), each in a cache folder of its own, and the speedup is the
    ratio of their mean warm-up times; its goal is reported."""
    caches, specs = [], []

    def child(spec, cache_dir, timeout=1800):
        caches.append(cache_dir)
        specs.append(spec)
        warmup_s = 4.0 if spec["workers"] == 1 else 2.0
        proc = {"fresh": 3, "fresh_names": ["jit_step", "jit_step", "jit_copy"]}
        return {"wall_s": 9.0, "construct_s": 5.0, "warmup_s": warmup_s, "process": proc,
                "engine": {"compilations": 3, "cache_hits": 0}, "warmup_process": proc}  # fmt: skip

    monkeypatch.setattr(startup, "run_child", child)
    out = startup.workers(startup.PRESETS["tiny"], "tiny-random-llama", 2, repeats=2)
    assert [s["workers"] for s in specs] == out["order"] == [1, 2, 2, 1]
    assert len(set(caches)) == 4  # an empty cache folder each
    assert out["speedup"] == pytest.approx(2.0)
    assert out["warmup_s_mean"] == {"1": 4.0, "2": 2.0}
    names = {"jit_step": 2, "jit_copy": 1}  # counted by name
    assert all(r["warmup_process"]["fresh_names"] == names for r in out["runs"]["2"])
    goal = startup.goals({"workers": out, "machine": {"jax_backend": "cpu"}})
    assert goal["concurrent_warmup_speedup"]["value"] == pytest.approx(2.0)


def test_construct_restarts_alternate_on_the_first_processes_cache(monkeypatch):
    """Experiment 2's restarted pairs without their processes: weights first and overlapped
    alternate (a drift hits both alike), on the folder the first two processes filled, and
    the overlap ratio is the ratio of their mean construction times."""
    caches, specs = [], []

    def child(spec, cache_dir, timeout=1800):
        caches.append(cache_dir)
        specs.append(spec)
        construct_s = 4.0 if spec.get("weights_first") else 3.0
        return {"wall_s": 9.0, "import_s": 1.0, "construct_s": construct_s, "weights_s": 0.5,
                "engine": {"fresh": 0, "cache_hits": 3}, "warmup": {"warmup_s": 1.0},
                "process": {"fresh": 0, "fresh_names": []}}  # fmt: skip

    monkeypatch.setattr(startup, "run_child", child)
    out = startup.construct(startup.PRESETS["tiny"], "tiny-random-llama", repeats=2)
    assert len(set(caches)) == 1 and len(specs) == 6
    assert [s.get("weights_first", False) for s in specs[2:]] == [True, False, False, True]
    assert out["restart"]["order"] == ["weights_first", "overlapped", "overlapped", "weights_first"]
    assert out["overlap_ratio"] == pytest.approx(0.75)


def test_server_experiment_alternates_restarts_on_the_cold_off_processes_cache(monkeypatch, capsys):
    """Experiment 6 (bench/_startup_server.py) without its processes: the cold "off" process
    fills the folder the restarts share, the cold "on" one gets an empty one, the restarts
    alternate (off, on, on, off), the ratios are on over off, and the tokens must agree."""
    import _startup_server as server

    specs, caches = [], []

    def child(spec, cache_dir, timeout=1800):
        specs.append(spec)
        caches.append(cache_dir)
        first = 2.0 if spec["gate"] else 8.0
        requests = [{"tokens": [5, 6], "latency_s": 0.1}, {"tokens": [7], "latency_s": 3.0}]
        return {"wall_s": 20.0, "construct_s": first - 1.0, "spawn": 100.0,
                "times": {"first_token": 100.0 + first}, "warmup_done_s": 30.0,
                "requests": requests, "engine": {"fresh": 0}}  # fmt: skip

    out = server.server_start({"model": "m"}, child, repeats=2)
    assert [s["gate"] for s in specs] == [False, True, False, True, True, False]
    assert caches[0] != caches[1] and set(caches[2:]) == {caches[0]}  # restarts: the warm one
    assert out["order"] == ["off", "on", "on", "off"] and out["same_tokens"]
    assert out["summary"]["cold_ratio"] == out["summary"]["restart_ratio"] == pytest.approx(0.25)
    server.print_server(out)
    assert "6 a server's first token" in capsys.readouterr().out


def test_the_57m_demo_passes_the_engine_as_generate_flags():
    from jaxserve import cli

    flags = startup.model_flags({**startup.PRESETS["default"].engine, "model": "m"})
    args = cli.build_parser().parse_args(["generate", "--prompt", "a", *flags])
    engine = startup.PRESETS["default"].engine
    assert (args.model, args.engine_seed, args.max_num_seqs) == (
        "m",
        engine["seed"],
        engine["max_num_seqs"],
    )
    assert "--no-prefix-caching" not in flags  # the preset keeps prefix caching on
