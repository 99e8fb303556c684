"""The TPU attention kernel compiled by the real Mosaic TPU compiler (libtpu, deviceless) for
v5e and v6e: cases of the kernel grid compile, and a tile beyond the scoped VMEM fails at
compile time, as it would on the chip (interpret mode cannot see that). Skipped without
libtpu (``pip install "jaxserve[tpu]"``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot_compilers import compile_only_devices, require_compiler
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention_tpu

# (id, (T, N, K, H, P, dtype[, page dtype]), kernel options): Llama-3-8B-like decode and
# prefill shapes, a window + soft cap in f32, the smallest tiles, FP8 pages, head dim 64.
CASES = [
    ("decode-bf16", (64, 32, 8, 128, 16, jnp.bfloat16), {}),
    ("prefill-2048-bf16", (2048, 32, 8, 128, 16, jnp.bfloat16), {}),
    (
        "window-softcap-f32",
        (64, 64, 8, 128, 32, jnp.float32),
        dict(sliding_window=64, soft_cap=30.0),
    ),
    ("small-tiles-mha", (64, 8, 8, 128, 16, jnp.bfloat16), dict(block_q=16, pages_per_tile=1)),
    ("decode-fp8-e4m3-pages", (64, 32, 8, 128, 16, jnp.bfloat16, jnp.float8_e4m3fn), {}),
    ("head-dim-64", (64, 16, 2, 64, 16, jnp.bfloat16), {}),
]


def _specs(mesh, num_tokens, n, k, h, page_size, dtype, kv_dtype=None, width=256):
    rows, num_pages = 64, 4096
    sharding = NamedSharding(mesh, PartitionSpec())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    pages = spec((k, num_pages, page_size, h), kv_dtype or dtype)
    i32 = functools.partial(spec, dt=jnp.int32)
    return (
        spec((num_tokens, n, h), dtype),
        pages,
        pages,
        i32((rows,)),
        i32((rows, width)),
        i32((rows + 1,)),
        i32((1,)),
    )


def _compile(target_name, shapes, options, width=256):
    require_compiler(target_name)
    mesh = Mesh(np.array(compile_only_devices(target_name, 1)), ("x",))
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=0.1, **options))
    # Mosaic's lowering reads the chip from the abstract mesh (the default device is the CPU).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = fn.lower(*_specs(mesh, *shapes, width=width))
    return lowered.compile()


@pytest.mark.parametrize("target_name", ["v5e-1", "v6e-1"])
@pytest.mark.parametrize(("shapes", "options"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_tpu_kernel_compiles_with_mosaic(target_name, shapes, options) -> None:
    compiled = _compile(target_name, shapes, options)
    assert "ragged_paged_attention_tpu" in compiled.as_text()
    out = compiled.out_info
    assert out.shape == (shapes[0], shapes[1], shapes[3])


def test_a_tile_beyond_scoped_vmem_fails_at_compile_time() -> None:
    # double-buffered K and V tiles of 16 pages of 16 x 128 bf16: 512 KiB, over a 256 KiB limit
    shapes = (16, 8, 8, 128, 16, jnp.bfloat16)
    options = dict(pages_per_tile=16, vmem_limit_bytes=256 * 1024)
    with pytest.raises(Exception, match="CompileTimeScopedVmemOom"):
        _compile("v5e-1", shapes, options)
