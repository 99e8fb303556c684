"""runner/logprob_chunks.py: prompt logprobs computed in row chunks are, bit for bit, those of
the whole [T, V] logits at once, for the tiny model's own logits, in and out of jit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints_tools.tiny_random import tiny_random_llama_arch
from jaxserve.models import get_model
from jaxserve.runner.logprob_chunks import CHUNK_ROWS, chunk_rows, chunked_prompt_logprobs
from jaxserve.runner.sampler import prompt_logprobs


def test_chunk_rows_tile_every_bucket_without_padding() -> None:
    assert chunk_rows(1) == 1 and chunk_rows(CHUNK_ROWS) == CHUNK_ROWS
    assert chunk_rows(2048) == CHUNK_ROWS and chunk_rows(4 * CHUNK_ROWS) == CHUNK_ROWS
    assert chunk_rows(384) == 128  # a CPU midpoint bucket 3 x 2^7: the largest shared power
    assert chunk_rows(48, max_rows=16) == 16 and chunk_rows(24, max_rows=16) == 8
    for tokens in (1, 3, 4, 6, 96, 257, 384, 512, 768, 2048, 6144):
        rows = chunk_rows(tokens)
        assert tokens % rows == 0 and rows <= max(tokens if tokens <= CHUNK_ROWS else 0, CHUNK_ROWS)


@pytest.fixture(scope="module")
def tiny_logits():
    model = get_model(tiny_random_llama_arch(), dtype=jnp.float32)
    params = model.init_params(jax.random.key(0))
    return model, functools.partial(model.compute_logits, params)


@pytest.mark.parametrize("num_tokens,max_rows", [(16, 4), (24, 16), (12, 12), (8, 32)])
def test_chunks_give_the_unchunked_values_bit_for_bit(tiny_logits, num_tokens, max_rows) -> None:
    model, logits_of = tiny_logits
    rng = np.random.default_rng(num_tokens)
    hidden = jnp.asarray(rng.normal(size=(num_tokens, model.arch.hidden_size)), jnp.float32)
    vocab = model.arch.vocab_size
    targets = rng.integers(0, vocab, num_tokens).astype(np.int32)
    targets[::3] = -1  # rows that owe nothing: unspecified values, but the same ones
    num = 5

    @functools.partial(jax.jit, static_argnames="chunked")
    def run(hidden, targets, chunked):
        if chunked:
            return chunked_prompt_logprobs(logits_of, hidden, targets, num=num, max_rows=max_rows)
        return prompt_logprobs(logits_of(hidden), targets, num=num)

    want = jax.device_get(run(hidden, targets, chunked=False))
    got = jax.device_get(run(hidden, targets, chunked=True))
    for field in ("logprobs", "token_ids", "ranks"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert got.logprobs.shape == (num_tokens, 1 + num)
    eager = chunked_prompt_logprobs(logits_of, hidden, targets, num=num, max_rows=max_rows)
    np.testing.assert_array_equal(np.asarray(eager.token_ids), want.token_ids)


def test_the_loop_holds_one_chunk_of_logits(tiny_logits) -> None:
    """Compiled, the chunked computation's temporaries are about one chunk's logits, not
    T rows' (the point of chunking)."""
    model, logits_of = tiny_logits
    num_tokens, rows = 512, 32
    hidden = jax.ShapeDtypeStruct((num_tokens, model.arch.hidden_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)

    def temps(max_rows: int) -> int:
        fn = functools.partial(chunked_prompt_logprobs, logits_of, num=4, max_rows=max_rows)
        compiled = jax.jit(fn).lower(hidden, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole = temps(num_tokens)
    chunked = temps(rows)
    full_logits = num_tokens * model.arch.vocab_size * 4
    assert whole >= full_logits
    assert chunked < full_logits // 4
