"""The host KV tier's copies (runner/kv_offload.py): blocks come back bit-identical in every
page dtype, a step's device->host copies read the pages before its host->device copies write
them, counts above the largest bucket go in chunks, and after warm-up nothing compiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.kv_offload import GIB, KVOffloader, host_kv_blocks
from jaxserve.runner.step_compiles import compile_concurrently

L, K, S, P, H = 2, 2, 8, 4, 8


def _pages(dtype: str, seed: int = 0) -> list[tuple[jnp.ndarray, jnp.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        tuple(jnp.asarray(rng.standard_normal((K, S, P, H)) * 3, dtype) for _ in range(2))
        for _ in range(L)
    ]


def _bits(pages) -> list[np.ndarray]:
    return [np.asarray(x).view(np.uint8) for layer in pages for x in layer]


def _block(bits: list[np.ndarray], block: int) -> list[np.ndarray]:
    return [b[:, block] for b in bits]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_restored_blocks_are_bit_identical(dtype: str) -> None:
    pages = _pages(dtype)
    before = _bits(pages)
    off = KVOffloader(L, (K, S, P, H), jnp.dtype(dtype), num_host_blocks=4, max_copy_bucket=2)
    assert off.block_bytes == L * 2 * K * P * H * jnp.dtype(dtype).itemsize
    # Three copies with a largest bucket of 2: two chunks each way.
    pages = off.apply(pages, [(3, 0), (5, 1), (1, 2)], [])
    assert [np.array_equal(a, b) for a, b in zip(_bits(pages), before, strict=True)] == [True] * 4
    # In one call, block 4 is offloaded into slot 3 and then overwritten from slot 0.
    pages = off.apply(pages, [(4, 3)], [(0, 6), (1, 7), (2, 2), (0, 4)])
    after = _bits(pages)
    for dst, src in ((6, 3), (7, 5), (2, 1), (4, 3)):
        for a, b in zip(_block(after, dst), _block(before, src), strict=True):
            assert np.array_equal(a, b), (dst, src)
    for untouched in (0, 1, 3, 5):
        for a, b in zip(_block(after, untouched), _block(before, untouched), strict=True):
            assert np.array_equal(a, b), untouched
    pages = off.apply(pages, [], [(3, 5)])  # slot 3 held block 4's contents before the restore
    for a, b in zip(_block(_bits(pages), 5), _block(before, 4), strict=True):
        assert np.array_equal(a, b)
    assert (off.num_device_to_host, off.num_host_to_device) == (4, 5)


def test_nothing_compiles_after_warmup() -> None:
    pages = _pages("float32", seed=1)
    off = KVOffloader(L, (K, S, P, H), jnp.float32, num_host_blocks=8, max_copy_bucket=4)
    compile_concurrently(off.compilations(pages), workers=1)
    assert off.compiles.num_fresh + off.compiles.num_cache_hits == 2 * len(off.copy_sizes) == 6
    off.compiles.warmed_up = True
    for n in (1, 2, 3, 4, 7):
        pages = off.apply(pages, [(b, b) for b in range(1, n + 1)], [(0, b) for b in range(n)])
    assert off.compiles.events == []


def test_measure_bandwidth_touches_only_the_null_block() -> None:
    pages = _pages("float32", seed=2)
    before = _bits(pages)
    off = KVOffloader(L, (K, S, P, H), jnp.float32, num_host_blocks=5, max_copy_bucket=8)
    pages, bytes_per_s, latency_s = off.measure_bandwidth(pages, repeats=2)
    assert bytes_per_s > 0 and latency_s >= 0
    for a, b in zip(_bits(pages), before, strict=True):
        assert np.array_equal(a, b)  # block 0 went down and came back the same
    assert (off.num_device_to_host, off.num_host_to_device) == (0, 0)


def test_host_kv_blocks_sizes_and_refusals() -> None:
    assert host_kv_blocks(0, 4096) == 0
    assert host_kv_blocks(10 * 4096 / GIB, 4096) == 10
    with pytest.raises(ValueError, match=r"kv_offloading_size=1e-09 GiB .* holds no KV block"):
        host_kv_blocks(1e-9, 4096)
    with pytest.raises(ValueError, match=r"kv_offloading_size=1000000000.0 GiB .* machine.s"):
        host_kv_blocks(1e9, 4096)
