"""The shared test grid of ragged paged attention: shapes, batches and option variants, and a
builder of the seven input arrays. Every kernel is checked against the reference on it.

Shapes are tiny because interpret mode is slow; the batch shape (T=32 token rows, R=8 sequence
slots, B=4 pages per block table) is the same for every case, so the batch kinds of one shape
share one compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.ragged_paged_attention.testing import random_batch

NUM_TOKENS = 32  # T, padded: every batch below leaves padding rows
NUM_SLOTS = 8  # R, padded: every batch below has fewer sequences
TABLE_WIDTH = 4  # B
NUM_PAGES = NUM_SLOTS * TABLE_WIDTH + 5  # S; page 0 is the null page
NUM_Q_HEADS = 8  # N


@dataclasses.dataclass(frozen=True)
class Shape:
    head_dim: int  # H
    group: int  # N // K
    page_size: int  # P

    @property
    def id(self) -> str:
        return f"H{self.head_dim}-G{self.group}-P{self.page_size}"


# All pairs of (head dim, GQA ratio, page size) values appear in some shape (pairwise cover).
SHAPES = [
    Shape(64, 1, 16),
    Shape(64, 4, 32),
    Shape(64, 8, 16),
    Shape(128, 1, 32),
    Shape(128, 4, 16),
    Shape(128, 8, 32),
]


def batch(kind: str, page_size: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) per real sequence. Contexts end exactly on (k * P) and just past
    (k * P + 1) page boundaries; prefill rows include a fresh prompt and chunk continuations."""
    p = page_size
    kinds = {
        "decode": [(1, 1), (1, p), (1, p + 1), (1, 2 * p + 3), (1, 3 * p)],
        "prefill": [(7, 7), (9, p + 1), (5, 2 * p), (3, 3 * p + 1)],
        "mixed": [(1, p + 1), (6, 6), (1, 2 * p), (8, p + 8), (1, 3)],
    }
    return kinds[kind]


BATCH_KINDS = ("decode", "prefill", "mixed")
# Option variants (sliding window, soft cap, bf16), each run on two shapes.
VARIANTS = {
    "window": dict(sliding_window=7),
    "softcap": dict(soft_cap=2.0),
    "bf16": dict(dtype=jnp.bfloat16),
}
VARIANT_SHAPES = [SHAPES[1], SHAPES[3]]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def make_inputs(
    shape: Shape,
    seqs: list[tuple[int, int]],
    dtype=jnp.float32,
    seed: int = 0,
    num_tokens: int = NUM_TOKENS,
) -> tuple[jax.Array, ...]:
    """(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs) for the batch `seqs`,
    each sequence on distinct random pages; padding slots and table entries are 0."""
    assert sum(q for q, _ in seqs) < num_tokens and len(seqs) < NUM_SLOTS  # padding left
    return random_batch(
        seqs,
        num_tokens=num_tokens,
        num_slots=NUM_SLOTS,
        table_width=TABLE_WIDTH,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_Q_HEADS // shape.group,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        num_pages=NUM_PAGES,
        dtype=dtype,
        rng=np.random.default_rng(seed),
    )


def grid_cases() -> list[tuple[str, Shape, str, dict]]:
    """(id, shape, batch kind, options) for the whole shared grid."""
    cases = [(f"{shape.id}-{kind}", shape, kind, {}) for shape in SHAPES for kind in BATCH_KINDS]
    cases += [
        (f"{shape.id}-mixed-{name}", shape, "mixed", options)
        for name, options in VARIANTS.items()
        for shape in VARIANT_SHAPES
    ]
    return cases


def sm_scale(shape: Shape) -> float:
    return shape.head_dim**-0.5


# Interpret-mode kernels are big XLA while loops whose CPU compile time dominates the tests;
# skipping LLVM's optimisations cuts it by ~40% without changing results.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def compiled(kernel: Callable, shape: Shape, dtype, options: tuple) -> Callable:
    """kernel(*args, sm_scale, **options) compiled once per (kernel, shape, dtype, options); the
    batch kinds share it because their arrays have the same shapes."""
    args = make_inputs(shape, batch("mixed", shape.page_size), dtype)
    fn = functools.partial(kernel, sm_scale=sm_scale(shape), **dict(options))
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)
