"""Each step's token masks, and the matchers' advance after it: the engine core's two calls
into structured outputs (EngineCore.step). Host side, over the scheduler's requests."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set as AbstractSet

import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request
from jaxserve.structured.batch_fill import fill_batched
from jaxserve.structured.bitmask import ALL_ALLOWED, set_bits

logger = logging.getLogger("jaxserve")


def with_token_masks(
    so: SchedulerOutput, requests: dict[str, Request], constrained: AbstractSet[str]
) -> tuple[SchedulerOutput, dict[str, int]]:
    """``so`` with the mask of every scheduled request that has constraints and samples this
    step (its chunk reaches its last token); ``so`` itself when there is none. Also the dead
    ends (``token_masks``). ``constrained``: the ids of the requests that may have
    constraints (the others are not looked at)."""
    return with_masks_of(so, sampling_constrained(so, requests, constrained))


def with_masks_of(
    so: SchedulerOutput, sampling: list[Request]
) -> tuple[SchedulerOutput, dict[str, int]]:
    """``so`` with the masks of ``sampling`` (token_masks), and their dead ends; ``so`` itself
    when there is none (the masks of a step dispatched before its step before was learned are
    built this way once it is: EngineCore._dispatch_sample)."""
    masks, dead_ends = token_masks(sampling, so)
    return (dataclasses.replace(so, token_masks=masks) if masks else so), dead_ends


def sampling_constrained(
    so: SchedulerOutput, requests: dict[str, Request], constrained: AbstractSet[str]
) -> list[Request]:
    """The requests of ``constrained`` that have constraints and sample in ``so``, asked
    right after it was scheduled (a step still in flight, async scheduling, counts as done:
    the request samples when this step's tokens reach its last one, placeholders included)."""
    sampling = []
    # The step's requests (at most max_num_seqs), not every constrained one: a long queue of
    # constrained requests costs a step nothing. The scheduler's order: deterministic rows.
    for rid in so.num_scheduled_tokens:
        if rid not in constrained:
            continue
        req = requests.get(rid)
        if req is None or req.constraints is None:
            continue
        # The scheduler counted this step's sample among the placeholders (step_batch.py).
        end = req.num_computed_tokens + req.num_inflight_tokens
        placeholders = req.num_output_placeholders
        if placeholders and end >= req.num_tokens + placeholders - 1:
            sampling.append(req)
    return sampling


def token_masks(
    sampling: list[Request], so: SchedulerOutput
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The masks of ``sampling`` (requests with constraints that sample in ``so``, whose
    matchers have accepted every output token so far; finished ones are skipped): one row
    u32[ceil(V / 32)], or with k speculative drafts one per verification row,
    u32[1 + k, ceil(V / 32)], row j the mask after drafts 0..j-1 (draft_checks.py). Also the
    dead ends: request -> the first row whose constraints leave no token at all (a grammar and
    allowed_token_ids that do not meet, bad words that ban every allowed id); that row allows
    EOS only, and the caller ends the request with "abort" once a step reaches the row
    (dead_ends_reached)."""
    sampling = [req for req in sampling if not req.is_finished]
    if not sampling:
        return {}, {}
    drafts = [so.scheduled_spec_decode_tokens.get(req.request_id, []) for req in sampling]
    # One block for the step's rows (each request's rows a contiguous view): no allocation per
    # request.
    num_words = sampling[0].constraints.num_words
    block = np.full((len(sampling) + sum(map(len, drafts)), num_words), ALL_ALLOWED, np.uint32)
    # The grammars' rows in one call where the backend has a batch fill (batch_fill.py); the
    # rest row by row.
    batched = fill_batched(sampling, drafts, block)
    masks: dict[str, np.ndarray] = {}
    spans = []  # (request, its first row, its rows filled)
    start = 0
    for req, draft_ids, filled in zip(sampling, drafts, batched, strict=True):
        rows = block[start : start + 1 + len(draft_ids)]
        if filled is None:
            filled = req.constraints.fill_masks(rows, req.output_token_ids, draft_ids)
        masks[req.request_id] = rows if draft_ids else rows[0]
        spans.append((req, start, filled))
        start += rows.shape[0]
    return masks, _dead_ends(block, spans)


def _dead_ends(block: np.ndarray, spans: list[tuple[Request, int, int]]) -> dict[str, int]:
    """Each request's first filled row that allows nothing (``spans``: request, first row,
    rows filled; a row past those is all-allowed), made to allow EOS only."""
    empty = np.flatnonzero(~block.any(axis=1))
    if not empty.size:
        return {}
    dead_ends: dict[str, int] = {}
    firsts = np.array([start for _, start, _ in spans])
    for row in empty.tolist():
        req, start, filled = spans[int(np.searchsorted(firsts, row, side="right")) - 1]
        rid = req.request_id
        if row - start < filled and rid not in dead_ends:
            logger.warning("request %s: its constraints allow no token; it ends", rid)
            set_bits(block[row], req.eos_token_ids)
            dead_ends[rid] = row - start
    return dead_ends


def dead_ends_reached(outputs: list[EngineCoreOutput], dead_ends: dict[str, int]) -> list[str]:
    """The requests of ``dead_ends`` (request -> its dead-end row) whose step emitted that
    row's token: they end. A dead end past a rejected draft is not reached (its next step
    finds it again, at row 0)."""
    if not dead_ends:
        return []
    emitted = {o.req_id: len(o.new_token_ids) for o in outputs}
    return [rid for rid, row in dead_ends.items() if row == 0 or emitted.get(rid, 0) > row]


def advance_matchers(
    outputs: list[EngineCoreOutput], requests: dict[str, Request]
) -> tuple[list[str], list[str]]:
    """Feed each unfinished constrained request the tokens it accepted this step.

    Returns:
        (requests whose grammar is complete: they finish with "stop", requests whose matcher
        rejected a token: they finish with "abort"; the caller ends both).
    """
    complete, failed = [], []
    for out in outputs:
        if out.finish_reason is not None or not out.new_token_ids:
            continue
        req = requests.get(out.req_id)
        if req is None or req.constraints is None:
            continue
        verdict = req.constraints.accept(out.new_token_ids)
        if verdict == "stop":
            complete.append(out.req_id)
        elif verdict == "error":
            reason = req.constraints.matcher.error()
            logger.error("request %s: its grammar rejected a token (%s)", out.req_id, reason)
            failed.append(out.req_id)
    return complete, failed


def with_finish_reasons(
    outputs: list[EngineCoreOutput], reasons: dict[str, str]
) -> list[EngineCoreOutput]:
    """The outputs, those named in ``reasons`` finished with the given reason."""
    if not reasons:
        return outputs
    return [
        dataclasses.replace(o, finish_reason=reasons[o.req_id]) if o.req_id in reasons else o
        for o in outputs
    ]
