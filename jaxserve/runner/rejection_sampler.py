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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
