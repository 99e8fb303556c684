"""StepCalls: how ModelRunner calls its jitted step programs on a prepared batch: the forward
half, then the sample half (step.py), or, where the plan fuses them (the CPU), the one fused
program (fused_step.py) in the sample half's place, the forward half only staging the step.

A mixin of ModelRunner (model_runner.py), which owns the state these calls read and replace:
params, KV pages (donated to every call), ``last_sampled`` (token_feed.py), the draft model,
and the jitted programs with their compilation counters (``_forward``, ``_sample``,
``_fused``; ``fused_compiles`` is None when the step is split).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxserve.runner.draft_model import DraftModel
from jaxserve.runner.fused_step import StagedForward
from jaxserve.runner.input_batch import PreparedBatch
from jaxserve.runner.job_shapes import fused_shape
from jaxserve.runner.sampling_metadata import SamplingMetadata
from jaxserve.runner.step import attention_metadata
from jaxserve.runner.step_trace import StepTrace
from jaxserve.runner.token_feed import TokenFeed


class StepCalls:
    """The step's calls on prepared batches (ModelRunner's; see the module docstring)."""

    def run_prepared(
        self,
        batch: PreparedBatch,
        sampling_md: SamplingMetadata,
        prompt_targets: np.ndarray | None = None,  # i32[T]; None: no prompt logprobs
        trace: StepTrace | None = None,
    ) -> tuple[Any, Any, Any]:
        """Run both jitted halves on a prepared batch (its KV writes land in the pages);
        warm-up and benchmarks call it with synthetic batches of a bucket's shape. Returns
        the sampler's output, the prompt logprobs and the tokens each request's logits rows
        emit (rejection_sampler.py), on device."""
        forward = self.run_forward(batch, prompt_targets, trace)
        out, num_emitted, plp = self.run_sample(batch, forward, sampling_md, trace)
        return out, plp, num_emitted

    def run_forward(
        self,
        batch: PreparedBatch,
        prompt_targets: np.ndarray | None = None,  # i32[T]; None: no prompt logprobs
        trace: StepTrace | None = None,
    ) -> tuple[Any, Any, Any, Any] | StagedForward:
        """The forward half on a prepared batch: (logits, prompt logprobs, pending outputs,
        the draft model's DraftQ or None), on device; the KV pages are the forward's now.
        With the plan's fused step and a shape it fuses (job_shapes.fused_shape), nothing runs
        yet: a StagedForward for run_sample."""
        if prompt_targets is None:
            prompt_targets = np.full(batch.input_ids.shape, -1, np.int32)
        shape = (len(batch.input_ids), *batch.block_tables.shape)  # (T, R, B)
        if self.fused_compiles is not None and fused_shape(shape):
            return StagedForward(prompt_targets)
        args, draft_q = self._forward_args(batch, prompt_targets)
        start = time.perf_counter()
        self.kv_caches, logits, plp, pending, draft_kv = self._forward(*args)
        if self.draft is not None:
            self.draft.took_step(draft_kv)
        if trace is not None:
            trace.record_dispatch(start, time.perf_counter() - start)
        return logits, plp, pending, draft_q

    def run_sample(
        self, batch: PreparedBatch, forward: Any, sampling_md: SamplingMetadata, trace=None
    ) -> tuple[Any, Any, Any]:
        """The sample half after ``forward`` (run_forward's result; a StagedForward: the fused
        step, forward and sample at once): (sampler output, tokens emitted per segment, prompt
        logprobs), on device; its samples are recorded for the next step."""
        sampling_md = self.sampling.neutral.on_device(sampling_md)  # sent once (neutral_lists)
        if isinstance(forward, StagedForward):
            return self._run_fused(batch, forward.prompt_targets, sampling_md, trace)
        logits, plp, pending, draft_q = forward
        start = time.perf_counter()
        out, num_emitted, self.last_sampled = self._sample(
            logits, pending, batch.draft_ids, sampling_md, self.last_sampled,
            batch.sample_slot, draft_q,
        )  # fmt: skip
        if trace is not None:
            trace.add_dispatch(time.perf_counter() - start)
        return out, num_emitted, plp

    def _run_fused(
        self, batch: PreparedBatch, prompt_targets: np.ndarray, sampling_md: SamplingMetadata, trace
    ) -> tuple[Any, Any, Any]:
        """The fused step (fused_step.py): run_forward's and run_sample's work in one call."""
        args, draft_q = self._forward_args(batch, prompt_targets)
        start = time.perf_counter()
        self.kv_caches, plp, draft_kv, out, num_emitted, self.last_sampled = self._fused(
            *args, batch.draft_ids, sampling_md, self.last_sampled, batch.sample_slot, draft_q
        )
        if self.draft is not None:
            self.draft.took_step(draft_kv)
        if trace is not None:
            trace.record_dispatch(start, time.perf_counter() - start)
        return out, num_emitted, plp

    def _forward_args(self, batch: PreparedBatch, prompt_targets: np.ndarray) -> tuple:
        """(FORWARD_ARGS of ``batch``, read from the runner's state now; the draft's DraftQ)."""
        draft, rows = self.draft, len(batch.draft_ids)
        q_rows = None if draft is None else draft.q_rows_of(batch.req_ids, batch.num_drafts, rows)
        draft_params, draft_kv, draft_q = DraftModel.step_args(draft, q_rows)
        md = attention_metadata(batch, self.rope_tables, self.kv_scales)
        feed = TokenFeed(self.last_sampled, batch.from_slot)
        return (self.params, self.kv_caches, batch.input_ids, md, batch.logits_indices,
                prompt_targets, feed, draft_params, draft_kv), draft_q  # fmt: skip
