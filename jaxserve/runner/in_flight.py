"""InFlightStep: a dispatched engine step whose results are still on the device, and how the
runner collects them (its sampled ids, logprobs and prompt logprobs to the host); ForwardStep:
a step whose forward half is dispatched and whose sample half is not yet.

``ModelRunner.dispatch`` returns one as soon as both jitted halves are enqueued
(``dispatch_forward`` then ``dispatch_sample``: between the two, the host may build the
sample half's token masks while the forward runs); ``collect`` waits
for its sampled ids and turns them into a ModelRunnerOutput. A synchronous engine collects each
step at once; with async scheduling the next step is dispatched first (docs/engine_step.md), so
by the time a step is collected, the runner may have dropped some of its requests (finished,
aborted or preempted since) and given their slots to others: their rows are skipped, and their
samples never reach the host's buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.outputs import ModelRunnerOutput
from jaxserve.runner.input_batch import InputBatch, PreparedBatch
from jaxserve.runner.sampler import logprobs_width
from jaxserve.runner.spec_rows import emitted_runs

if TYPE_CHECKING:
    from jaxserve.runner.prompt_logprobs import PromptLogprobs
    from jaxserve.runner.sampling_metadata import SamplingInputs


@dataclass
class ForwardStep:
    """A step whose forward half is dispatched (ModelRunner.dispatch_forward): its batch, its
    sampling rows' settings on the host (token masks still to be written, at ``mask_rows``),
    and the forward's results on the device. ``batch`` is None for a step that runs no model.
    """

    batch: PreparedBatch | None = None
    sampling_md: Any = None  # SamplingMetadata of numpy arrays
    mask_rows: dict[str, int] = dataclasses.field(default_factory=dict)  # req_id -> its row
    # ModelRunner.run_forward's: (logits f32[R, V], prompt logprobs, pending outputs i32[R],
    # the draft model's DraftQ or None), on device; with the fused step a StagedForward
    forward: Any = ()
    trace: Any = None  # StepTrace, when traced
    kv_loads: dict = dataclasses.field(default_factory=dict)  # InFlightStep.kv_loads
    save_kv: Any = None  # the KV connector's blocks to save once the step is dispatched

    def write_masks(self, token_masks: dict[str, np.ndarray]) -> None:
        """Each mask (req_id -> u32[M]) into its request's sampling row; a request of
        ``mask_rows`` without one keeps its all-allowed row (it finished since: the row's
        sample is dropped)."""
        bitmask = self.sampling_md.token_bitmask
        for req_id, row in token_masks.items():
            r = self.mask_rows.get(req_id)
            if r is not None:
                bitmask[r] = row


@dataclass
class InFlightStep:
    """A step's device results. ``batch`` is None for a step that ran no model (an empty
    SchedulerOutput: the runner only updated its state)."""

    batch: PreparedBatch | None = None
    out: Any = None  # SamplerOutput
    plp: Any = None  # prompt logprobs (LogprobsArrays)
    num_emitted: Any = None  # i32[R] tokens each logits segment emits
    # KV connector loads written by this step's dispatch: req_id -> blocks (ModelRunnerOutput)
    kv_loads: dict[str, int] = field(default_factory=dict)

    def ready(self) -> None:
        """Block until the step's sampled ids are computed."""
        if self.out is not None:
            jax.block_until_ready(self.out.token_ids)


def live_sampling_rows(batch: PreparedBatch, ib: InputBatch) -> np.ndarray:
    """Batch rows that sampled and whose request still holds the slot it had (a request gone
    since, or its slot given to another, is skipped)."""
    rows = np.flatnonzero(batch.sampling_rows)
    slot_of, slots, req_ids = ib.slot_of, batch.slots, batch.req_ids
    live = [slot_of.get(req_ids[r]) == slots[r] for r in rows.tolist()]
    return rows if all(live) else rows[np.array(live, bool)]


def collect(
    step: InFlightStep,
    ib: InputBatch,
    sampling: SamplingInputs,
    num_logprobs: dict[str, int],
    prompt_logprobs: PromptLogprobs,
    vocab_size: int,
) -> ModelRunnerOutput:
    """Sampled tokens (and logprobs) back to the host; the persistent rows learn them. A
    request that verified drafts gets its accepted drafts and one more token."""
    batch = step.batch
    if batch is None:
        return ModelRunnerOutput(kv_loads=step.kv_loads)
    rows = live_sampling_rows(batch, ib)  # requests that sample
    slots = batch.slots[rows]
    req_ids = [batch.req_ids[r] for r in rows.tolist()]
    all_tokens = np.asarray(step.out.token_ids)
    if batch.num_drafts.any():
        first, counts, token_ids = emitted_runs(batch.num_drafts, rows, all_tokens,
                                                step.num_emitted)  # fmt: skip
        ib.append_token_runs(slots, counts, token_ids)
        sampling.append_output_tokens(np.repeat(slots, counts), token_ids)
        sampled = [t.tolist() for t in np.split(token_ids, np.cumsum(counts)[:-1])]
    else:  # one token per request: the common path, kept lean
        first, counts, token_ids = rows, np.ones(len(rows), np.int64), all_tokens[rows]
        ib.append_tokens(slots, token_ids)
        sampling.append_output_tokens(slots, token_ids)
        sampled = [[t] for t in token_ids.tolist()]
    result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_loads=step.kv_loads)
    if num_logprobs and any(req_id in num_logprobs for req_id in req_ids):
        _attach_logprobs(result, jax.device_get(step.out), num_logprobs, first, counts,
                         logprobs_width(vocab_size))  # fmt: skip
    if prompt_logprobs:
        live = dataclasses.replace(batch, req_ids=_live_req_ids(batch, ib))
        if prompt_logprobs.owed_in(live):
            prompt_logprobs.collect(live, jax.device_get(step.plp), ib, result)
    return result


def _attach_logprobs(
    result: ModelRunnerOutput,
    host_out: Any,
    wanted: dict[str, int],
    first: np.ndarray,
    counts: np.ndarray,
    width: int,
) -> None:
    """The top logprobs of each sampled token of the requests that asked for them."""
    for i, req_id in enumerate(result.req_ids):
        num = wanted.get(req_id)
        if num is not None:
            start = int(first[i])
            result.logprobs[req_id] = [
                host_out.token_logprobs(r, min(num, width))
                for r in range(start, start + int(counts[i]))
            ]


def _live_req_ids(batch: PreparedBatch, ib: InputBatch) -> list[str | None]:
    """The batch's request ids, None for a row whose request left its slot since."""
    slot_of = ib.slot_of
    return [
        rid if slot_of.get(rid) == slot else None
        for rid, slot in zip(batch.req_ids, batch.slots.tolist(), strict=True)
    ]
