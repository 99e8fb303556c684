"""Random ragged batches in the kernels' input layout, for tests and CPU benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def random_batch(
    seqs: Sequence[tuple[int, int]],
    *,
    num_tokens: int,
    num_slots: int,
    table_width: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_pages: int | None = None,
    dtype=jnp.float32,
    rng: np.random.Generator,
) -> tuple[jax.Array, ...]:
    """(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs) for sequences given as
    (q_len, kv_len), each on distinct randomly chosen pages (page 0, the null page, unused);
    padding slots, table entries and query rows are 0.

    Args:
        num_pages: S, at least 1 + the pages the sequences need (default: exactly that).

    Raises:
        ValueError: a sequence that does not fit (q_len > kv_len, more pages than the table is
            wide), more rows than num_tokens, more sequences than num_slots, or too few pages.
    """
    needed = [-(-kv_len // page_size) for _, kv_len in seqs]
    num_pages = 1 + sum(needed) if num_pages is None else num_pages
    rows = sum(q_len for q_len, _ in seqs)
    if len(seqs) > num_slots or rows > num_tokens or 1 + sum(needed) > num_pages:
        raise ValueError(
            f"random_batch: {len(seqs)} sequences, {rows} query rows and {1 + sum(needed)} "
            f"pages do not fit num_slots={num_slots}, num_tokens={num_tokens}, "
            f"num_pages={num_pages}"
        )
    _check_sequences(seqs, needed, table_width=table_width, page_size=page_size)
    pool = (num_kv_heads, num_pages, page_size, head_dim)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    k_pages = rng.standard_normal(pool, np.float32)
    v_pages = rng.standard_normal(pool, np.float32)
    kv_lens = np.zeros(num_slots, np.int32)
    tables = np.zeros((num_slots, table_width), np.int32)
    cu_q_lens = np.zeros(num_slots + 1, np.int32)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    for i, ((q_len, kv_len), n) in enumerate(zip(seqs, needed, strict=True)):
        kv_lens[i] = kv_len
        tables[i, :n] = [next(free) for _ in range(n)]
        cu_q_lens[i + 1] = cu_q_lens[i] + q_len
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(kv_lens),
        jnp.asarray(tables),
        jnp.asarray(cu_q_lens),
        jnp.asarray([len(seqs)], jnp.int32),
    )


def _check_sequences(
    seqs: Sequence[tuple[int, int]], needed: list[int], *, table_width: int, page_size: int
) -> None:
    """Raise ValueError naming the first (q_len, kv_len) with q_len outside [1, kv_len] or
    needing (`needed`: its page count) more pages than the block table is wide."""
    for (q_len, kv_len), n in zip(seqs, needed, strict=True):
        if not 1 <= q_len <= kv_len or n > table_width:
            raise ValueError(
                f"random_batch: sequence (q_len={q_len}, kv_len={kv_len}) needs 1 <= q_len <= "
                f"kv_len and at most table_width={table_width} pages of {page_size}"
            )
