"""The runner's host side of a step: its persistent rows updated from a SchedulerOutput
(``update_states``), and the step's padded host arrays and sampling rows built
(``prepare_step``). Numpy only; the runner (model_runner.py) hands the results to the step's
two jitted halves (step.py)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.runner.buckets import BucketSpec
from jaxserve.runner.input_batch import InputBatch, PreparedBatch
from jaxserve.runner.prompt_logprobs import PromptLogprobs
from jaxserve.runner.sampling_metadata import SamplingInputs, SamplingMetadata
from jaxserve.runner.spec_rows import logits_row_owners, write_drafts
from jaxserve.runner.token_constraints import ALL_ALLOWED


def update_states(
    so: SchedulerOutput,
    ib: InputBatch,
    sampling: SamplingInputs,
    prompt_logprobs: PromptLogprobs,
    num_logprobs: dict[str, int],
) -> None:
    """Finished and preempted requests leave their slots, new ones take slots (with their
    sampling settings and logprob bookkeeping), running ones learn their new blocks."""
    for req_id in so.finished_req_ids:
        prompt_logprobs.drop(req_id)
        num_logprobs.pop(req_id, None)
    for req_id in so.finished_req_ids | so.preempted_req_ids:
        slot = ib.remove(req_id)
        if slot is not None:
            sampling.clear(slot)
    for new in so.scheduled_new_reqs:
        slot = ib.add(
            new.req_id,
            new.token_ids,
            new.num_prompt_tokens,
            new.block_ids,
            new.num_computed_tokens,
        )
        prompt, outputs = (
            new.token_ids[: new.num_prompt_tokens],
            new.token_ids[new.num_prompt_tokens :],
        )
        sampling.set_request(slot, new.sampling_params, new.seed, prompt, outputs)
        if new.sampling_params.logprobs is not None:
            num_logprobs[new.req_id] = new.sampling_params.logprobs
        if new.sampling_params.prompt_logprobs is not None:
            prompt_logprobs.add(new.req_id, new.sampling_params.prompt_logprobs)
    for cached in so.scheduled_cached_reqs:
        ib.update_cached(cached.req_id, cached.num_computed_tokens, cached.new_block_ids)


def prepare_step(
    so: SchedulerOutput,
    ib: InputBatch,
    sampling: SamplingInputs,
    buckets: BucketSpec,
    masks_later: Collection[str] = (),
) -> tuple[PreparedBatch, SamplingMetadata, dict[str, int]]:
    """The step's padded host arrays, its sampling rows' settings, and the sampling row of
    each request of ``masks_later``. The masks of ``so`` go in as they are; the rows of
    ``masks_later`` (constrained requests whose masks are built after the forward half is
    dispatched) are all-allowed rows of the list variant until the runner writes their masks
    (ModelRunner.dispatch_sample)."""
    req_ids = list(so.num_scheduled_tokens)
    num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(req_ids))
    padded_tokens = buckets.padded_tokens(int(num_scheduled.sum()))
    padded_rows = buckets.padded_rows(padded_tokens)
    num_drafts = write_drafts(ib, req_ids, so.scheduled_spec_decode_tokens)
    batch = ib.prepare(req_ids, num_scheduled, padded_tokens, padded_rows,
                       buckets.padded_width, num_drafts)  # fmt: skip
    # One sampling row per logits row: a request's k + 1 rows sample output positions
    # pos .. pos + k, each with its own key (rejection_sampler.py).
    row_slots, row_offsets = logits_row_owners(batch.slots, batch.num_drafts)
    # Samples still in flight come before this step's (their ids are on the device only).
    known = ib.num_tokens[row_slots] + ib.num_pending[row_slots]
    output_pos = known - ib.num_prompt_tokens[row_slots] + row_offsets
    masks = {ib.slot_of[rid]: row for rid, row in so.token_masks.items()}
    later = {ib.slot_of[rid]: rid for rid in masks_later if rid in ib.slot_of}
    if later:
        allowed = np.full(sampling.num_mask_words, ALL_ALLOWED, np.uint32)
        masks.update(dict.fromkeys(later, allowed))
    sampling_md = sampling.build(row_slots, padded_rows, output_pos, masks)
    # A request's last logits row samples its next token (the only one without drafts).
    mask_rows = {later[s]: r for r, s in enumerate(row_slots.tolist()) if s in later}
    return batch, sampling_md, mask_rows
