"""The GPU attention kernels and a tiny engine compiled by the real XLA:GPU, Mosaic GPU and
Triton compilers for GPUs that are not here (jax's CUDA plugin, deviceless, from each
target's GpuTargetConfig): Mosaic GPU and Triton for an H100 (sm_90), Triton for an A100
(sm_80). Skipped without the CUDA compiler (``pip install "jaxserve[cuda12]"``, ~5 GB)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot_compilers import compile_only_devices, require_compiler
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tiny_config import write_tiny_llama

from jaxserve.aot.gpu_target_config import gpu_target_config
from jaxserve.aot.targets import chip_facts, get_target
from jaxserve.cli import main
from jaxserve.pallas_kernels.ragged_paged_attention import (
    Target,
    ragged_paged_attention_gpu,
    select_attention,
)
from jaxserve.pallas_kernels.ragged_paged_attention.kernels import mosaic_gpu_kernel

# (T, N, K, H, P, dtype): Llama-3-8B-like decode and a 2048-token prefill chunk
SHAPES = {
    "decode": (64, 32, 8, 128, 16, jnp.bfloat16),
    "prefill-2048": (2048, 32, 8, 128, 16, jnp.bfloat16),
}


def test_the_target_config_carries_the_table() -> None:
    text = gpu_target_config(get_target("h100"))
    assert "core_count: 132\n" in text and "major: 9\n    minor: 0" in text
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    with pytest.raises(ValueError, match="needs a GPU target"):
        gpu_target_config(get_target("v6e-1"))


def _specs(mesh, num_tokens, n, k, h, page_size, dtype, kv_dtype=None):
    rows, width, num_pages = 64, 256, 4096
    sharding = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    pages = spec((k, num_pages, page_size, h), kv_dtype or dtype)
    i32 = functools.partial(spec, dt=jnp.int32)
    q = spec((num_tokens, n, h), dtype)
    return (q, pages, pages, i32((rows,)), i32((rows, width)), i32((rows + 1,)), i32((1,)))


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize(
    ("target_name", "kernel"), [("h100", "mosaic_gpu"), ("h100", "triton"), ("a100-80g", "triton")]
)
def test_gpu_kernels_compile_for_their_targets(target_name, kernel, shape) -> None:
    require_compiler(target_name)
    entry = mosaic_gpu_kernel() if kernel == "mosaic_gpu" else ragged_paged_attention_gpu
    if entry is None:
        pytest.skip("this jax has no Pallas Mosaic GPU backend")
    mesh = Mesh(np.array(compile_only_devices(target_name, 1)), ("x",))
    fn = jax.jit(functools.partial(entry, sm_scale=0.1))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = fn.lower(*_specs(mesh, *SHAPES[shape]))
    compiled = lowered.compile()
    assert compiled.out_info.shape == (SHAPES[shape][0], 32, 128)


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_triton_float32_compiles_in_either_precision(precision) -> None:
    """A float32 model's attention: TF32 tile products by default, IEEE ones under
    jax.default_matmul_precision("highest") (gpu_kernel._dot_precision); both compile."""
    require_compiler("h100")
    mesh = Mesh(np.array(compile_only_devices("h100", 1)), ("x",))
    fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1))
    with (
        jax.default_matmul_precision(precision),
        jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
    ):
        compiled = fn.lower(*_specs(mesh, 64, 32, 8, 128, 16, jnp.float32)).compile()
    assert compiled.out_info.dtype == jnp.float32


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_triton_reads_fp8_pages_on_an_a100(kv_dtype) -> None:
    """sm_80 has no e4m3 conversion (XLA's Triton pipeline aborts the process on one): the
    kernel the registry picks there from the target's facts converts e4m3 bytes itself."""
    require_compiler("a100-80g")
    facts = chip_facts(get_target("a100-80g"))
    target = Target(dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128,
                    page_size=16, kv_cache_dtype=kv_dtype, **facts)  # fmt: skip
    impl, _ = select_attention("auto", target)
    assert impl.name == "pallas_triton" and impl.soft_fp8 is (kv_dtype == "float8_e4m3fn")
    mesh = Mesh(np.array(compile_only_devices("a100-80g", 1)), ("x",))
    fn = jax.jit(functools.partial(impl, sm_scale=0.1))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = fn.lower(*_specs(mesh, *SHAPES["decode"], kv_dtype=jnp.dtype(kv_dtype)))
    assert lowered.compile().out_info.shape == (64, 32, 128)


@pytest.mark.parametrize("target_name", ["h100", "a100-80g"])
def test_a_tiny_engine_compiles_for_a_gpu(tmp_path, capsys, target_name) -> None:
    require_compiler(target_name)
    out = tmp_path / "report.json"
    engine = ["--max-num-seqs", "8", "--max-num-batched-tokens", "8", "--max-model-len", "256"]
    rc = main(["compile", "--model", write_tiny_llama(tmp_path / "m"), "--target", target_name,
               *engine, "--token-buckets", "8", "--json", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["plan"]["platform"] == "gpu" and report["plan"]["dtype"] == "bfloat16"
    assert report["plan"]["attention"] in ("pallas_mosaic_gpu", "pallas_triton")
    assert all(b["ok"] for b in report["buckets"]) and report["totals"]["kv_aliased"]
    assert report["predicted"]["decode"]["tokens_per_s"] > 0


def test_a_tiny_engine_with_fp8_kv_compiles_for_an_a100(tmp_path, capsys) -> None:
    """Every bucket of an FP8 (e4m3) KV engine for sm_80: the step's attention converts the
    pages with integer ops there (this compile aborted the process before)."""
    require_compiler("a100-80g")
    out = tmp_path / "report.json"
    engine = ["--max-num-seqs", "8", "--max-num-batched-tokens", "8", "--max-model-len", "256",
              "--kv-cache-dtype", "fp8"]  # fmt: skip
    rc = main(["compile", "--model", write_tiny_llama(tmp_path / "m"), "--target", "a100-80g",
               *engine, "--token-buckets", "8", "--json", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    report = json.loads(out.read_text())
    # each compilation named on stderr before it starts: all that a fatal compiler error
    # (this one's, before the fix: "LLVM Fatal Error while compiling Triton kernel") leaves
    announced = [line for line in err.splitlines() if line.startswith("compiling ")]
    assert announced == [f"compiling {b['label']}" for b in report["buckets"]]
    plan = report["plan"]
    assert plan["kv_cache_dtype"] == "float8_e4m3fn" and plan["attention"] == "pallas_triton"
    assert plan["attention_soft_fp8"] is True
    assert all(b["ok"] for b in report["buckets"]) and report["totals"]["kv_aliased"]
