"""Speculative drafts on the scheduler's side: what fits in a step, how many were accepted, and
the counters (vLLM's spec_decode_* metrics).

The scheduler knows drafts only as tokens that spend budget like any other: a running decode
with drafts d_1..d_k schedules 1 + k tokens (KV slots from allocate_slots, one sampling row
each). After the step, the runner reports the tokens each request emits (its accepted drafts
plus one); the rejected drafts' positions are rolled back from ``num_computed_tokens`` before any
block is hashed, so an unverified token never enters the prefix cache. Their KV slots stay in
the request's table and are overwritten by later steps.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched.step_batch import StepBatch
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import Request


def schedule_drafts(
    running: list[Request],
    step: StepBatch,
    kv_cache_manager: KVCacheManager,
    max_rows: int,
    num_lookahead: int,
    max_step_tokens: Callable[[int], int] | None = None,
) -> None:
    """Schedule the running decodes' drafts: last, after every running request's own tokens and
    the waiting requests admitted, so that speculation spends only the budget and sampling rows
    that real work leaves (a draft is a guess; a prefill chunk, or another request's decode, is
    work that must be done: drafts scheduled first shrank the batch, and lost throughput at
    large batches). In running order while budget and rows last; a request whose drafts need
    blocks the pool lacks verifies none this step (nothing is preempted for a guess), and a
    prefill chunk carries none. Every running request's drafts are consumed: a draft is
    verified in the step after its proposal or dropped. ``max_step_tokens(n)`` (the policy's
    "fit" arm): the step, n tokens before its drafts, reaches at most that many with them."""
    limit = step.max_budget
    if max_step_tokens is not None:
        limit = min(limit, max_step_tokens(step.num_scheduled_tokens))
    for req in running:
        drafts, req.spec_token_ids = req.spec_token_ids, []
        num_new = step.cached_tokens.get(req.request_id)
        # Drafts follow known tokens only: none for a request with an earlier step in flight.
        if not drafts or num_new is None or req.num_inflight_tokens != num_new:
            continue
        end = req.num_computed_tokens + num_new
        room = min(limit - step.num_scheduled_tokens, max_rows - step.num_sampling_rows,
                   req.max_num_tokens - end - 1)  # fmt: skip
        if end < len(req.all_token_ids) or room <= 0:
            continue
        drafts = drafts[:room]
        lookahead = lookahead_slots(req, end, end + len(drafts), num_lookahead)
        new_blocks = kv_cache_manager.allocate_slots(req, num_new + len(drafts) + lookahead)
        if new_blocks is not None:
            step.add_drafts(req, drafts, [b.block_id for b in new_blocks])


def lookahead_slots(req: Request, chunk_end: int, end: int, num_lookahead: int) -> int:
    """KV slots to reserve past ``end`` (the step's last scheduled position + 1, drafts
    included) for a draft model's next proposal: ``num_lookahead`` when the request's chunk
    (ending at ``chunk_end``, drafts excluded) reaches its known tokens, so that it proposes
    after this step; never past its length limit; 0 otherwise."""
    if not num_lookahead or chunk_end < len(req.all_token_ids):
        return 0
    return max(0, min(num_lookahead, req.max_num_tokens - end))


def computed_counts(
    num_scheduled: dict[str, int],
    spec_tokens: dict[str, list[int]],
    runner_output: ModelRunnerOutput,
    stats: SpecDecodeStats,
) -> dict[str, int]:
    """Tokens each request computed for good this step: its scheduled tokens less its rejected
    drafts (a request that sampled nothing keeps none of them). Records the acceptance."""
    emitted = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
    counts = dict(num_scheduled)
    for req_id, drafts in spec_tokens.items():
        tokens = emitted.get(req_id)
        num_accepted = len(tokens) - 1 if tokens else 0
        counts[req_id] -= len(drafts) - num_accepted
        stats.record(len(drafts), num_accepted)
    return counts


class SpecDecodeStats:
    """Counters of verified drafts (vLLM's names, get_stats() and /metrics)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # requests' verification steps (each verifies 1..k drafts)
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # drafts accepted
        # [k]: drafts accepted at position i (0-based) of their run
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(min(num_accepted, len(per_pos))):
            per_pos[i] += 1

    def report(self) -> dict[str, object]:
        """The get_stats() keys: counters, the acceptance rate and the mean tokens a
        verification step emits (accepted drafts + 1)."""
        drafts, tokens, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
            "spec_decode_mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        }
