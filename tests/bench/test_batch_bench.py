"""Smoke test of bench/batch.py on its tiny preset: LLM.generate, `jaxserve run-batch` and
`jaxserve generate --output`, each in its own process, on a dozen short requests (Ray off).

Checks the report's structure and that the paths agree token for token (greedy), never a
time or a ratio of times. Warm-up is off (each process compiles or loads the shapes it uses
from a fresh cache folder) to keep it quick.
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

import batch  # noqa: E402


def test_tiny_preset_paths_agree(tmp_path):
    out = tmp_path / "batch.json"
    report = batch.main(
        [
            "--preset",
            "tiny",
            "--no-warmup",
            "--cache",
            str(tmp_path / "cache"),
            "--output",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["preset"] == "tiny"
    assert report["machine"]["cpus"] >= 1
    assert report["engine"]["max_model_len"] == 128
    assert report["order"] == ["generate", "run-batch", "generate-cli"]
    num_requests = report["dataset"]["num_requests"]
    assert num_requests == 12
    expected = report["expected_output_tokens"]
    assert expected == report["dataset"]["num_output_tokens"] > 0

    paths = report["paths"]
    assert set(paths) == {"generate", "run-batch", "generate-cli"}
    for name, p in paths.items():
        assert "failed" not in p, (name, p)
        assert p["output_tokens"] == expected  # ignore_eos: every path does the same work
        assert p["elapsed_s"] > 0 and p["output_tokens_per_s"] > 0
        assert p["x_generate"] > 0
        assert p["timed"]
    assert paths["generate"]["x_generate"] == 1.0
    assert paths["run-batch"]["summary_line"].startswith(f"output tokens: {expected} in ")
    assert paths["run-batch"]["summary"]["succeeded"] == num_requests
    assert paths["generate-cli"]["summary_line"].startswith("elapsed:")

    tokens = report["token_ids"]
    assert tokens["reference"] == "generate"
    for name in ("run-batch", "generate-cli"):
        assert tokens["paths"][name]["num_requests"] == num_requests
        assert tokens["paths"][name]["mismatched_requests"] == 0, tokens["paths"][name]
        assert paths[name]["token_id_mismatches"] == 0

    assert "skipped" in report["ray"]  # off in the tiny preset unless --ray
    goals = {g["goal"]: g for g in report["goals"]}
    assert len(goals) == 2
    for g in goals.values():
        assert {"goal", "target", "measured", "holds"} <= set(g)
        assert g["measured"] is not None
    token_goal = next(g for text, g in goals.items() if "token ids" in text)
    assert token_goal["measured"] == 0 and token_goal["holds"]
    assert report["notes"]
