"""Bad inputs to the kernels and the dispatcher raise ValueError naming the argument, the value
and the limit, at trace time (before anything compiles)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest
import rpa_cases as cases

from jaxserve.pallas_kernels.ragged_paged_attention import (
    GpuConfig,
    TpuConfig,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)

KERNELS = {
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
}
SHAPE = cases.SHAPES[1]  # H64-G4-P32: N=8, K=2


def _args() -> list:
    return list(cases.make_inputs(SHAPE, cases.batch("mixed", SHAPE.page_size)))


def _replace(index: int, value) -> list:
    args = _args()
    args[index] = value
    return args


BAD_INPUTS = [
    ("q-rank", lambda: _replace(0, jnp.zeros((32, 8 * 64)))),
    ("v-shape", lambda: _replace(2, jnp.zeros((2, 4, 32, 64)))),
    ("kv-dtype", lambda: _replace(2, _args()[2].astype(jnp.bfloat16))),
    ("head-dim", lambda: _replace(0, jnp.zeros((32, 8, 128)))),
    ("gqa", lambda: _replace(0, jnp.zeros((32, 7, 64)))),
    ("kv_lens-shape", lambda: _replace(3, jnp.zeros((7,), jnp.int32))),
    ("block_tables-dtype", lambda: _replace(4, _args()[4].astype(jnp.int16))),
    ("cu_q_lens-shape", lambda: _replace(5, jnp.zeros((8,), jnp.int32))),
    ("num_seqs-shape", lambda: _replace(6, jnp.zeros((2,), jnp.int32))),
]
MESSAGES = {
    "q-rank": r"q must be \[T, N, H\], got shape \(32, 512\)",
    "v-shape": r"v_pages shape \(2, 4, 32, 64\) must equal k_pages shape",
    "kv-dtype": r"v_pages dtype bfloat16 must equal k_pages dtype float32",
    "head-dim": r"k_pages head dim 64 must equal q head dim 128",
    "gqa": r"q heads N=7 must be a multiple of kv heads K=2",
    "kv_lens-shape": r"kv_lens must have shape \(8,\), got \(7,\)",
    "block_tables-dtype": r"block_tables must be int32, got int16",
    "cu_q_lens-shape": r"cu_q_lens must have shape \(9,\), got \(8,\)",
    "num_seqs-shape": r"num_seqs must have shape \(1,\), got \(2,\)",
}


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize(("case", "make_args"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_arrays_raise(kernel_name: str, case: str, make_args) -> None:
    with pytest.raises(ValueError, match=MESSAGES[case]):
        KERNELS[kernel_name](*make_args(), sm_scale=0.125)


BAD_OPTIONS = [
    (dict(sm_scale=0.0), r"sm_scale must be > 0, got 0.0"),
    (dict(sm_scale=0.1, sliding_window=0), r"sliding_window must be None or >= 1, got 0"),
    (dict(sm_scale=0.1, soft_cap=-1.0), r"soft_cap must be None or > 0, got -1.0"),
]


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_raise(kernel_name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel_name](*_args(), **options)


def test_gpu_tiling_limits() -> None:
    with pytest.raises(ValueError, match="kv_tile must be a power of two >= 16, got 24"):
        ragged_paged_attention_gpu(*_args(), sm_scale=0.1, kv_tile=24, interpret=True)
    with pytest.raises(ValueError, match="kv_tile 16 must be a multiple of page size P=32"):
        ragged_paged_attention_gpu(*_args(), sm_scale=0.1, kv_tile=16, interpret=True)
    with pytest.raises(ValueError, match=r"= 8 query rows per tile must be >= 16 \(block_q=2\)"):
        ragged_paged_attention_gpu(*_args(), sm_scale=0.1, block_q=2, interpret=True)
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1, got 0"):
        GpuConfig(block_q=4, kv_tile=32, num_kv_splits=0)


def test_tpu_tiling_limits() -> None:
    with pytest.raises(ValueError, match=r"= 12 query rows per tile must be a multiple of 16"):
        ragged_paged_attention_tpu(*_args(), sm_scale=0.1, block_q=3, interpret=True)
    with pytest.raises(ValueError, match="pages_per_tile must be >= 1, got 0"):
        TpuConfig(block_q=4, pages_per_tile=0)


def test_unknown_backend_raises() -> None:
    with pytest.raises(
        ValueError, match=r"attention_backend must be 'auto' or one of .*got 'triton'"
    ):
        ragged_paged_attention(*_args(), sm_scale=0.1, backend="triton")
