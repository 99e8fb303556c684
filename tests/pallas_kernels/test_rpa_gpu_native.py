"""The GPU kernel compiled natively (Triton) on a GPU, against the reference on the same device:
the shared grid plus a realistic bf16 batch. Skipped without a GPU (bench/gpu_check.sh runs
them with `pytest -m gpu tests/pallas_kernels`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rpa_cases as cases

from jaxserve.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

_GRID = cases.grid_cases()


def _compare(got: jax.Array, want: jax.Array, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )


@pytest.mark.parametrize(
    ("shape", "kind", "options"), [c[1:] for c in _GRID], ids=[c[0] for c in _GRID]
)
@pytest.mark.parametrize("splits", [None, 3], ids=["default", "splits3"])
def test_native_kernel_matches_reference(shape, kind: str, options: dict, splits) -> None:
    options = dict(options)
    dtype = options.pop("dtype", jnp.float32)
    args = cases.make_inputs(shape, cases.batch(kind, shape.page_size), dtype)
    scale = cases.sm_scale(shape)
    # Full float32 products on both sides: by default the kernel's float32 dots are TF32, as
    # XLA's are (the first H100 run: ~1e-3 off an exact reference, against 1e-5 here).
    with jax.default_matmul_precision("highest"):
        want = ragged_paged_attention_reference(*args, sm_scale=scale, **options)
        got = ragged_paged_attention_gpu(*args, sm_scale=scale, num_kv_splits=splits, **options)
    _compare(got, want, cases.TOLERANCE[dtype])


def _realistic_batch(seed: int = 0):
    """bf16, 32 q heads / 8 kv heads, H=128, P=16: 60 decodes with contexts up to 2k, one 128-token
    prefill chunk after 1000 tokens of context, one fresh 64-token prompt; T=256, R=64."""
    rng = np.random.default_rng(seed)
    seqs = [(1, int(n)) for n in rng.integers(1, 2048, 60)] + [(128, 1128), (64, 64)]
    num_tokens, num_slots, page_size, width = 256, 64, 16, 128
    kv_lens = np.zeros(num_slots, np.int32)
    cu_q_lens = np.zeros(num_slots + 1, np.int32)
    tables = np.zeros((num_slots, width), np.int32)
    pages = iter(rng.permutation(np.arange(1, num_slots * width)))
    for i, (q_len, kv_len) in enumerate(seqs):
        kv_lens[i], cu_q_lens[i + 1] = kv_len, cu_q_lens[i] + q_len
        tables[i, : -(-kv_len // page_size)] = [next(pages) for _ in range(-(-kv_len // page_size))]
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    keys = jax.random.split(jax.random.key(seed), 3)
    pool = (8, num_slots * width, page_size, 128)
    return (
        jax.random.normal(keys[0], (num_tokens, 32, 128), jnp.bfloat16),
        jax.random.normal(keys[1], pool, jnp.bfloat16),
        jax.random.normal(keys[2], pool, jnp.bfloat16),
        jnp.asarray(kv_lens),
        jnp.asarray(tables),
        jnp.asarray(cu_q_lens),
        jnp.asarray([len(seqs)], jnp.int32),
    )


@pytest.mark.parametrize("options", [{}, dict(sliding_window=512, soft_cap=50.0)])
def test_native_realistic_bf16_batch(options: dict) -> None:
    args = _realistic_batch()
    want = ragged_paged_attention_reference(*args, sm_scale=128**-0.5, **options)
    got = ragged_paged_attention(*args, sm_scale=128**-0.5, backend="pallas", **options)
    _compare(got, want, 3e-2)


def test_native_decode_splits_agree() -> None:
    args = _realistic_batch(seed=1)
    run = functools.partial(ragged_paged_attention_gpu, *args, sm_scale=0.1)
    _compare(run(num_kv_splits=8), run(num_kv_splits=1), 3e-2)
