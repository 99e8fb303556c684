"""Each step's token masks, and the matchers' advance after it: the engine core's two calls
into structured outputs (EngineCore.step). Host side, over the scheduler's requests."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import EngineCoreOutput
from jaxserve.request import Request
from jaxserve.structured.bitmask import ALL_ALLOWED, set_bits

logger = logging.getLogger("jaxserve")


def with_token_masks(
    so: SchedulerOutput, requests: dict[str, Request], constrained: Iterable[str]
) -> tuple[SchedulerOutput, list[str]]:
    """``so`` with the mask row (u32[ceil(V / 32)]) of every scheduled request that has
    constraints and samples this step (its chunk reaches its last token); ``so`` itself when
    there is none. Also the dead ends (``token_masks``). ``constrained``: the ids of the
    requests that may have constraints (the others are not looked at)."""
    sampling = sampling_constrained(so, requests, constrained)
    if not sampling:
        return so, []
    masks, dead_ends = token_masks(sampling)
    return dataclasses.replace(so, token_masks=masks), dead_ends


def sampling_constrained(
    so: SchedulerOutput, requests: dict[str, Request], constrained: Iterable[str]
) -> list[Request]:
    """The requests of ``constrained`` that have constraints and sample in ``so``, asked
    right after it was scheduled (a step still in flight, async scheduling, counts as done:
    the request samples when this step's tokens reach its last one, placeholders included)."""
    sampling = []
    scheduled = so.num_scheduled_tokens
    for rid in constrained:
        num = scheduled.get(rid)
        req = requests.get(rid)
        if num is None or req is None or req.constraints is None:
            continue
        # The scheduler counted this step's sample among the placeholders (step_batch.py).
        end = req.num_computed_tokens + req.num_inflight_tokens
        placeholders = req.num_output_placeholders
        if placeholders and end >= req.num_tokens + placeholders - 1:
            sampling.append(req)
    return sampling


def token_masks(sampling: list[Request]) -> tuple[dict[str, np.ndarray], list[str]]:
    """The mask row of each of ``sampling`` (requests with constraints, whose matchers have
    accepted every output token so far; finished ones are skipped), and the dead ends:
    requests whose constraints leave no token at all (a grammar and allowed_token_ids that
    do not meet, bad words that ban every allowed id); their row allows EOS only, and the
    caller ends them with "abort" after the step."""
    sampling = [req for req in sampling if not req.is_finished]
    if not sampling:
        return {}, []
    # One block for the step's rows (each row a contiguous view): no allocation per request.
    block = np.full((len(sampling), sampling[0].constraints.num_words), ALL_ALLOWED, np.uint32)
    masks: dict[str, np.ndarray] = {}
    dead_ends: list[str] = []
    for req, row in zip(sampling, block, strict=True):
        rid = req.request_id
        req.constraints.fill_mask(row, req.output_token_ids)
        if not row.any():
            logger.warning("request %s: its constraints allow no token; it ends", rid)
            set_bits(row, req.eos_token_ids)
            dead_ends.append(rid)
        masks[rid] = row
    return masks, dead_ends


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
