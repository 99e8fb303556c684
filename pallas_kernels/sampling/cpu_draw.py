"""The sampler's inverse-CDF draw as a C++ kernel for the CPU (cpu_draw.cc), built on first use
(see cpu_ffi.py) and called as an XLA FFI custom call.

XLA:CPU runs the draw over the [R, V] logits as four passes (row max, the masked exp, the
chunk sums, the cumulative sums), each from memory; the kernel reads each row from memory once
and once more from cache. When it cannot be built (or
JAXSERVE_CPU_KERNEL=0), `available()` is False and the sampler keeps its XLA draw.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.cpu_ffi import CpuKernel

KERNEL = CpuKernel(
    Path(__file__).with_name("cpu_draw.cc"),
    symbol="JaxserveSamplerCpuDraw",
    target="jaxserve_sampler_cpu_draw",
)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return KERNEL.available()


def cpu_draw(
    x: jax.Array,  # f32[R, V]
    uniform: jax.Array,  # f32[R] in [0, 1)
    inv_t: jax.Array,  # f32[R]
    floor_offset: jax.Array,  # f32[R]
    threshold: jax.Array,  # f32[R]
) -> jax.Array:  # i32[R]
    """One token per row from softmax(x * inv_t) over the tokens with
    x >= max(max(x) + floor_offset, threshold), drawn by inverting its CDF at `uniform` (the
    sampler's _draw, on the CPU only).

    Raises:
        RuntimeError: the kernel is not available.
    """
    KERNEL.require()
    f32 = jnp.float32
    call = jax.ffi.ffi_call(KERNEL.target, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))
    return call(
        x.astype(f32), uniform.astype(f32), inv_t.astype(f32), floor_offset.astype(f32),
        threshold.astype(f32),
    )  # fmt: skip
