"""On-device sampler: exact distributions on a small vocabulary, masks, penalties, seeded
reproducibility, logprobs, compilation count and shape checks."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.outputs import TokenLogprobs
from jaxserve.pallas_kernels.sampling import cpu_draw
from jaxserve.runner.draw import DRAWS
from jaxserve.runner.sampler import (
    LogprobsArrays,
    SamplerOutput,
    apply_penalties,
    prompt_logprobs,
    sample,
    to_token_logprobs,
)
from jaxserve.runner.sampling_metadata import SamplingInputs, SamplingMetadata
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

V = 12  # vocabulary of the statistical tests
NUM_SAMPLES = 20_000
# A fixed logit row whose top-p boundaries sit far from the top_p values used below.
LOGITS = np.array([2.0, 1.4, 1.1, 0.6, 0.3, 0.0, -0.2, -0.5, -0.9, -1.4, -2.0, -3.0], np.float32)

STATIC = ("fast_top_k", "draw")
sample_jit = jax.jit(sample, static_argnames=STATIC)


@pytest.fixture(params=DRAWS)
def sampler(request):
    """The sampler with each draw: the C++ kernel (the CPU plan's, where it builds) and XLA's
    (what GPU and TPU run)."""
    if request.param == "cpu" and not cpu_draw.available():
        pytest.skip(f"the C++ draw does not build here: {cpu_draw.KERNEL.load()}")
    return functools.partial(sample_jit, draw=request.param)


def reference_probs(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: list[int] = (),
    outputs: list[int] = (),
    banned: tuple[int, ...] = (),
) -> np.ndarray:
    """The exact distribution vLLM's order defines, in float64."""
    x = reference_penalties(logits, params, prompt, outputs)
    x[list(banned)] = -np.inf
    if params.temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    x = x / params.temperature
    p = _softmax(x)
    x[p < params.min_p * p.max()] = -np.inf
    if params.top_k != -1:
        x[x < np.sort(x)[::-1][params.top_k - 1]] = -np.inf
    if params.top_p < 1:
        p = _softmax(x)
        order = np.argsort(-x, kind="stable")
        exclusive = np.cumsum(p[order]) - p[order]
        # Keep the test meaningful: no boundary within float error of top_p.
        assert np.min(np.abs(exclusive - params.top_p)) > 1e-3
        x[x < x[order][np.sum(exclusive < params.top_p) - 1]] = -np.inf
    return _softmax(x)


def reference_penalties(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], outputs: list[int]
) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    seen = sorted(set(prompt) | set(outputs))
    rep = params.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    for token, count in Counter(outputs).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def assert_distribution(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Empirical frequencies within 5 standard errors of probs; impossible tokens never drawn."""
    freq = np.bincount(tokens, minlength=len(probs)) / len(tokens)
    tol = 5 * np.sqrt(probs * (1 - probs) / len(tokens)) + 1e-12
    assert np.all(freq[probs < 1e-12] == 0), (freq, probs)
    assert np.all(np.abs(freq - probs) <= tol), np.stack([freq, probs])


def draw(
    params: SamplingParams,
    *,
    prompt: list[int] = (0,),
    outputs: list[int] = (),
    logits: np.ndarray = LOGITS,
    seed: int = 1234,
    fast_top_k: int = 64,
    eos: tuple[int, ...] = (),
    sampler=sample_jit,
) -> np.ndarray:
    """NUM_SAMPLES draws of one request in one call: rows differ only in output_pos."""
    inputs = SamplingInputs(1, len(logits), 64, eos_token_ids=eos)
    inputs.set_request(0, params, seed, list(prompt), list(outputs))
    slots = np.zeros(NUM_SAMPLES, np.int32)
    md = inputs.build(slots, NUM_SAMPLES, np.arange(NUM_SAMPLES, dtype=np.int32))
    batch = np.broadcast_to(logits, (NUM_SAMPLES, len(logits)))
    out = sampler(batch, md, fast_top_k=fast_top_k)
    return np.asarray(out.token_ids)


SETTINGS = {
    "temperature_1": SamplingParams(temperature=1.0),
    "temperature_0.5": SamplingParams(temperature=0.5),
    "temperature_2_top_k_3": SamplingParams(temperature=2.0, top_k=3),
    "top_p_0.7": SamplingParams(top_p=0.7),
    "min_p_0.15": SamplingParams(min_p=0.15),
    "combined": SamplingParams(temperature=1.3, top_k=6, top_p=0.8, min_p=0.05),
    "top_k_9_top_p_0.93": SamplingParams(top_k=9, top_p=0.93),
}


@pytest.mark.parametrize("fast_top_k", [2, 64])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_distribution_is_exact(name: str, fast_top_k: int, sampler) -> None:
    params = SETTINGS[name]
    tokens = draw(params, fast_top_k=fast_top_k, sampler=sampler)
    assert_distribution(tokens, reference_probs(LOGITS, params))


def test_penalised_distribution_is_exact() -> None:
    params = SamplingParams(
        temperature=0.9, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.3
    )
    prompt, outputs = [0, 0, 7, 3], [1, 1, 1, 7, 10]  # 0, 3: prompt only; 1, 7, 10: outputs
    tokens = draw(params, prompt=prompt, outputs=outputs)
    assert_distribution(tokens, reference_probs(LOGITS, params, prompt, outputs))


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = LOGITS.copy()
    logits[5] = 6.0  # EOS would win almost always
    params = SamplingParams(min_tokens=NUM_SAMPLES, max_tokens=NUM_SAMPLES, stop_token_ids=[0])
    tokens = draw(params, logits=logits, eos=(5,))
    assert_distribution(tokens, reference_probs(logits, params, banned=(0, 5)))
    greedy = dataclasses.replace(params, temperature=0.0)
    assert set(draw(greedy, logits=logits, eos=(5,)).tolist()) == {1}
    # Past min_tokens nothing is banned: row i samples output index i.
    short = dataclasses.replace(params, min_tokens=10)
    tokens = draw(short, logits=logits, eos=(5,))
    assert not np.isin(tokens[:10], [0, 5]).any() and (tokens[10:] == 5).mean() > 0.9


def test_seeded_rows_are_independent_draws() -> None:
    """(seed, pos) and (seed, pos + 1) over many seeds: the joint law is the product law."""
    logits = np.array([1.0, 0.5, 0.0, -0.5], np.float32)
    num_seeds = NUM_SAMPLES // 2
    md = SamplingMetadata.neutral(2 * num_seeds, 4)
    seeds = np.repeat(np.arange(num_seeds, dtype=np.uint32), 2)
    md = dataclasses.replace(
        md,
        temperature=np.ones(2 * num_seeds, np.float32),
        seeds=np.stack([seeds * 7, seeds], axis=1).astype(np.uint32),
        output_pos=np.tile(np.array([5, 6], np.int32), num_seeds),
    )
    out = sample_jit(np.broadcast_to(logits, (2 * num_seeds, 4)), md)
    pairs = np.asarray(out.token_ids).reshape(num_seeds, 2)
    p = _softmax(logits.astype(np.float64))
    assert_distribution(pairs[:, 0], p)
    assert_distribution(pairs[:, 0] * 4 + pairs[:, 1], np.outer(p, p).reshape(-1))


def _random_metadata(rng: np.random.Generator, num_rows: int, vocab: int) -> SamplingMetadata:
    """Rows of mixed settings: greedy, temperatures, top-k, top-p, min-p, penalties."""
    md = SamplingMetadata.neutral(num_rows, vocab, penalty_width=4)
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], num_rows).astype(np.float32)
    ids = np.where(rng.random((num_rows, 4)) < 0.7, rng.permutation(vocab)[:4], -1)
    return dataclasses.replace(
        md,
        temperature=temperature,
        top_k=rng.choice([1, 2, 5, vocab], num_rows).astype(np.int32),
        top_p=rng.choice([0.3, 0.9, 1.0], num_rows).astype(np.float32),
        min_p=rng.choice([0.0, 0.1], num_rows).astype(np.float32),
        presence_penalty=rng.uniform(-1, 1, num_rows).astype(np.float32),
        frequency_penalty=rng.uniform(-1, 1, num_rows).astype(np.float32),
        repetition_penalty=rng.uniform(0.5, 2, num_rows).astype(np.float32),
        seeds=rng.integers(0, 2**32, (num_rows, 2), dtype=np.uint32),
        output_pos=rng.integers(0, 1000, num_rows, dtype=np.int32),
        penalty_token_ids=ids.astype(np.int32),
        penalty_output_counts=np.where(ids >= 0, rng.integers(0, 3, (num_rows, 4)), 0).astype(
            np.int32
        ),
    )


def _rows(md: SamplingMetadata, index: np.ndarray) -> SamplingMetadata:
    return jax.tree.map(lambda a: np.asarray(a)[index], md)


def _concat(a: SamplingMetadata, b: SamplingMetadata) -> SamplingMetadata:
    return jax.tree.map(lambda x, y: np.concatenate([x, y]), a, b)


@pytest.mark.slow
def test_seeded_token_does_not_depend_on_row_or_batch() -> None:
    rng = np.random.default_rng(0)
    num_rows, vocab = 64, 16
    md = _random_metadata(rng, num_rows, vocab)
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 2
    alone = np.asarray(sample_jit(logits, md).token_ids)
    # Permuted, padded to 128 rows with other requests, with other fast_top_k paths.
    perm = rng.permutation(num_rows)
    others = _random_metadata(rng, 64, vocab)
    mixed_md = _concat(_rows(md, perm), others)
    mixed_md = dataclasses.replace(mixed_md, num_logprobs=np.full(128, 2, np.int32))
    mixed_logits = np.concatenate([logits[perm], rng.normal(size=(64, vocab)).astype(np.float32)])
    for fast_top_k in (1, vocab):  # fallback sort for any top-k row; full sort always
        out = sample_jit(mixed_logits, mixed_md, fast_top_k=fast_top_k)
        np.testing.assert_array_equal(np.asarray(out.token_ids)[:num_rows], alone[perm])
    for row in range(0, num_rows, 9):  # a batch of one
        one = sample_jit(logits[row : row + 1], _rows(md, [row]))
        assert int(one.token_ids[0]) == alone[row]


def test_different_seeds_and_positions_give_different_sequences() -> None:
    a, b = draw(SETTINGS["temperature_1"], seed=1), draw(SETTINGS["temperature_1"], seed=2)
    p = reference_probs(LOGITS, SETTINGS["temperature_1"])
    agreement = np.mean(a == b)  # independent draws agree with probability sum(p^2)
    assert abs(agreement - np.sum(p**2)) < 5 * np.sqrt(np.sum(p**2) / NUM_SAMPLES)
    assert np.mean(a[1:] == a[:-1]) < np.sum(p**2) + 0.02


def test_greedy_is_argmax_of_penalised_logits() -> None:
    rng = np.random.default_rng(1)
    md = _random_metadata(rng, 32, 16)
    md = dataclasses.replace(md, temperature=np.zeros(32, np.float32))
    logits = rng.normal(size=(32, 16)).astype(np.float32)
    expected = np.argmax(np.asarray(apply_penalties(jnp.asarray(logits), md)), axis=-1)
    out = sample_jit(logits, md)  # every row greedy: the argmax path alone
    np.testing.assert_array_equal(out.token_ids, expected)
    # Beside a sampled row: the mixed path, greedy rows still take the argmax.
    sampled = dataclasses.replace(_rows(md, [0]), temperature=np.ones(1, np.float32))
    out = sample_jit(np.concatenate([logits, logits[:1]]), _concat(md, sampled))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:32], expected)


def test_apply_penalties_matches_reference() -> None:
    rng = np.random.default_rng(2)
    md = _random_metadata(rng, 16, 16)
    logits = rng.normal(size=(16, 16)).astype(np.float32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), md))
    for row in range(16):
        ids, counts = md.penalty_token_ids[row], md.penalty_output_counts[row]
        params = SamplingParams(
            presence_penalty=float(md.presence_penalty[row]),
            frequency_penalty=float(md.frequency_penalty[row]),
            repetition_penalty=float(md.repetition_penalty[row]),
        )
        live = ids >= 0
        prompt = ids[live & (counts == 0)].tolist()
        outputs = np.repeat(ids[live], counts[live]).tolist()
        want = reference_penalties(logits[row], params, prompt, outputs)
        np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-6)


def test_a_pending_output_token_counts_as_if_it_were_listed() -> None:
    """Async scheduling: a row's sample of the step before (its id on the device only) counts
    in the penalties exactly as if the host's lists had it: an extra count of a listed token,
    or a new token with a count of 1; -1 changes nothing."""
    rng = np.random.default_rng(4)
    num_rows, vocab = 32, 16
    md = dataclasses.replace(_random_metadata(rng, num_rows, vocab),
                             penalty_token_ids=np.full((num_rows, 4), -1, np.int32),
                             penalty_output_counts=np.zeros((num_rows, 4), np.int32))  # fmt: skip
    ids = np.stack([rng.permutation(vocab)[:4] for _ in range(num_rows)])
    ids[:, 3] = -1  # room for a new token
    counts = np.where(ids >= 0, rng.integers(0, 3, ids.shape), 0)
    pending = np.where(rng.random(num_rows) < 0.5, ids[:, 0], rng.integers(0, vocab, num_rows))
    pending[::5] = -1
    want_ids, want_counts = ids.copy(), counts.copy()
    for row, token in enumerate(pending):
        if token < 0:
            continue
        col = np.flatnonzero(ids[row] == token)
        col = col[0] if col.size else 3
        want_ids[row, col] = token
        want_counts[row, col] += 1
    logits = jnp.asarray(rng.normal(size=(num_rows, vocab)).astype(np.float32))
    listed = dataclasses.replace(md, penalty_token_ids=ids.astype(np.int32),
                                 penalty_output_counts=counts.astype(np.int32))  # fmt: skip
    want = dataclasses.replace(md, penalty_token_ids=want_ids.astype(np.int32),
                               penalty_output_counts=want_counts.astype(np.int32))  # fmt: skip
    got = apply_penalties(logits, listed, jnp.asarray(pending, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(apply_penalties(logits, want)))


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    rng = np.random.default_rng(3)
    md = _random_metadata(rng, 8, 16)  # penalties and temperature must not change logprobs
    logits = rng.normal(size=(8, 16)).astype(np.float32)
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie at the top
    asked = dataclasses.replace(md, num_logprobs=np.array([4, -1, 0, 4, 4, 4, 2, 4], np.int32))
    out = jax.device_get(sample_jit(logits, asked))
    assert out.logprobs.shape == (8, 1 + 16)  # the widest (V = 16 < 20); the host cuts rows
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    rows = np.arange(8)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], out.token_ids)
    np.testing.assert_allclose(out.logprobs[:, 0], lp[rows, out.token_ids], rtol=1e-6)
    np.testing.assert_array_equal(
        out.ranks[:, 0], 1 + np.sum(lp > lp[rows, out.token_ids][:, None], axis=1)
    )
    top = np.take_along_axis(lp, out.logprob_token_ids[:, 1:], axis=1)
    np.testing.assert_allclose(out.logprobs[:, 1:], top, rtol=1e-6)
    np.testing.assert_allclose(out.logprobs[:, 1:5], -np.sort(-lp, axis=1)[:, :4], rtol=1e-6)
    np.testing.assert_array_equal(out.ranks[:, 1:5], np.tile(np.arange(1, 5), (8, 1)))
    assert set(out.logprob_token_ids[0, 1:3].tolist()) == {3, 5}
    none = sample_jit(logits, md)  # no row asked: zeros, and the same tokens
    assert not np.asarray(none.logprobs).any() and not np.asarray(none.ranks).any()
    np.testing.assert_array_equal(none.token_ids, out.token_ids)


def test_prompt_logprobs() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(10, 16)).astype(np.float32)
    targets = rng.integers(0, 16, 10).astype(np.int32)
    got = jax.device_get(jax.jit(prompt_logprobs, static_argnames="num")(logits, targets, num=3))
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    target_lp = lp[np.arange(10), targets]
    np.testing.assert_array_equal(got.token_ids[:, 0], targets)
    np.testing.assert_allclose(got.logprobs[:, 0], target_lp, rtol=1e-6)
    np.testing.assert_array_equal(got.ranks[:, 0], 1 + np.sum(lp > target_lp[:, None], axis=1))
    np.testing.assert_array_equal(got.token_ids[:, 1:], np.argsort(-lp, axis=1)[:, :3])
    zero = prompt_logprobs(logits, targets, num=0)
    assert zero.logprobs.shape == (10, 1)
    ignored = prompt_logprobs(logits, np.where(np.arange(10) < 5, targets, -1), num=3)
    np.testing.assert_allclose(ignored.logprobs[:5], got.logprobs[:5], rtol=1e-6)
    assert np.isfinite(np.asarray(ignored.logprobs)).all()
    with pytest.raises(ValueError, match="target_ids"):
        prompt_logprobs(logits, targets[:5], num=3)


def test_to_token_logprobs_cuts_each_row_to_its_request() -> None:
    arrays = LogprobsArrays(
        logprobs=np.array([[-0.5, -0.1, -0.5, -2.0], [-3.0, -0.2, -0.9, -1.0]], np.float32),
        token_ids=np.array([[4, 2, 4, 7], [9, 1, 0, 3]], np.int32),
        ranks=np.array([[2, 1, 2, 3], [6, 1, 2, 3]], np.int32),
    )
    got = arrays.to_token_logprobs([1, 3])
    want = TokenLogprobs(token_ids=[4, 2], logprobs=[-0.5, pytest.approx(-0.1)], ranks=[2, 1])
    assert got[0] == want
    assert got[1].token_ids == [9, 1, 0, 3] and got[1].ranks == [6, 1, 2, 3]
    assert [t.token_ids for t in arrays.to_token_logprobs(0)] == [[4], [9]]
    with pytest.raises(ValueError, match="num_logprobs"):
        to_token_logprobs(arrays.logprobs, arrays.token_ids, arrays.ranks, 4)


def _counting_jit() -> tuple[jax.stages.Wrapped, list[int]]:
    """A fresh jitted sampler (jit caches are shared per wrapped function) and its trace count."""
    traces = [0]

    def step(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
        traces[0] += 1
        return sample(logits, md)

    return jax.jit(step), traces


def test_new_settings_never_recompile() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(16, 16)).astype(np.float32)
    fn, traces = _counting_jit()
    for _ in range(20):
        fn(logits, _random_metadata(rng, 16, 16)).token_ids.block_until_ready()
    assert traces == [1] and fn._cache_size() == 1
    # Through the host builder: every request differs, W = B = 0 throughout.
    inputs = SamplingInputs(16, 16, 64)
    fn, traces = _counting_jit()
    for step in range(20):
        for slot in range(16):
            params = SamplingParams(
                temperature=float(rng.uniform(0.1, 2)),
                top_k=int(rng.choice([-1, 1, 3, 20])),
                top_p=float(rng.uniform(0.1, 1)),
                min_p=float(rng.uniform(0, 0.5)),
                seed=int(rng.integers(0, 2**63)),
                logprobs=[None, 0, 3, MAX_LOGPROBS][int(rng.integers(4))],
            )
            inputs.set_request(slot, params, params.seed, [1, 2])
        slots = rng.permutation(16)[: 5 + step % 7].astype(np.int32)
        md = inputs.build(slots, 16, np.full(len(slots), step, np.int32))
        fn(logits, md).token_ids.block_until_ready()
    assert traces == [1] and fn._cache_size() == 1


def test_penalties_and_bans_take_the_second_variant_only() -> None:
    """Any mix of penalties, min_tokens bans, logprobs, greedy and sampled rows runs in two
    compiled variants: lists of neither, or both at their minimum widths (what warm-up
    compiles)."""
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(16, 16)).astype(np.float32)
    inputs = SamplingInputs(16, 16, 64, eos_token_ids=[2])
    fn, traces = _counting_jit()
    for step in range(20):
        for slot in range(16):
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 0.7])),
                presence_penalty=float(rng.choice([0.0, 0.5])),
                repetition_penalty=float(rng.choice([1.0, 1.3])),
                min_tokens=int(rng.choice([0, 3])),
                logprobs=[None, 1, MAX_LOGPROBS][int(rng.integers(3))],
            )
            inputs.set_request(slot, params, slot, [1, 2, slot])
        slots = rng.permutation(16)[: 1 + step % 8].astype(np.int32)
        md = inputs.build(slots, 16, np.full(len(slots), step % 5, np.int32))
        widths = (md.penalty_token_ids.shape[1], md.banned_token_ids.shape[1])
        assert widths in inputs.variant_widths
        fn(logits, md).token_ids.block_until_ready()
    assert traces[0] == fn._cache_size() <= 2


BAD_FIELDS = {
    "temperature": np.zeros(7, np.float32),
    "top_k": np.zeros(8, np.float32),
    "seeds": np.zeros((8, 2), np.int32),
    "output_pos": np.zeros((8, 1), np.int32),
    "num_logprobs": np.zeros(7, np.int32),
    "penalty_output_counts": np.zeros((8, 3), np.int32),  # ids have width 0
    "banned_token_ids": np.zeros(8, np.int32),
}


@pytest.mark.parametrize("field", list(BAD_FIELDS))
def test_bad_metadata_shapes_raise(field: str) -> None:
    md = dataclasses.replace(SamplingMetadata.neutral(8, 16), **{field: BAD_FIELDS[field]})
    with pytest.raises(ValueError, match=f"SamplingMetadata.{field} must be"):
        sample_jit(np.zeros((8, 16), np.float32), md)


def test_bad_logits_rank_raises() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[R, V\]"):
        sample(jnp.zeros(16), SamplingMetadata.neutral(8, 16))


def test_inverse_cdf_draw_edges_never_pick_masked_tokens():
    """The two-level inverse-CDF draw at the extremes of the uniform, with masked tokens at both
    ends of the vocabulary and a vocabulary that is not a multiple of the chunk."""
    from jaxserve.runner.draw import inverse_cdf_draw

    vocab = 600  # chunks of 256: 256, 256, 88 (+ 168 of padding)
    x = np.full((4, vocab), -np.inf, np.float32)
    x[:, 10] = 0.0
    x[:, 300] = 1.0
    x[:, 550] = 0.5
    u = jnp.array([0.0, 0.999999, np.nextafter(np.float32(1), np.float32(0)), 0.5], jnp.float32)
    tokens = np.asarray(inverse_cdf_draw(jnp.asarray(x), u, jnp.max(x, axis=-1)))
    assert tokens[0] == 10 and tokens[1] == 550 and tokens[2] == 550
    assert set(tokens.tolist()) <= {10, 300, 550}
    # The draw's frequencies follow softmax(x).
    n = 20000
    uniform = (np.arange(n, dtype=np.float64) + 0.5) / n
    rows = np.broadcast_to(x[:1], (n, vocab))
    counts = np.bincount(
        np.asarray(
            inverse_cdf_draw(
                jnp.asarray(rows), jnp.asarray(uniform, jnp.float32), jnp.ones(n, jnp.float32)
            )
        ),
        minlength=vocab,
    )
    p = np.exp([0.0, 1.0, 0.5]) / np.exp([0.0, 1.0, 0.5]).sum()
    np.testing.assert_allclose(counts[[10, 300, 550]] / n, p, atol=2e-3)
