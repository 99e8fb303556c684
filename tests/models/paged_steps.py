"""Test helper: build the padded ragged batch of one engine step by hand, as the runner would.

A step is a list of chunks; chunk r schedules tokens seq[start:stop] of one sequence whose KV
lives in the pages of its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxserve.models import AttentionMetadata


@dataclass(frozen=True)
class Chunk:
    name: str  # which sequence (for the caller's bookkeeping)
    token_ids: list[int]  # the whole sequence
    block_table: list[int]  # physical page of each logical block
    start: int  # first scheduled position (tokens before it are already in the cache)
    stop: int  # one past the last scheduled position


@dataclass(frozen=True)
class Step:
    input_ids: jnp.ndarray  # i32[T]
    md: AttentionMetadata
    rows: list[tuple[str, int]]  # (sequence name, position) of each real row, in row order


def build_step(
    chunks: list[Chunk], *, block_size: int, num_tokens: int, num_seqs: int, table_width: int
) -> Step:
    """Pad to num_tokens rows and num_seqs sequence slots; padding rows write to null page 0."""
    ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    tables = np.zeros((num_seqs, table_width), np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    rows = []
    t = 0
    for r, c in enumerate(chunks):
        tables[r, : len(c.block_table)] = c.block_table
        kv_lens[r] = c.stop
        for pos in range(c.start, c.stop):
            ids[t] = c.token_ids[pos]
            positions[t] = pos
            slots[t] = c.block_table[pos // block_size] * block_size + pos % block_size
            rows.append((c.name, pos))
            t += 1
        cu[r + 1] = t
    cu[len(chunks) + 1 :] = t  # padding sequences own no rows
    assert t <= num_tokens and len(chunks) <= num_seqs
    md = AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv_lens),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(chunks)], jnp.int32),
    )
    return Step(jnp.asarray(ids), md, rows)
