"""The batch fill of a step's grammar masks: every constrained row of the step in one call into
the grammar library (its BatchMaskFiller: llguidance's Rust threads, the GIL released) instead
of one call per row (RequestConstraints.fill_masks: a mask, and with drafts a consume and a
rollback, per row). Host side: step_masks.token_masks calls it, then fills row by row the
requests it leaves (None): no grammar (bad words or allowed_token_ids only), a backend without
a batch fill, and the rows that the batch cannot settle (RequestConstraints.finish_masks).

The filler writes straight into the step's block where the library's row width is the block's
(else into a block of its own, ANDed in). A request with nothing but a grammar and no drafts is
then done; the others go through finish_masks, which applies allowed_token_ids and the bad
words and stops where fill_masks stops. The rows are bit-identical to the per-row path's
(tests/structured/test_batch_fill.py).
"""

from __future__ import annotations

import numpy as np

from jaxserve.request import Request
from jaxserve.structured.backend import BatchMaskFiller


def fill_batched(
    sampling: list[Request], drafts: list[list[int]], block: np.ndarray
) -> list[int | None]:
    """Fill the rows of ``sampling`` (the step's constrained requests, in ``block`` in turn:
    request i owns 1 + len(drafts[i]) rows, prefilled with ALL_ALLOWED) whose matcher has a
    batch filler. Returns, per request, the rows filled (fill_masks' count), or None where the
    request is left to fill_masks (its rows still all-allowed)."""
    filled: list[int | None] = [None] * len(sampling)
    groups: dict[int, tuple[BatchMaskFiller, list[tuple[int, int]]]] = {}
    start = 0
    for i, (req, draft_ids) in enumerate(zip(sampling, drafts, strict=True)):
        matcher = req.constraints.matcher
        filler = None if matcher is None else matcher.batch_filler
        if filler is not None:
            groups.setdefault(id(filler), (filler, []))[1].append((i, start))
        start += 1 + len(draft_ids)
    for filler, members in groups.values():
        if filler.bitmask_words == block.shape[1]:
            _fill_in_place(filler, members, sampling, drafts, block, filled)
        else:
            _fill_apart(filler, members, sampling, drafts, block, filled)
    return filled


def _fill_in_place(
    filler: BatchMaskFiller,
    members: list[tuple[int, int]],
    sampling: list[Request],
    drafts: list[list[int]],
    block: np.ndarray,
    filled: list[int | None],
) -> None:
    """One filler's requests (``members``: (index in sampling, first row in block)), written
    straight into ``block``; the rows of a request with drafts zeroed first (finish_masks
    tells an unwritten row by it)."""
    jobs, to_finish = [], []
    for i, start in members:
        draft_ids, constraints = drafts[i], sampling[i].constraints
        if draft_ids:
            block[start : start + 1 + len(draft_ids)] = 0
        jobs.append((constraints.matcher, start, draft_ids))
        if draft_ids or constraints.allowed is not None or constraints.bad_words:
            to_finish.append((i, start))
        else:
            filled[i] = 1  # the grammar's row is the whole mask
    filler.fill_rows(jobs, block)
    for i, start in to_finish:
        req, draft_ids = sampling[i], drafts[i]
        rows = block[start : start + 1 + len(draft_ids)]
        filled[i] = req.constraints.finish_masks(rows, rows, req.output_token_ids, draft_ids)


def _fill_apart(
    filler: BatchMaskFiller,
    members: list[tuple[int, int]],
    sampling: list[Request],
    drafts: list[list[int]],
    block: np.ndarray,
    filled: list[int | None],
) -> None:
    """As _fill_in_place, for a library row wider than the block's (logits narrower than the
    tokenizer): its rows in a zeroed block of their own, then finished into ``block``."""
    jobs, offsets, num_rows = [], [], 0
    for i, _ in members:
        jobs.append((sampling[i].constraints.matcher, num_rows, drafts[i]))
        offsets.append(num_rows)
        num_rows += 1 + len(drafts[i])
    grammar = np.zeros((num_rows, filler.bitmask_words), np.uint32)
    filler.fill_rows(jobs, grammar)
    for (i, start), offset in zip(members, offsets, strict=True):
        req, k = sampling[i], 1 + len(drafts[i])
        filled[i] = req.constraints.finish_masks(
            block[start : start + k], grammar[offset : offset + k], req.output_token_ids, drafts[i]
        )
