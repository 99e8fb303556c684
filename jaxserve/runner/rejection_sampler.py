"""The rejection sampler of speculative decoding, on device, inside the runner's one jitted step.

Layout (flat, static shapes): the step's R logits rows hold, request after request, one row per
position that samples. A speculating request with k drafts d_1..d_k owns k + 1 consecutive rows:
row j scores the position after d_j (d_0 being the request's last known token), and
``draft_ids[row j] = d_{j+1}``, the token the proposer guessed there; its last row has no draft
(-1). A request without drafts owns one row with draft -1; padding rows have -1 too. So the -1
rows close the segments, and segment s is the rows after the (s-1)-th -1 up to the s-th.

Rule: every row is sampled exactly as without speculation (sampler.sample, with the row's own
output position in its key), and a request keeps the leading rows up to and including its first
row whose sample differs from the draft (its last row always differs). For drafts that are a
single token (n-gram proposals, greedy drafts: q one-hot) this is the standard speculative
sampling rule: the target's draw equals d with probability p(d) = min(1, p(d) / q(d)) (accept),
and conditioned on a mismatch it is distributed as p without d, renormalised, which is
norm(max(p - q, 0)) (the recovered token). The bonus token after k accepted drafts is the draw
of the last row. Because each row's draw uses the key the same output position uses without
speculation, greedy and seeded outputs are token for token those of the engine without
speculation: speculation changes how many steps a request takes, never its tokens.

Sampled drafts (the draft model, for random requests without a seed): the draft d was drawn
from the draft model's distribution q at that position (over its top Q tokens: q is stored
exactly, as ids and probabilities, and d is drawn from exactly that), and the row keeps the
standard rule with a general q: accept d with probability min(1, p(d) / q(d)), else emit a draw
from norm(max(p - q, 0)); p is the target's processed distribution (temperature, min-p, top-k,
top-p, bans). The emitted token is distributed as p whatever q is, and a good draft (q near p)
is accepted with probability sum(min(p, q)) instead of p(d) for a one-hot guess. The draft's
draw, the acceptance and the recovery use independent uniforms from the row's key (row_keys).
Seeded requests keep one-hot drafts, so that their tokens stay those without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.draw import inverse_cdf_draw

# fold_in streams of a row's key (row_keys): the sampler's own draw uses the key itself.
DRAFT_STREAM, ACCEPT_STREAM, RECOVER_STREAM = 1, 2, 3


def row_keys(seeds: jax.Array, output_pos: jax.Array) -> jax.Array:
    """key[R] of each row: fold_in(key(seed), output position), from u32[R, 2] seeds."""
    keys = jax.random.wrap_key_data(seeds, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, output_pos)


def stream_uniforms(keys: jax.Array, stream: int) -> jax.Array:
    """f32[R] in [0, 1): one uniform per row from stream ``stream`` of its key."""
    return jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, stream)))(keys)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampledDrafts:
    """The step's R logits rows' sampled drafts: row r verifies draft_ids[r], drawn from the
    distribution with mass q_probs[r] on tokens q_ids[r], where use_q[r] (elsewhere the
    one-hot rule applies and q_* hold anything)."""

    draft_ids: jax.Array  # i32[R] -1: none
    q_ids: jax.Array  # i32[R, Q]
    q_probs: jax.Array  # f32[R, Q], summing to 1 on the rows that use them
    use_q: jax.Array  # bool[R]


def draw_top_q(
    logits: jax.Array, inv_t: jax.Array, uniform: jax.Array, num_q: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A draft model's sampled drafts: per row, a draw from q = softmax(logits * inv_t) over
    the row's ``num_q`` most likely tokens, returned with q exactly as drawn from.

    Args: logits f32[R, V]; inv_t f32[R] (> 0); uniform f32[R] in [0, 1).
    Returns: (draft i32[R], q_ids i32[R, Q], q_probs f32[R, Q]).
    """
    vals, q_ids = lax.top_k(logits.astype(jnp.float32), num_q)
    q_probs = jax.nn.softmax(vals * inv_t[:, None], axis=-1)
    cum = jnp.cumsum(q_probs, axis=-1)
    index = jnp.sum(cum <= (uniform * cum[:, -1])[:, None], axis=-1)
    index = jnp.minimum(index, num_q - 1)  # rounding at the top end
    draft = jnp.take_along_axis(q_ids, index[:, None], axis=1)[:, 0]
    # q_probs is the distribution the draw inverted (its cumulative sum, renormalised).
    return draft.astype(jnp.int32), q_ids.astype(jnp.int32), q_probs / cum[:, -1:]


def verify_sampled(
    p: jax.Array, drafts: SampledDrafts, u_accept: jax.Array, u_recover: jax.Array
) -> jax.Array:
    """i32[R]: per row, the draft when u_accept * q(d) < p(d) (probability min(1, p / q)),
    else a draw from norm(max(p - q, 0)) at u_recover. p: f32[R, V] the target's processed
    probabilities; rows that do not use q get an unspecified token."""
    num_rows = p.shape[0]
    rows = jnp.arange(num_rows)
    d = jnp.maximum(drafts.draft_ids, 0)
    q = jnp.zeros_like(p).at[rows[:, None], drafts.q_ids].add(drafts.q_probs)
    accept = u_accept * q[rows, d] < p[rows, d]
    log_residual = jnp.log(jnp.maximum(p - q, 0.0))  # -inf where q covers p
    top = jnp.max(log_residual, axis=-1)
    recovered = inverse_cdf_draw(log_residual, u_recover, jnp.where(jnp.isfinite(top), top, 0.0))
    return jnp.where(accept, d, recovered).astype(jnp.int32)


def num_emitted_per_segment(sampled: jax.Array, draft_ids: jax.Array) -> jax.Array:
    """Tokens each segment emits: its accepted drafts plus one (recovered or bonus).

    Args:
        sampled: i32[R] the token sampled at each logits row.
        draft_ids: i32[R] the draft each row verifies, -1 for a segment's last row (and for
            padding rows, each its own segment).
    Returns:
        i32[R]: entry s is the number of leading rows segment s keeps (>= 1); entries past the
        last segment are unspecified.
    """
    num_rows = sampled.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    is_last = draft_ids < 0
    # Segment id of each row: how many segments closed before it.
    seg = jnp.cumsum(is_last.astype(jnp.int32)) - is_last.astype(jnp.int32)
    mismatch = is_last | (sampled != draft_ids)
    first_mismatch = jax.ops.segment_min(
        jnp.where(mismatch, rows, num_rows), seg, num_segments=num_rows
    )
    first_row = jax.ops.segment_min(rows, seg, num_segments=num_rows)
    return (first_mismatch - first_row + 1).astype(jnp.int32)
