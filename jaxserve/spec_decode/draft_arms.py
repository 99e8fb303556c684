"""The draft lengths the speculation policy chooses among (its arms), per batch.

The jitted step runs at a padded token count (the runner's token buckets: runner/buckets.py),
so a step of T real tokens computes as many rows as the bucket T pads to. Drafts that fill
those padding rows cost almost nothing on any platform: the rows are computed anyway. Drafts
past them move the step to a larger bucket, whose cost on the CPU (and on any device at large
batches) grows with its tokens. So the policy has three arms:

    "k"    num_speculative_tokens drafts per running decode (the step may grow a bucket);
    "fit"  the most drafts per running decode that keep the step at the bucket it would pad to
           without drafts, capped by k (the scheduler trims them further when prefill chunks in
           the same step leave less room: Scheduler.set_spec_tokens' ``max_step_tokens``);
    "off"  no drafts.

An arm whose length equals another's is left out (at batch 1 on the CPU, whose single-token
bucket has no padding, "fit" is "off"; with a bucket far above the batch it is "k"). The host
side imports no jax: the buckets arrive as plain ints.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

ARMS = ("k", "fit", "off")  # the order a batch bucket measures its missing arms in


def padded_tokens(num_tokens: int, token_buckets: Sequence[int]) -> int:
    """The token count a step of ``num_tokens`` pads to: the smallest bucket >= it (the
    count itself beyond the largest, where the scheduler's budget never goes)."""
    i = bisect_left(token_buckets, num_tokens)
    return token_buckets[i] if i < len(token_buckets) else num_tokens


def fit_drafts(
    num_decodes: int, k: int, token_buckets: Sequence[int], num_other_tokens: int = 0
) -> int:
    """The most drafts each of ``num_decodes`` one-token decodes may carry without the step
    (their tokens and ``num_other_tokens`` of prefill chunks) padding to a larger bucket than
    without drafts, capped by ``k``."""
    if num_decodes <= 0:
        return 0
    tokens = num_decodes + num_other_tokens
    return min(k, (padded_tokens(tokens, token_buckets) - tokens) // num_decodes)


def draft_arms(num_decodes: int, k: int, token_buckets: Sequence[int] | None) -> dict[str, int]:
    """Arm name -> drafts per decode for a batch of ``num_decodes``, in ARMS order; "fit" only
    where it differs from both others (and buckets are known)."""
    fit = fit_drafts(num_decodes, k, token_buckets) if token_buckets else 0
    if 0 < fit < k:
        return {"k": k, "fit": fit, "off": 0}
    return {"k": k, "off": 0}
