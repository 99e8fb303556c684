"""Smoke test of bench/gpu_e2e.py on its tiny preset, on CPU (no time asserted): the checkpoint
written with numpy loads in jaxserve and in transformers, the cold process fills the
persistent compilation cache that the warm one loads from, every engine generates the same
lengths, and the report has the keys the GPU check reads. Plus the Llama-3-8B layout against
what jaxserve and transformers expect, without writing its 16 GB."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

# A benchmark run end to end: the slow tier (test_bench_datasets.py stays in the fast one).
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytest.importorskip("torch")
pytest.importorskip("transformers")

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


def test_tiny_preset_end_to_end(tmp_path):
    out = tmp_path / "out" / "e2e.json"
    cache = tmp_path / "cache"
    report = gpu_e2e.main(["--preset", "tiny", "--cache", str(cache), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert report["complete"], report["phases"]
    assert [p for p in report["phases"]] == ["checkpoint", "cold", "hf", "warm"]
    assert all(p["status"] == "ok" for p in report["phases"].values())
    assert not report["checkpoint"]["reused"] and report["checkpoint"]["num_files"] > 1

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

    # A second run reuses the checkpoint.
    again = gpu_e2e.main(
        ["--preset", "tiny", "--cache", str(cache), "--out", str(out), "--checkpoint-only"]
    )
    assert again["checkpoint"]["reused"]
    assert again["checkpoint"]["bytes"] == report["checkpoint"]["bytes"]


def test_llama3_8b_layout_is_what_jaxserve_and_transformers_load():
    import torch
    import transformers

    from jaxserve.checkpoints_tools.hf_names import hf_tensor_specs
    from jaxserve.models import arch_config_from_hf

    cfg = gpu_e2e.PRESETS["llama3-8b"].model
    shapes = dict(gpu_e2e.tensor_shapes(cfg))
    arch = arch_config_from_hf(cfg)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (
        4096,
        32,
        32,
        8,
    )
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings) == (
        14336,
        128256,
        8192,
    )
    assert {n: s.hf_shape for n, s in hf_tensor_specs(arch).items()} == shapes
    assert sum(np.prod(s) for s in shapes.values()) == pytest.approx(8.03e9, rel=1e-3)

    config = transformers.LlamaConfig(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert {n: tuple(p.shape) for n, p in model.state_dict().items()} == shapes


def test_bf16_pool_rounds_as_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = gpu_e2e._bf16_pool(10001, 0.02, seed=3)
    x = np.random.default_rng(3).standard_normal(10001, dtype=np.float32) * np.float32(0.02)
    assert np.array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
