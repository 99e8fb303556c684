"""The kernels lower for their real targets from this CPU-only machine: the GPU kernel through
Triton for CUDA, the TPU kernel through Mosaic for a TPU v5e. jax.export runs the whole Pallas
lowering (kernel jaxpr -> Triton IR / Mosaic MLIR), so unsupported ops, shapes or indexing fail
here; only the final device compilers (Triton -> PTX, Mosaic layout passes) stay untested."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def triton_modules_verified(monkeypatch) -> list[bool]:
    """Run the MLIR verifier on every Triton module the lowering builds (it is not run by the
    lowering itself: an ill-typed module would otherwise only fail in XLA's Triton compiler on
    a GPU). Private API, so the check is skipped where the hook is gone."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    lower = getattr(registration.lowering, "lower_jaxpr_to_triton_module", None)
    if lower is None:
        pytest.skip("this jax has no Triton lowering hook to verify")
    results: list[bool] = []

    def lower_and_verify(*args, **kwargs):
        lowered = lower(*args, **kwargs)
        results.append(bool(lowered.module.operation.verify()))
        return lowered

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return results


def _specs(
    num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=None, num_slots=8
):
    """Argument specs; kv_dtype: the pages' dtype when not q's (an FP8 KV cache)."""
    width, num_pages = 64, 256
    pool = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), kv_dtype or dtype)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return (
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
        pool,
        pool,
        i32((num_slots,)),
        i32((num_slots, width)),
        i32((num_slots + 1,)),
        i32((1,)),
    )


def _target(device_kind: str, platform: str) -> jax.sharding.AbstractMesh:
    """A one-device abstract mesh of the target chip: the Triton (jax >= 0.11) and Mosaic
    lowerings read the chip from it when no such device is attached."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


# (id, q/kv shapes (T, N, K, H, P, dtype), kernel options)
GPU_CASES = [
    ("decode-bf16-splits", (8, 32, 8, 128, 16, jnp.bfloat16), {}),
    ("prefill-bf16", (512, 32, 8, 128, 16, jnp.bfloat16), {}),
    (
        "window-softcap-f32",
        (64, 16, 2, 64, 32, jnp.float32),
        dict(sliding_window=64, soft_cap=30.0),
    ),
    ("gqa7-padded-heads", (64, 28, 4, 128, 16, jnp.bfloat16), dict(num_kv_splits=4)),
    ("mha", (128, 8, 8, 64, 16, jnp.float16), dict(block_q=16, kv_tile=64)),
    ("decode-bf16-fp8-e4m3-pages", (8, 32, 8, 128, 16, jnp.bfloat16, jnp.float8_e4m3fn), {}),
    ("prefill-bf16-fp8-e5m2-pages", (512, 32, 8, 128, 16, jnp.bfloat16, jnp.float8_e5m2), {}),
    (  # e4m3 bytes converted with integer ops, as below sm_89 (kv_quant.e4m3fn_from_bits)
        "decode-bf16-fp8-e4m3-bytes",
        (8, 32, 8, 128, 16, jnp.bfloat16, jnp.float8_e4m3fn),
        dict(soft_fp8=True),
    ),
]


@pytest.mark.parametrize(
    ("shapes", "options"), [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES]
)
def test_gpu_kernel_lowers_to_triton_for_cuda(shapes, options, triton_modules_verified) -> None:
    fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1, **options))
    with jax.sharding.use_abstract_mesh(_target("NVIDIA H200", "gpu")):
        exported = jax.export.export(
            fn,
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*_specs(*shapes))
    module = exported.mlir_module()
    assert TRITON_CALL in module and "ragged_paged_attention_gpu" in module
    assert triton_modules_verified == [True]
    assert exported.out_avals[0].shape == (shapes[0], shapes[1], shapes[3])


def test_gpu_kernel_rejects_head_dim_triton_cannot_tile() -> None:
    fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=0.1))
    with pytest.raises(ValueError, match="head dim H must be a power of two >= 16, got 96"):
        with jax.sharding.use_abstract_mesh(_target("NVIDIA H200", "gpu")):
            jax.export.export(fn, platforms=["cuda"])(*_specs(16, 8, 2, 96, 16, jnp.bfloat16))


TPU_CASES = [
    ("decode-bf16", (8, 32, 8, 128, 16, jnp.bfloat16), {}),
    ("prefill-bf16", (512, 32, 8, 128, 16, jnp.bfloat16), {}),
    (
        "window-softcap-f32-g8",
        (64, 64, 8, 128, 32, jnp.float32),
        dict(sliding_window=64, soft_cap=30.0),
    ),
    ("small-tiles-mha", (64, 8, 8, 128, 16, jnp.bfloat16), dict(block_q=16, pages_per_tile=1)),
    ("decode-bf16-fp8-e4m3-pages", (8, 32, 8, 128, 16, jnp.bfloat16, jnp.float8_e4m3fn), {}),
]


@pytest.mark.parametrize(
    ("shapes", "options"), [c[1:] for c in TPU_CASES], ids=[c[0] for c in TPU_CASES]
)
def test_tpu_kernel_lowers_to_mosaic_for_tpu(shapes, options) -> None:
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=0.1, **options))
    with jax.sharding.use_abstract_mesh(_target("TPU v5 lite", "tpu")):
        exported = jax.export.export(fn, platforms=["tpu"])(*_specs(*shapes))
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (shapes[0], shapes[1], shapes[3])
