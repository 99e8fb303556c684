"""Smoke test of bench/attention_kernel.py on its CPU preset (no time asserted): every backend
is selected through the registry per page size, the ones that run here agree with the
reference, one the registry refuses (Mosaic GPU on a CPU) or that fails becomes an error row
instead of ending the run, and the JSON keeps a row per case."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _attention_kernel_cases  # noqa: E402
import _attention_kernel_presets  # noqa: E402
import attention_kernel  # noqa: E402


def test_cpu_smoke_every_backend_and_page_size(tmp_path):
    out = tmp_path / "a.json"
    backends = ["xla", "pallas_triton", "pallas_mosaic_gpu"]
    report = attention_kernel.main(
        [
            "--preset",
            "cpu-smoke",
            "--backends",
            ",".join(backends),
            "--page-sizes",
            "16,32",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["complete"] and report["backends"] == backends
    assert report["copy_Bps"] >= report["copy_elementwise_Bps"] > 0
    preset = attention_kernel.PRESETS["cpu-smoke"]
    per_backend = 2 * len(preset.batches) * len(preset.contexts) + len(preset.prefills)
    assert len(report["cases"]) == len(backends) * per_backend
    for row in report["cases"]:
        if row["backend"] == "pallas_mosaic_gpu":  # Hopper only: refused on a CPU
            assert row["error_stage"] == "select" and "cannot run here" in row["error"]
            continue
        assert "error" not in row, row
        assert row["impl"] == row["backend"]
        assert row["interpret"] == (row["backend"] == "pallas_triton")
        assert row["kernel_s"] > 0 and 0 < row["fraction_of_copy"]
        assert row["max_abs_err"] <= _attention_kernel_presets.TOLERANCE["float32"]
        assert not row.get("mismatch")
    decode_pages = {r["page_size"] for r in report["cases"] if r["kind"] == "decode"}
    assert decode_pages == {16, 32}
    summary = report["summary"]
    assert summary["pallas_mosaic_gpu"] == {"impl": None, "errors": per_backend, "decode": {}}
    for name in ("xla", "pallas_triton"):
        assert summary[name]["errors"] == 0
        assert set(summary[name]["decode"]) == {"16", "32"}


def test_a_kernel_that_fails_is_an_error_row():
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    preset = _attention_kernel_presets.PRESETS["cpu-smoke"]
    row = _attention_kernel_cases.run_case(preset, [(1, 32)] * 2, broken, 16, None)
    assert row["error_stage"] == "compile or run"
    assert row["error"] == "RuntimeError: no kernel today"
    assert "kernel_s" not in row


def test_interpret_mode_is_refused_off_the_cpu():
    preset = _attention_kernel_presets.PRESETS["h200-decode"]
    target = _attention_kernel_cases.target_for(preset, 16)
    tpu = dataclasses.replace(target, platform="tpu")  # Triton on a TPU: interpret mode only
    with pytest.raises(ValueError, match="'pallas_triton' cannot run here"):
        _attention_kernel_cases.select_backend("pallas_triton", tpu)
