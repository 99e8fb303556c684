"""The rejection sampler on device: the tokens each segment of logits rows keeps, against a
plain-Python reference; and the exactness of the one-hot rule and of the general-q rule (sampled
drafts), checked as distributions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.draw import inverse_cdf_draw
from jaxserve.runner.rejection_sampler import (
    SampledDrafts,
    num_emitted_per_segment,
    verify_sampled,
)


def _reference(sampled, drafts):
    out, start = [], 0
    for i, d in enumerate(drafts):
        if d < 0:
            seg = list(zip(sampled[start : i + 1], drafts[start : i + 1], strict=True))
            n = 0
            for s, dd in seg:
                n += 1
                if dd < 0 or s != dd:
                    break
            out.append(n)
            start = i + 1
    return out


@pytest.mark.parametrize("seed", range(20))
def test_segments_keep_their_accepted_prefix_plus_one(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=rng.integers(1, 6))  # 1 + drafts per request
    total = int(lengths.sum())
    padded = total + int(rng.integers(0, 4))
    drafts = np.full(padded, -1, np.int32)
    sampled = rng.integers(0, 3, size=padded).astype(np.int32)
    start = 0
    for n in lengths:
        drafts[start : start + n - 1] = rng.integers(0, 3, size=n - 1)
        start += n
    got = np.asarray(jax.jit(num_emitted_per_segment)(jnp.asarray(sampled), jnp.asarray(drafts)))
    want = _reference(sampled.tolist(), drafts.tolist())
    assert got[: len(want)].tolist() == want
    assert got[: len(lengths)].tolist() == want[: len(lengths)]


def test_one_hot_rule_is_the_target_distribution():
    """Accepting draft d when the target's own draw equals d, and emitting that draw otherwise,
    gives P(emit t) = p(t) for every t, and P(accept) = p(d) = min(1, p(d) / q(d)) for q
    one-hot at d: the speculative sampling rule. Checked over 40k draws on a 5-token vocab."""
    p = np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32)
    logits = np.log(p)
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n)
    uniform = jax.vmap(jax.random.uniform)(keys)
    x = jnp.broadcast_to(jnp.asarray(logits), (n, 5))
    draws = np.asarray(inverse_cdf_draw(x, uniform, jnp.max(x, axis=-1)))
    draft = 2
    accepted = draws == draft
    assert accepted.mean() == pytest.approx(p[draft], abs=0.01)
    emitted = np.bincount(draws, minlength=5) / n
    np.testing.assert_allclose(emitted, p, atol=0.01)
    # Given a rejection, the draw follows norm(max(p - q, 0)): p without the draft.
    residual = np.where(np.arange(5) == draft, 0.0, p) / (1 - p[draft])
    rejected = np.bincount(draws[~accepted], minlength=5) / (~accepted).sum()
    np.testing.assert_allclose(rejected, residual, atol=0.015)


@pytest.mark.parametrize(
    "q_ids, q_probs",
    [
        ([0, 1, 2, 3, 4], [0.3, 0.1, 0.4, 0.1, 0.1]),  # q over the whole vocabulary
        ([2, 4], [0.75, 0.25]),  # q over a draft's top Q tokens only
    ],
    ids=["dense-q", "top-q"],
)
def test_general_q_rule_is_the_target_distribution(q_ids, q_probs):
    """Drafts drawn from a general q, kept with probability min(1, p(d) / q(d)) and replaced
    by a draw from norm(max(p - q, 0)) otherwise (verify_sampled): the emitted token follows
    p exactly, and the acceptance rate is sum(min(p, q)). 60k draws on a 5-token vocab."""
    p = np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32)
    q = np.zeros(5)
    q[q_ids] = q_probs
    n = 60_000
    rng = np.random.default_rng(0)
    draft = rng.choice(5, size=n, p=q).astype(np.int32)
    drafts = SampledDrafts(
        draft_ids=jnp.asarray(draft),
        q_ids=jnp.broadcast_to(jnp.asarray(q_ids, jnp.int32), (n, len(q_ids))),
        q_probs=jnp.broadcast_to(jnp.asarray(q_probs, jnp.float32), (n, len(q_ids))),
        use_q=jnp.ones(n, bool),
    )
    u_accept, u_recover = (jnp.asarray(rng.random(n), jnp.float32) for _ in range(2))
    p_rows = jnp.broadcast_to(jnp.asarray(p), (n, 5))
    out = np.asarray(jax.jit(verify_sampled)(p_rows, drafts, u_accept, u_recover))
    np.testing.assert_allclose(np.bincount(out, minlength=5) / n, p, atol=0.008)
    accepted = out == draft
    assert accepted.mean() == pytest.approx(np.minimum(p, q).sum(), abs=0.008)
    # A rejected draft is never emitted: the residual has no mass where q >= p.
    assert not np.any(out[~accepted] == draft[~accepted])


def test_the_sampler_keeps_sampled_drafts_by_the_general_rule():
    """sample() with SampledDrafts: rows with use_q take the general-q rule against the
    processed target distribution (temperature and top-k here), the others their own draw;
    distribution checked over 20k rows of one logits vector."""
    from jaxserve.runner.sampler import sample
    from jaxserve.runner.sampling_metadata import SamplingMetadata

    logits = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32))
    n = 20_000
    md = SamplingMetadata.neutral(n, 5)
    seeds = np.stack([np.zeros(n), np.arange(n)], axis=1).astype(np.uint32)
    md = dataclasses.replace(md, temperature=np.full(n, 0.5, np.float32),
                             top_k=np.full(n, 3, np.int32), seeds=seeds)  # fmt: skip
    # The processed target: softmax(logits / 0.5) over the top 3 tokens.
    kept = np.exp(2 * logits) * (np.arange(5) < 4) * (np.arange(5) > 0)
    p = kept / kept.sum()
    q_ids, q_probs = np.array([0, 1, 2], np.int32), np.array([0.2, 0.2, 0.6], np.float32)
    draft = np.random.default_rng(1).choice(q_ids, size=n, p=q_probs).astype(np.int32)
    use_q = np.arange(n) % 2 == 0
    drafts = SampledDrafts(
        jnp.asarray(draft),
        jnp.broadcast_to(jnp.asarray(q_ids), (n, 3)),
        jnp.broadcast_to(jnp.asarray(q_probs), (n, 3)),
        jnp.asarray(use_q),
    )
    out = jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits), (n, 5)), md, drafts=drafts)
    tokens = np.asarray(out.token_ids)
    for rows in (use_q, ~use_q):
        freq = np.bincount(tokens[rows], minlength=5) / rows.sum()
        np.testing.assert_allclose(freq, p, atol=0.015)
    assert tokens[use_q][tokens[use_q] == draft[use_q]].size / use_q.sum() == pytest.approx(
        np.minimum(p[q_ids], q_probs).sum(), abs=0.015
    )


def test_sampled_drafts_stay_exact_under_each_rows_mask_and_bias():
    """Constrained requests speculate (structured/draft_checks.py): each verification row has
    its own token mask, and logit_bias; the general-q rule and the one-hot rule still emit the
    row's processed distribution exactly, with q's mass on a masked token (such a draft is
    never kept). Two masks on alternate rows, 24k rows of one logits vector."""
    from jaxserve.runner.sampler import sample
    from jaxserve.runner.sampling_metadata import SamplingMetadata
    from jaxserve.structured.bitmask import token_bitmask

    logits = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05], np.float32))
    n = 24_000
    md = SamplingMetadata.neutral(n, 5)
    seeds = np.stack([np.zeros(n), np.arange(n)], axis=1).astype(np.uint32)
    masks = [token_bitmask([0, 1, 3, 4], 5), token_bitmask([2, 3, 4], 5)]
    mask_of_row = np.arange(n) % 2
    md = dataclasses.replace(
        md, temperature=np.full(n, 0.5, np.float32), seeds=seeds,
        token_bitmask=np.stack([masks[i] for i in mask_of_row])[:, :1],
        bias_token_ids=np.full((n, 1), 4, np.int32), bias_values=np.full((n, 1), 1.5, np.float32),
    )  # fmt: skip
    q_ids, q_probs = np.array([0, 1, 2], np.int32), np.array([0.2, 0.2, 0.6], np.float32)
    draft = np.random.default_rng(2).choice(q_ids, size=n, p=q_probs).astype(np.int32)
    use_q = (np.arange(n) // 2) % 2 == 0
    drafts = SampledDrafts(
        jnp.asarray(draft),
        jnp.broadcast_to(jnp.asarray(q_ids), (n, 3)),
        jnp.broadcast_to(jnp.asarray(q_probs), (n, 3)),
        jnp.asarray(use_q),
    )
    out = jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits), (n, 5)), md, drafts=drafts)
    tokens = np.asarray(out.token_ids)
    biased = logits + np.array([0, 0, 0, 0, 1.5], np.float32)
    for m, allowed in enumerate(([0, 1, 3, 4], [2, 3, 4])):
        kept = np.exp(2 * biased) * np.isin(np.arange(5), allowed)
        p = kept / kept.sum()
        for rows in (use_q, ~use_q):
            rows = rows & (mask_of_row == m)
            freq = np.bincount(tokens[rows], minlength=5) / rows.sum()
            np.testing.assert_allclose(freq, p, atol=0.02)
    masked = ~np.isin(draft, [0, 1, 3, 4]) & (mask_of_row == 0)
    assert not np.any(tokens[masked] == draft[masked])
