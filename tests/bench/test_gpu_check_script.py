"""bench/gpu_check.sh: it parses, and on the CPU (GPU_CHECK_PLATFORM=cpu: the same stages with
tiny presets; structured outputs as bench/structured.py's smoke run) it runs every stage, writes
summary.json and prints the tables. What it
measures on a GPU is not checked here; no time is asserted.

Its end-to-end stage is bench/gpu_e2e.py's tiny preset (the suite's one run of it): the
checkpoint written with numpy (then reused) loads in jaxserve and in transformers, the cold
process fills the persistent compilation cache that the warm one loads from, every engine
generates the same lengths, and the report has the keys the summary reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_e2e  # noqa: E402

SUMMARY_KEYS = {
    "cold_start_s",
    "cold_construct_s",
    "cold_warmup_s",
    "cold_warmup_complete",
    "warmup_compilations",
    "warm_start_s",
    "warm_cache_hits",
    "attention",
    "jaxserve_output_tokens_per_s",
    "jaxserve_num_requests",
    "jaxserve_run_complete",
    "hf_output_tokens_per_s",
    "hf_num_requests",
    "hf_run_complete",
    "jaxserve_over_hf",
    "vllm_published_output_tokens_per_s",
    "jaxserve_over_vllm_published",
}


def test_gpu_check_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    proc = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_gpu_check_runs_on_cpu(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=sys.executable,
        GPU_CHECK_PLATFORM="cpu",
        GPU_CHECK_CACHE=str(tmp_path / "cache"),
        GPU_CHECK_ATTENTION_BACKENDS="xla",
    )
    proc = subprocess.run(
        [bash, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert list(stages) == [
        "probe", "kernel_tests", "attention", "structured", "checkpoint_wait", "e2e"
    ]  # fmt: skip
    assert all(s["status"] == "ok" for s in stages.values())
    counts = stages["kernel_tests"]["counts"]
    assert counts["source"] == "junit xml" and counts["total"] > 0
    assert counts["skipped"] == counts["total"]  # the gpu-marked tests, on a CPU
    assert set(stages["attention"]["backends"]) == {"xla"}
    structured = stages["structured"]
    assert [r["fraction_constrained"] for r in structured["rows"]] == [0.0, 1.0]
    assert structured["rows"][1]["constrained"] == 4  # JSON cut at 8 tokens: not valid yet
    assert structured["recompilations_after_warmup"] == 0
    assert stages["checkpoint_wait"]["checkpoint"]["bytes"] > 0
    e2e = stages["e2e"]["summary"]
    assert e2e["jaxserve_output_tokens_per_s"] > 0 and e2e["jaxserve_over_hf"] > 0
    assert not (out / "jax_compile_cache").exists()  # removed: large on a GPU
    assert "end to end" in proc.stdout and "decode attention" in proc.stdout
    assert "100% overlapped" in proc.stdout  # the structured stage's line
    _check_gpu_e2e_tiny(
        json.loads((out / "e2e_checkpoint.json").read_text()),
        json.loads((out / "e2e.json").read_text()),
    )


def _check_gpu_e2e_tiny(written: dict, report: dict) -> None:
    """The script's two gpu_e2e.py runs on the tiny preset: --checkpoint-only, then the rest
    on that checkpoint."""
    assert not written["checkpoint"]["reused"] and written["checkpoint"]["num_files"] > 1
    assert report["checkpoint"]["reused"]
    assert report["checkpoint"]["bytes"] == written["checkpoint"]["bytes"]
    assert report["complete"], report["phases"]
    assert list(report["phases"]) == ["checkpoint", "cold", "hf", "warm"]
    assert all(p["status"] == "ok" for p in report["phases"].values())

    summary = report["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert summary["vllm_published_output_tokens_per_s"] == 6583
    assert report["published"]["label"].startswith("published")
    assert summary["jaxserve_over_hf"] == pytest.approx(
        summary["jaxserve_output_tokens_per_s"] / summary["hf_output_tokens_per_s"]
    )

    preset = gpu_e2e.PRESETS["tiny"]
    dataset = report["dataset"]
    cold = report["results"]["cold"]
    assert cold["warmup_complete"] and cold["warmup_compilations"] > 0
    assert len(cold["buckets"]) == cold["num_buckets"]
    run = cold["run"]
    assert run["complete"] and run["num_requests"] == preset.num_requests
    assert run["num_output_tokens"] == dataset["num_output_tokens"]  # ignore_eos: exact
    assert run["compilations_during_run"] == 0
    assert cold["stats"]["plan"]["dtype"] == preset.dtype

    hf = report["results"]["hf"]["run"]
    assert hf["complete"] and hf["num_requests"] == preset.hf_num_requests
    assert hf["num_generated_tokens"] >= hf["num_output_tokens"] > 0

    warm = report["results"]["warm"]
    assert warm["warmup_complete"] and warm["warmup_cache_hits"] > 0  # the cold run's cache
    assert warm["check_generate"]["num_output_tokens"] > 0
