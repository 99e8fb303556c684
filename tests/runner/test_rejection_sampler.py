"""The rejection sampler on device: the tokens each segment of logits rows keeps, against a
plain-Python reference; and the exactness of the one-hot rule, checked as a distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.draw import inverse_cdf_draw
from jaxserve.runner.rejection_sampler import num_emitted_per_segment


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
