"""bench/gpu_check.sh: it parses, and on the CPU (GPU_CHECK_PLATFORM=cpu: the same stages with
tiny presets) it runs every stage, writes summary.json and prints the tables. What it
measures on a GPU is not checked here; no time is asserted."""

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
    assert list(stages) == ["probe", "kernel_tests", "attention", "checkpoint_wait", "e2e"]
    assert all(s["status"] == "ok" for s in stages.values())
    counts = stages["kernel_tests"]["counts"]
    assert counts["source"] == "junit xml" and counts["total"] > 0
    assert counts["skipped"] == counts["total"]  # the gpu-marked tests, on a CPU
    assert set(stages["attention"]["backends"]) == {"xla"}
    assert stages["checkpoint_wait"]["checkpoint"]["bytes"] > 0
    e2e = stages["e2e"]["summary"]
    assert e2e["jaxserve_output_tokens_per_s"] > 0 and e2e["jaxserve_over_hf"] > 0
    assert not (out / "jax_compile_cache").exists()  # removed: large on a GPU
    assert "end to end" in proc.stdout and "decode attention" in proc.stdout
