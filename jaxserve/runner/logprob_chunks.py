"""Prompt logprobs in row chunks: the step's f32 [T, V] logits never exist whole.

A step whose rows owe prompt logprobs needs the logits of every one of its T tokens. Computed
at once, the f32 logits and their log-softmax are 2 x T x V x 4 bytes of temporaries: 2 GiB
for Llama-3 (V = 128256) at T = 2048, four times the memory plan's workspace reserve for the
whole step. Computed CHUNK_ROWS rows at a time (``lax.map``: one loop, one chunk's buffers
live), they take what the sampler's own logits take (memory_sizes.workspace_bytes counts
max_chunk_rows(max_num_batched_tokens) rows beside max_num_seqs).

Each row's values are those of the unchunked computation: the logits of a row are its own
hidden state times the LM head, and log-softmax, the target's rank and top-k are per row
(tests/runner/test_logprob_chunks.py holds them bit for bit). The price is the LM head read
once per chunk (T / CHUNK_ROWS times instead of once): at 256 rows a chunk's GEMM is still
mostly compute on a TPU or GPU, and only steps that owe prompt logprobs pay it (the step runs
this under ``lax.cond``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax import lax

from jaxserve.runner.sampler import LogprobsArrays, prompt_logprobs

# Rows per chunk: a power of two, so it divides every power-of-two token bucket above it.
CHUNK_ROWS = 256


def chunk_rows(num_tokens: int, max_rows: int = CHUNK_ROWS) -> int:
    """Rows per chunk for a step of ``num_tokens`` tokens: all of them up to ``max_rows``,
    else the largest divisor of num_tokens that is a divisor of max_rows (gcd: a power-of-
    two bucket gets max_rows, a CPU midpoint bucket 3 x 2^k a smaller power of two), so the
    chunks tile the step exactly and no row is padded."""
    if num_tokens <= max_rows:
        return num_tokens
    return math.gcd(num_tokens, max_rows)


def max_chunk_rows(max_num_tokens: int) -> int:
    """The most rows a chunk has in a step of up to ``max_num_tokens`` tokens (what the memory
    plan reserves for; a bucket padded past max_num_tokens may reach CHUNK_ROWS, as its
    activations pass the plan's max_num_batched_tokens)."""
    return min(max_num_tokens, CHUNK_ROWS)


def chunked_prompt_logprobs(
    compute_logits: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    target_ids: jax.Array,
    *,
    num: int,
    max_rows: int = CHUNK_ROWS,
) -> LogprobsArrays:
    """sampler.prompt_logprobs(compute_logits(hidden), target_ids, num=num), computed
    chunk_rows(T, max_rows) rows at a time.

    Args:
        compute_logits: f[C, D] -> f32[C, V], the model's logits of C rows (any C).
        hidden: f[T, D] the step's final hidden states.
        target_ids: i32[T] the prompt token that follows each row, negative where none.
        num: N top logprobs per row (static).
        max_rows: the most rows of one chunk (static; tests pass small ones).
    Returns:
        LogprobsArrays [T, 1 + num], row for row what the unchunked call gives.
    """
    num_tokens = hidden.shape[0]
    rows = chunk_rows(num_tokens, max_rows)
    if rows == num_tokens:
        return prompt_logprobs(compute_logits(hidden), target_ids, num=num)
    num_chunks = num_tokens // rows

    def one_chunk(chunk: tuple[jax.Array, jax.Array]) -> LogprobsArrays:
        chunk_hidden, chunk_targets = chunk  # [C, D], [C]
        return prompt_logprobs(compute_logits(chunk_hidden), chunk_targets, num=num)

    out = lax.map(
        one_chunk,
        (hidden.reshape(num_chunks, rows, -1), target_ids.reshape(num_chunks, rows)),
    )  # each field [T / C, C, 1 + num]
    return jax.tree_util.tree_map(lambda x: x.reshape(num_tokens, *x.shape[2:]), out)
