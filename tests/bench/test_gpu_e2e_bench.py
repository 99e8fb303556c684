"""bench/gpu_e2e.py's Llama-3-8B layout against what jaxserve and transformers expect, without
writing its 16 GB. Its tiny preset runs end to end inside bench/gpu_check.sh's CPU run, and
tests/bench/test_gpu_check_script.py checks that report."""

from __future__ import annotations

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

import _gpu_e2e_checkpoint  # noqa: E402
import gpu_e2e  # noqa: E402


def test_llama3_8b_layout_is_what_jaxserve_and_transformers_load():
    import torch
    import transformers

    from jaxserve.checkpoints_tools.hf_names import hf_tensor_specs
    from jaxserve.models import arch_config_from_hf

    cfg = gpu_e2e.PRESETS["llama3-8b"].model
    shapes = dict(_gpu_e2e_checkpoint.tensor_shapes(cfg))
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
    bits = _gpu_e2e_checkpoint.bf16_pool(10001, 0.02, seed=3)
    x = np.random.default_rng(3).standard_normal(10001, dtype=np.float32) * np.float32(0.02)
    assert np.array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
