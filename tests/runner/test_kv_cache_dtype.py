"""kv_cache_dtype: the config's choices, the storage dtype, the memory planner's capacity with
1-byte pages, the per-layer scales read from a checkpoint's safetensors, and the execution
plan's attention choice for an FP8 KV cache."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.checkpoints_tools.load import load_arch
from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch
from jaxserve.config import FP8_STORAGE_DTYPES, EngineConfig, kv_cache_storage_dtype
from jaxserve.models import AttentionMetadata, get_model
from jaxserve.pallas_kernels.ragged_paged_attention import AttentionImpl, Target, cpu_rows
from jaxserve.pallas_kernels.ragged_paged_attention.kv_quant import FP8_DTYPES, quantize
from jaxserve.pallas_kernels.ragged_paged_attention.target import FP8_KV_DTYPES
from jaxserve.runner.kv_scales import kv_scales_for, read_kv_scales
from jaxserve.runner.memory_plan import plan_memory
from jaxserve.runner.memory_sizes import KV_DTYPE_SIZES
from jaxserve.runner.plan import make_plan, self_check
from jaxserve.runner.sharding import make_mesh

GIB = 1 << 30
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B's shape
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


@pytest.mark.parametrize(
    ("name", "storage"),
    [("auto", "bfloat16"), ("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
     ("fp8_e5m2", "float8_e5m2")],
)  # fmt: skip
def test_storage_dtype_of_each_choice(name: str, storage: str) -> None:
    config = EngineConfig.from_kwargs(kv_cache_dtype=name)
    assert kv_cache_storage_dtype(config.cache.kv_cache_dtype, "bfloat16") == storage


def test_the_fp8_dtype_lists_agree() -> None:
    """config.py (no jax) names the FP8 storage dtypes; the kernels, the registry and the
    memory planner list them too."""
    names = set(FP8_STORAGE_DTYPES.values())
    assert names == set(FP8_KV_DTYPES) == {d.name for d in FP8_DTYPES}
    assert all(KV_DTYPE_SIZES[name] == 1 for name in names)


@pytest.mark.parametrize("bad", ["fp16", "float8_e4m3fn", "bfloat16", None])
def test_bad_kv_cache_dtype_is_refused_naming_the_choices(bad) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs(kv_cache_dtype=bad)
    message = str(e.value)
    assert "CacheConfig.kv_cache_dtype" in message and repr(bad) in message
    assert "('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2')" in message


def test_fp8_pages_hold_twice_bf16_and_four_times_f32(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    arch = load_arch(tmp_path)
    settings = dict(
        tensor_parallel_size=1,
        block_size=16,
        max_model_len=8192,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        device_memory_bytes=141 * GIB,
        memory_utilization=0.9,
    )
    plans = {
        kv: plan_memory(arch, dtype="bfloat16", kv_cache_dtype=kv, **settings)
        for kv in ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    }
    fp8 = plans["float8_e4m3fn"]
    assert fp8.kv_bytes_per_token == 65_536  # 2 x 32 layers x 8 KV heads x 128 x 1 byte
    assert fp8.kv_scales_bytes == 2 * 4 * 32 and plans["bfloat16"].kv_scales_bytes == 0
    assert fp8.as_dict()["kv_scales_bytes"] == 256
    for name in ("float8_e4m3fn", "float8_e5m2"):
        tokens = plans[name].max_kv_tokens
        assert tokens >= 1.9 * plans["bfloat16"].max_kv_tokens
        assert tokens >= 3.8 * plans["float32"].max_kv_tokens
    # The scales are counted: the pool is what is left after weights, workspace and scales.
    left = fp8.budget_bytes - fp8.weights_bytes - fp8.workspace_bytes - fp8.kv_scales_bytes
    assert fp8.num_kv_blocks_fit == left // fp8.kv_bytes_per_block
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        plan_memory(arch, dtype="bfloat16", kv_cache_dtype="fp8", **settings)


def _write_scales(folder: pathlib.Path, scales: dict[str, float], file: str = "model.safetensors"):
    folder.mkdir(exist_ok=True)
    tensors = {name: np.asarray(value, np.float32) for name, value in scales.items()}
    tensors["model.norm.weight"] = np.ones(4, np.float32)  # a weight: skipped by the reader
    save_file(tensors, str(folder / file))


def test_checkpoint_scales_are_read_per_layer(tmp_path: pathlib.Path) -> None:
    _write_scales(
        tmp_path,
        {
            "model.layers.0.self_attn.k_scale": 0.25,
            "model.layers.0.self_attn.v_scale": [2.0],  # shape [1], as some exporters write
        },
    )
    _write_scales(
        tmp_path,
        {"model.layers.1.self_attn.k_scale": 0.5, "model.layers.1.self_attn.v_scale": 4.0},
        "model-2.safetensors",
    )
    want = np.array([[0.25, 2.0], [0.5, 4.0]], np.float32)
    np.testing.assert_array_equal(read_kv_scales(tmp_path, 2), want)
    np.testing.assert_array_equal(kv_scales_for("float8_e4m3fn", str(tmp_path), 2), want)
    assert kv_scales_for("bfloat16", str(tmp_path), 2) is None  # no FP8 cache: no scales
    with pytest.raises(ValueError, match="layer 1 >= the model's 1 layers"):
        read_kv_scales(tmp_path, 1)


def test_no_checkpoint_scales_means_ones(tmp_path: pathlib.Path) -> None:
    _write_scales(tmp_path, {})
    assert read_kv_scales(tmp_path, 3) is None
    np.testing.assert_array_equal(kv_scales_for("float8_e5m2", str(tmp_path), 3), np.ones((3, 2)))
    np.testing.assert_array_equal(kv_scales_for("float8_e5m2", None, 3), np.ones((3, 2)))


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({"model.layers.0.self_attn.k_scale": 1.0}, "not model.layers.0.self_attn.v_scale"),
        (
            {"model.layers.0.self_attn.k_scale": 0.0, "model.layers.0.self_attn.v_scale": 1.0},
            "k_scale' in .* must be > 0, got 0.0",
        ),
        (
            {"model.layers.0.self_attn.k_scale": [1.0, 2.0]},
            r"must be one finite value, got shape \(2,\)",
        ),
    ],
)
def test_bad_checkpoint_scales_are_refused(tmp_path: pathlib.Path, scales, message) -> None:
    _write_scales(tmp_path, scales)
    with pytest.raises(ValueError, match=message):
        read_kv_scales(tmp_path, 1)


def test_the_plan_picks_an_implementation_that_reads_fp8_pages() -> None:
    config = EngineConfig.from_kwargs(kv_cache_dtype="fp8_e5m2", dtype="float32")
    plan = make_plan(config, make_mesh(1), tiny_random_llama_arch(), None)
    assert plan.kv_cache_dtype == "float8_e5m2" and plan.dtype == "float32"
    assert plan.attention.name == "xla" and jax.devices()[0].platform == "cpu"
    assert any("cannot read an FP8 KV cache" in r for r in plan.attention_refused)
    with pytest.raises(ValueError, match="cpu cannot read an FP8 KV cache"):
        config = EngineConfig.from_kwargs(kv_cache_dtype="fp8", attention_backend="cpu")
        make_plan(config, make_mesh(1), tiny_random_llama_arch(), None)


def test_each_layer_quantizes_and_reads_with_its_own_scales() -> None:
    """A 20-token prompt through the model with f32 pages and with FP8 pages whose scales
    differ per layer: layer 0 sees the same K / V in both runs, so its pages must hold them
    divided by layer 0's own scales (a scale taken from another layer is off by 2x or more),
    and the final hidden states stay close (every K / V value is off by 2^-4 relatively at
    most)."""
    arch = tiny_random_llama_arch()
    model = get_model(arch, dtype=jnp.float32)
    params = model.init_params(jax.random.key(0))
    num_tokens, page_size = 20, 16
    positions = np.arange(num_tokens, dtype=np.int32)
    md = AttentionMetadata(
        positions=positions,
        slot_mapping=page_size + positions,  # pages 1 and 2
        block_tables=np.array([[1, 2]], np.int32),
        kv_lens=np.array([num_tokens], np.int32),
        cu_q_lens=np.array([0, num_tokens], np.int32),
        num_seqs=np.array([1], np.int32),
    )
    ids = (positions * 37 + 5) % arch.vocab_size
    shape = model.kv_cache_shape(4, page_size)
    pages = lambda dtype: [(jnp.zeros(shape, dtype),) * 2 for _ in range(arch.num_layers)]
    scales = np.array([[0.5, 2.0], [0.25, 4.0], [2.0, 0.5], [1.0, 1.0]], np.float32)
    assert arch.num_layers == len(scales)
    forward = jax.jit(model.forward)
    kv32, hidden32 = forward(params, pages(jnp.float32), ids, md)
    fp8 = dataclasses.replace(md, kv_scales=scales)
    kv8, hidden8 = forward(params, pages(jnp.float8_e4m3fn), ids, fp8)
    for which in (0, 1):  # K, V of layer 0
        want = np.asarray(quantize(kv32[0][which], scales[0, which], jnp.float8_e4m3fn), np.float32)
        got = np.asarray(kv8[0][which], np.float32)
        # One FP8 step at most (an f32 rounding difference can cross a rounding boundary).
        assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-3 + 2.0**-9)
    # RMS relative error of the final hidden states: 0.078 measured (bfloat16 pages: 0.0048,
    # 2^4 times less, as their 4 more mantissa bits predict).
    diff = hidden8 - hidden32
    err = float(jnp.sqrt(jnp.mean(diff**2) / jnp.mean(hidden32**2)))
    assert 0 < err < 0.15, err


def test_the_self_check_runs_a_kernel_on_fp8_pages() -> None:
    """The plan's once-per-process check feeds FP8 pages (and scales) to the kernel: one that
    cannot read them fails it, and the plan would fall back (or raise when strict)."""
    target = Target(
        platform="cpu",
        dtype="float32",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        kv_cache_dtype="float8_e4m3fn",
    )
    error = self_check(AttentionImpl("cpu", "cpu"), target)
    assert error is not None and 'row_kernel="cpu" needs float32 q and pages' in error
    f32_pages = dataclasses.replace(target, kv_cache_dtype=None)
    if cpu_rows.available():
        assert self_check(AttentionImpl("cpu", "cpu"), f32_pages) is None


@pytest.mark.slow
def test_an_fp8_kv_checkpoint_loads_and_its_scales_reach_the_engine(tmp_path: pathlib.Path):
    """llm-compressor's FP8-KV checkpoints carry self_attn.k_scale / v_scale beside the weights:
    the weight loader passes over them and the engine runs with them."""
    from safetensors.numpy import load_file

    from jaxserve import LLM, SamplingParams
    from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint

    folder = write_tiny_hf_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=2)
    weights = load_file(str(folder / "model.safetensors"))
    scales = {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25}
    scales |= {"model.layers.1.self_attn.k_scale": 2.0, "model.layers.1.self_attn.v_scale": 1.5}
    weights |= {name: np.asarray(value, np.float32) for name, value in scales.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = dict(num_kv_blocks=32, block_size=8, max_model_len=64, warmup=False)
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="fp8", **engine)
    want = np.array([[0.5, 0.25], [2.0, 1.5]], np.float32)
    np.testing.assert_array_equal(llm.engine.runner.kv_scales, want)
    out = llm.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    plain = LLM(str(folder), dtype="float32", **engine)  # an auto cache loads the same folder
    assert plain.engine.runner.kv_scales is None
