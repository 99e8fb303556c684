"""Host-side layout of the logits rows of a step with speculative drafts: which token rows are
sampled, which draft each row verifies, which request and output position each row samples for,
and the tokens each request keeps afterwards (the device half is rejection_sampler.py).

A request verifying k drafts owns k + 1 consecutive logits rows, the last k + 1 token rows of its
chunk; every other request owns one row, as without speculation:

    token rows:   ... x  d1 d2 d3 | next request ...
    logits rows:      x  d1 d2 d3          draft_ids: d1 d2 d3 -1
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # input_batch imports this module
    from jaxserve.runner.input_batch import InputBatch


def logits_rows(
    ends: np.ndarray, num_drafts: np.ndarray, input_ids: np.ndarray, padded_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """(logits_indices, draft_ids) i32[R] of PreparedBatch: request i, ending at token row
    ends[i] (exclusive), owns 1 + num_drafts[i] logits rows, the last token rows of its chunk;
    each but the last verifies the input token of the next row.

        token rows:   ... x  d1 d2 d3 | next request
        logits rows:      x  d1 d2 d3        (4 rows; drafts verified: d1 d2 d3 -1)
    """
    logits_indices = np.zeros(padded_rows, np.int32)
    draft_ids = np.full(padded_rows, -1, np.int32)
    num_reqs = len(ends)
    if not num_drafts.any():  # the common case: one row per request
        logits_indices[:num_reqs] = ends - 1
        return logits_indices, draft_ids
    per_req = num_drafts + 1
    total = int(per_req.sum())
    if total > padded_rows:
        raise ValueError(f"{total} logits rows (requests + drafts) exceed R={padded_rows}")
    req_of_row = np.repeat(np.arange(num_reqs), per_req)
    back = np.repeat(np.cumsum(per_req), per_req) - np.arange(total)  # k + 1 .. 1 per request
    rows = ends[req_of_row] - back
    logits_indices[:total] = rows
    nxt = np.minimum(rows + 1, len(input_ids) - 1)  # a last row's next is unused
    draft_ids[:total] = np.where(back > 1, input_ids[nxt], -1)
    return logits_indices, draft_ids


def emitted_runs(
    num_drafts: np.ndarray, rows: np.ndarray, all_tokens: np.ndarray, num_emitted: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the sampling requests ``rows`` of a batch that verified drafts (``num_drafts``:
    i32[num_reqs], all requests): each one's first logits row, how many tokens it emits
    (accepted drafts + 1, from the device's ``num_emitted``), and those tokens, back to back
    (``all_tokens``: the token sampled at every logits row)."""
    first = (np.cumsum(num_drafts + 1) - num_drafts - 1)[rows]
    counts = np.asarray(num_emitted)[rows]
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return first, counts, all_tokens[np.repeat(first, counts) + offsets]


def logits_row_owners(slots: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slot, offset) of each logits row: request i's 1 + num_drafts[i] rows in batch order,
    at offsets 0..num_drafts[i] (the output position each row samples, past the request's)."""
    if not num_drafts.any():
        return slots, np.zeros(len(slots), np.int32)
    per_req = num_drafts + 1
    offsets = np.arange(per_req.sum()) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    return np.repeat(slots, per_req), offsets.astype(np.int32)


def write_drafts(
    input_batch: InputBatch, req_ids: list[str], drafts: dict[str, list[int]]
) -> np.ndarray | None:
    """Write a step's speculative drafts into the batch rows (after each request's known
    tokens); i32[num_reqs] drafts per request in batch order, or None when none has any."""
    if not drafts:
        return None
    for req_id, draft_ids in drafts.items():
        input_batch.set_drafts(req_id, draft_ids)
    return np.fromiter((len(drafts.get(r, ())) for r in req_ids), np.int32, len(req_ids))
