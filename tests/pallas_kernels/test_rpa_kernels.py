"""Every Pallas ragged paged attention kernel against the jnp reference on the shared grid, in
interpret mode (CPU)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import rpa_cases as cases

from jaxserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention_chunked,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)

KERNELS = {
    # Default tuning: on the grid's P=32 shapes this already splits the KV range in two.
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
    # Not Pallas kernels: the chunked XLA backend, and with its row pass in C++ (the CPU
    # default; f32 only) share the grid.
    "xla": ragged_paged_attention_chunked,
    "cpu": functools.partial(ragged_paged_attention_chunked, row_kernel="cpu"),
}
# Small tiles: many query blocks and KV tiles per sequence (GPU: three flash-decoding splits,
# one page per tile; TPU: one page per DMA step, so double buffering alternates within a
# sequence, and the smallest legal query block).
SMALL_TILE_KERNELS = {
    "gpu-small": lambda shape: functools.partial(
        ragged_paged_attention_gpu, interpret=True, kv_tile=shape.page_size, num_kv_splits=3
    ),
    "xla-small": lambda shape: functools.partial(ragged_paged_attention_chunked, pages_per_chunk=1),
    # Tiles of 2 rows: most prefill rows go to tiles, remainders of 1 to the C++ rows.
    "cpu-small": lambda shape: functools.partial(
        ragged_paged_attention_chunked, row_kernel="cpu", tile_rows=2, tile_pages_per_chunk=1
    ),
    "tpu-small": lambda shape: functools.partial(
        ragged_paged_attention_tpu, interpret=True, pages_per_tile=1, block_q=16 // shape.group
    ),
}


def _check(kernel, shape: cases.Shape, kind: str, options: dict) -> None:
    options = dict(options)
    dtype = options.pop("dtype", jnp.float32)
    args = cases.make_inputs(shape, cases.batch(kind, shape.page_size), dtype)
    want = ragged_paged_attention_reference(*args, sm_scale=cases.sm_scale(shape), **options)
    got = cases.compiled(kernel, shape, dtype, tuple(sorted(options.items())))(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = cases.TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )
    padding_rows = np.asarray(got[int(args[5][-1]) :], np.float32)
    assert padding_rows.size and not padding_rows.any(), "padding rows must be zero"


_GRID = cases.grid_cases()
# One xdist worker for the module: rpa_cases.compiled keeps each kernel's compilation for the
# cases after it (the batch kinds of a shape share one), which a second worker would redo.
pytestmark = pytest.mark.xdist_group("rpa_kernels")


def _tiered(names) -> list:
    """Kernel names as parameters, the Pallas ones (interpret mode: seconds a case) in the slow
    tier; test_token_count_not_a_multiple_of_the_query_block keeps them in the fast one."""
    pallas = ("gpu", "tpu")
    return [
        pytest.param(n, marks=pytest.mark.slow) if n.split("-")[0] in pallas else n
        for n in sorted(names)
    ]


@pytest.mark.slow  # the whole grid; the fast tier runs test_small_tiles_match_reference
@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize(
    ("shape", "kind", "options"), [c[1:] for c in _GRID], ids=[c[0] for c in _GRID]
)
def test_kernel_matches_reference(kernel_name: str, shape, kind: str, options: dict) -> None:
    if kernel_name == "cpu" and options.get("dtype", jnp.float32) != jnp.float32:
        pytest.skip("the C++ row kernel takes f32 only (the cpu backend runs xla otherwise)")
    _check(KERNELS[kernel_name], shape, kind, options)


@pytest.mark.parametrize("kernel_name", _tiered(SMALL_TILE_KERNELS))
@pytest.mark.parametrize("shape", cases.SHAPES, ids=[s.id for s in cases.SHAPES])
def test_small_tiles_match_reference(kernel_name: str, shape) -> None:
    _check(SMALL_TILE_KERNELS[kernel_name](shape), shape, "mixed", {})


@pytest.mark.parametrize("kernel_name", ["gpu", "tpu"])  # the Pallas kernels' query blocks
def test_token_count_not_a_multiple_of_the_query_block(kernel_name: str) -> None:
    """T = 19 rows (17 real): the last query block is partial and reads past q's end."""
    shape = cases.SHAPES[0]
    args = cases.make_inputs(shape, cases.batch("mixed", shape.page_size), num_tokens=19)
    scale = cases.sm_scale(shape)
    want = ragged_paged_attention_reference(*args, sm_scale=scale)
    got = KERNELS[kernel_name](*args, sm_scale=scale, block_q=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
