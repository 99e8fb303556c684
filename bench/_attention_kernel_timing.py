"""bench/attention_kernel.py's measurements: a case's device arrays, an op timed in one jit of
dependent calls, and the device-to-device copy bandwidth it is compared with.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _attention_kernel_presets import Preset


def make_batch(
    preset: Preset, seqs: list[tuple[int, int]], seed: int = 0, page_size: int | None = None
) -> tuple:
    """Device arrays (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs) for the
    sequences (q_len, kv_len), on randomly permuted pages (page 0 is the null page)."""
    page = page_size or preset.page_size
    width = max(-(-kv // page) for _, kv in seqs)
    num_pages = 1 + sum(-(-kv // page) for _, kv in seqs)
    rng = np.random.default_rng(seed)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(seqs), width), np.int32)
    for i, (_, kv) in enumerate(seqs):
        tables[i, : -(-kv // page)] = [next(free) for _ in range(-(-kv // page))]
    cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    dtype = jnp.dtype(preset.dtype)
    keys = jax.random.split(jax.random.key(seed), 3)
    pool = (preset.num_kv_heads, num_pages, page, preset.head_dim)
    num_tokens = int(cu_q_lens[-1])
    return (
        jax.random.normal(keys[0], (num_tokens, preset.num_q_heads, preset.head_dim), dtype),
        jax.random.normal(keys[1], pool, dtype),
        jax.random.normal(keys[2], pool, dtype),
        jnp.asarray([kv for _, kv in seqs], jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(cu_q_lens),
        jnp.asarray([len(seqs)], jnp.int32),
    )


def time_op(op, args: tuple, inner: int, repeats: int) -> tuple[float, jax.Array]:
    """(median seconds per op call, the op's output), `inner` dependent calls per program."""

    @jax.jit
    def chained(q, *rest):
        for _ in range(inner):
            out = op(q, *rest)
            # Serialise the calls: q depends on the last output, by an amount below q's precision
            # (so every call sees the same values), which XLA cannot know or fold away.
            tiny = out[:1, :1, :1].astype(jnp.float32) * 1e-30
            q = q + tiny.astype(q.dtype)
        return q, out

    jax.block_until_ready(chained(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, out = jax.block_until_ready(chained(*args))
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), out


def _best_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and first touch
    best = math.inf
    for _ in range(max(3, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(preset: Preset) -> float:
    """Streaming bytes/s (read + write) of an elementwise op over a copy_bytes array."""
    return copy_bandwidths(preset)["elementwise"]


def copy_bandwidths(preset: Preset) -> dict[str, float]:
    """Device-to-device bytes/s (read + write) over a copy_bytes array, two ways: an
    elementwise op (XLA's streaming loop) and a plain device copy (jax.device_put with
    may_alias=False: a memcpy on GPU), when this jax has it."""
    x = jnp.ones((preset.copy_bytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda y: y * jnp.bfloat16(1.0001))
    out = {"elementwise": 2 * preset.copy_bytes / _best_seconds(lambda: step(x), preset.repeats)}
    try:
        memcpy = functools.partial(jax.device_put, x, x.sharding, may_alias=False)
        out["memcpy"] = 2 * preset.copy_bytes / _best_seconds(memcpy, preset.repeats)
    except TypeError:  # a jax without device_put(may_alias=...)
        pass
    return out
