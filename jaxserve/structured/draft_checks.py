"""Speculative drafts checked against a request's constraints (grammar, allowed_token_ids, bad
words), so that a constrained request speculates and its tokens stay exactly those without
speculation. The engine core's calls around a step (EngineCore):

    after step N      cut_drafts          the proposals, each cut at its first forbidden token
                                          and before a token that would end its grammar
    before step N+1   step_masks.with_token_masks
                                          a mask per verification row: row j allows what may
                                          follow the outputs and drafts 0..j-1
    after step N+1    run_lengths         a run cut at its grammar's end (sampled drafts only
                                          ever pass it), before the scheduler learns it

Every matcher tries the drafts tentatively and rolls them back (RequestConstraints); only the
accepted tokens advance it (step_masks.advance_matchers).

Why the verification stays exact: each row is sampled as the same output position would be
without speculation, with that position's mask (rejection_sampler.py), so the first row whose
sample differs from its draft is the first token the two runs could differ at, and the rows
after it are dropped; the masks of rows past a forbidden draft do not matter. Cutting a draft
list is exact for one-hot drafts (n-gram, suffix, greedy or seeded draft-model drafts: the
tokens do not depend on where verification stops), but not for sampled drafts (a draft model's,
random requests without a seed): whether a cut happens would depend on the draw, and the
general-q rule needs the draw's q on every row. So those are never cut; a forbidden sampled
draft is simply rejected (the target gives it probability 0), and a run past the grammar's end
is trimmed after the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import Request


def cut_drafts(
    drafts: dict[str, list[int]],
    requests: dict[str, Request],
    constrained: AbstractSet[str],
    sampled: Callable[[Request], bool],
) -> dict[str, list[int]]:
    """``drafts`` (req_id -> the next step's proposal) with each constrained request's
    one-hot drafts cut at the first token its constraints forbid, and before one that would end
    its grammar (RequestConstraints.num_draft_tokens); requests left with none are dropped.
    ``sampled(request)``: whether its drafts are sampled (never cut: module docstring)."""
    out = dict(drafts)
    for rid, proposal in drafts.items():  # the proposals, not every constrained request
        if rid not in constrained:
            continue
        req = requests.get(rid)
        if not proposal or req is None or req.constraints is None or sampled(req):
            continue
        n = req.constraints.num_draft_tokens(req.output_token_ids, proposal)
        if n:
            out[rid] = proposal[:n]
        else:
            del out[rid]
    return out


def run_lengths(
    so: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    requests: dict[str, Request],
    dead_ends: dict[str, int],
) -> ModelRunnerOutput:
    """``runner_output`` with each run of a constrained request that verified drafts cut
    after the token that ends its grammar, and after its dead-end row (step_masks: the row
    that allows only EOS), so that nothing is emitted past where the request ends without
    speculation; ``runner_output`` itself when nothing is cut."""
    drafts = so.scheduled_spec_decode_tokens
    cuts: dict[int, int] = {}
    for i, (rid, tokens) in enumerate(
        zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
    ):
        req = requests.get(rid)
        if rid not in drafts or len(tokens) < 2 or req is None or req.constraints is None:
            continue
        n = req.constraints.run_length(tokens)
        if rid in dead_ends:
            n = min(n, dead_ends[rid] + 1)
        if n < len(tokens):
            cuts[i] = n
    if not cuts:
        return runner_output
    ids = runner_output.req_ids
    sampled = [
        t[: cuts[i]] if i in cuts else t for i, t in enumerate(runner_output.sampled_token_ids)
    ]
    logprobs = dict(runner_output.logprobs)
    for i, n in cuts.items():
        if ids[i] in logprobs:
            logprobs[ids[i]] = logprobs[ids[i]][:n]
    return dataclasses.replace(runner_output, sampled_token_ids=sampled, logprobs=logprobs)
